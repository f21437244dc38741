"""The schema check refuses exactly the schemas no finite JSON value satisfies through recursion,
and the compiler turns that into a 400 naming the field, before any matcher runs."""

from __future__ import annotations

import pytest

from common.engine.schema_check import unsatisfiable_refs
from common.engine.structured_output import SCHEMA_PARAM, GrammarCompiler, GrammarError
from common.model.embedded import ensure_embedded_model
from common.model.tokenizer import Tokenizer

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


@pytest.mark.parametrize(("schema", "empty"), [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, ["#"]),
    ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, ["#/$defs/n"]),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ["#"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2}, ["#"]),
    ({"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}, ["#"]),
    ({"allOf": [{"$ref": "#/$defs/n"}], "$defs": {"n": NODE}}, ["#/$defs/n"]),
])
def test_recursion_no_value_can_end_is_found(schema: dict, empty: list[str]) -> None:
    assert unsatisfiable_refs(schema) == empty


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # the recursion is optional
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a number satisfies it
    {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                     "required": ["kids"]}}, "$ref": "#/$defs/n"},  # a tree: [] ends it
    {"$defs": {"l": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"next": {"$ref": "#/$defs/l"}},
                                                  "required": ["next"]}]}}, "$ref": "#/$defs/l"},  # a list ends in null
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # null ends it
    {"type": "object", "properties": {"a": {"$ref": "#/missing"}}, "required": ["a"]},  # llguidance's to refuse
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
])
def test_schemas_with_a_finite_value_pass(schema: dict) -> None:
    assert unsatisfiable_refs(schema) is None


def test_the_compiler_refuses_it_naming_the_field() -> None:
    tokenizer = Tokenizer.from_dir(ensure_embedded_model())
    compiler = GrammarCompiler(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    for param in (SCHEMA_PARAM, "tools"):
        with pytest.raises(GrammarError, match="no finite JSON value satisfies the schema") as caught:
            compiler.json_schema(recursive, param)
        assert caught.value.param == param
    assert compiler.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}}).param == "response_format"
