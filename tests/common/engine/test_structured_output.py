"""Structured outputs in the engine: the sampler's grammar mask per row, EOS only where the
grammar accepts, the compiler's bounds, and a whole generation that must parse."""

from __future__ import annotations

import json

import pytest
import torch

from common.engine.sampler import Sampler, SampleRow
from common.engine.sampling_params import SamplingParams
from common.engine.grammar_masks import GrammarMasks
from common.engine.structured_output import MAX_SCHEMA_BYTES, SCHEMA_PARAM, GrammarCompiler, GrammarError
from common.model.embedded import ensure_embedded_model
from common.model.tokenizer import Tokenizer

CPU = torch.device("cpu")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ensure_embedded_model())


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def allowed_ids(matcher, vocab: int) -> set[int]:
    return set(GrammarMasks().allowed([matcher], vocab, CPU)[0].nonzero().flatten().tolist())


def test_only_the_constrained_row_is_masked(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    vocab = tokenizer.vocab_size
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    matcher = compiler.json_schema(SCHEMA).matcher()
    allowed = allowed_ids(matcher, vocab)
    assert allowed == {tokenizer.encode("{", add_special_tokens=False)[0]} or all(
        tokenizer.decode([t]).startswith("{") for t in allowed)
    x[2, max(set(range(vocab)) - allowed)] = 100.0  # row 2's argmax is a token the grammar forbids
    greedy = SamplingParams(temperature=0, logprobs=0)
    rows = [SampleRow(greedy, 5), SampleRow(greedy, 5), SampleRow(greedy, 5, grammar=matcher), SampleRow(greedy, 5)]
    out = Sampler(CPU)(x, rows)
    plain = Sampler(CPU)(x, [SampleRow(greedy, 5)] * 4)
    assert out.token_ids[2] in allowed
    for i in (0, 1, 3):  # unconstrained rows: the same tokens and logprobs as with no grammar in the batch
        assert out.token_ids[i] == plain.token_ids[i]
        assert out.logprobs[i] == plain.logprobs[i]
    assert out.logprobs[2][out.token_ids[2]] == pytest.approx(torch.log_softmax(x[2], -1)[out.token_ids[2]].item())


def test_sampled_rows_respect_the_mask(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    vocab = tokenizer.vocab_size
    matcher = compiler.json_object().matcher()
    allowed = allowed_ids(matcher, vocab)
    sampler = Sampler(CPU)
    x = torch.zeros(8, vocab)  # uniform: unmasked draws would land anywhere
    for seeded in (None, 7):
        params = SamplingParams(temperature=1.0, seed=seeded)
        shared = [matcher] * 3  # n > 1: the choices' first tokens come from one state
        out = sampler(x, [SampleRow(params, 3 + i, grammar=m) for i, m in enumerate([matcher.fork()] * 5 + shared)])
        assert set(out.token_ids) <= allowed


def test_eos_only_where_the_grammar_accepts(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    vocab, eos = tokenizer.vocab_size, set(tokenizer.eos_token_ids)
    matcher = compiler.json_schema({"type": "integer"}).matcher()
    assert not allowed_ids(matcher, vocab) & eos  # nothing yet: not a number
    assert matcher.advance(tokenizer.encode("7", add_special_tokens=False)[0])
    assert eos <= allowed_ids(matcher, vocab)  # "7" is a whole integer: it may end here
    assert not matcher.is_complete  # ... or take more digits


def test_a_whole_greedy_generation_parses(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """Random logits stand in for a random model: only the grammar makes the text valid JSON."""
    gen = torch.Generator().manual_seed(0)
    matcher = compiler.json_schema(SCHEMA).matcher()
    sampler, tokens = Sampler(CPU, eos_token_ids=tokenizer.eos_token_ids), []
    for position in range(200):
        token = sampler(torch.randn(1, tokenizer.vocab_size, generator=gen),
                        [SampleRow(SamplingParams(temperature=0), position, grammar=matcher)]).token_ids[0]
        assert matcher.advance(token)
        tokens.append(token)
        if matcher.is_complete:
            break
    value = json.loads(tokenizer.decode(tokens))
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)


def test_forked_matchers_move_apart(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    a = compiler.json_schema({"type": "boolean"}).matcher()
    b = a.fork()
    assert a.advance(tokenizer.encode("t", add_special_tokens=False)[0])
    assert allowed_ids(b, tokenizer.vocab_size) != allowed_ids(a, tokenizer.vocab_size)


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "cannot be compiled"),
    ({"type": "strin"}, "cannot be compiled"),
    ({"type": "object", "description": "x" * MAX_SCHEMA_BYTES}, "bytes serialized"),
    ({"type": "object", "properties": {"a": json.loads('{"items":' * 40 + "{}" + "}" * 40)}}, "nests deeper"),
    (["not", "an", "object"], "must be a JSON object"),
])
def test_schemas_it_refuses(compiler: GrammarCompiler, schema, words: str) -> None:
    with pytest.raises(GrammarError, match=words) as caught:
        compiler.json_schema(schema)
    assert caught.value.param == SCHEMA_PARAM


def test_every_choice_of_n_follows_the_grammar(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """n > 1 forks choices from one prompt pass: each gets its own matcher, each parses."""
    from common.engine.config import EngineConfig
    from common.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_num_seqs=8))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=48, n=3, grammar=compiler.json_schema(SCHEMA))
    engine.add_request("r", tokenizer.encode("Hello"), params)
    texts: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.setdefault(out.index, []).extend(out.new_token_ids)
    assert sorted(texts) == [0, 1, 2]
    for tokens in texts.values():
        value = json.loads(tokenizer.decode(tokens))
        assert set(value) == {"n", "ok"}
