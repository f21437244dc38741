"""Whether a JSON schema admits any finite value, checked before a grammar is built.

llguidance refuses a schema it can see is empty (``minimum`` above ``maximum``, an empty
``enum``, types that exclude each other), but not one that is empty only through recursion:
``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}`` compiles, and its matcher fails at
the first token, when forcing ``{"a":{"a":...`` exhausts its item limit. Such a schema is the
request's fault, so it is found here and refused with a 400 before any token.

The check is the textbook one for an empty grammar (productive symbols, iterated to a fixed
point): a local ``$ref`` target is satisfiable once some finite value of it exists; a schema is
satisfiable if some type it allows has a value whose *required* parts (required properties,
the first ``minItems`` items) are satisfiable. Keywords it does not model (patterns, ``not``,
conditionals) count as satisfiable: it refuses only what surely has no finite value, and
llguidance judges the rest.
"""

from __future__ import annotations

from typing import Any

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def unsatisfiable_refs(schema: Any) -> list[str] | None:
    """None when ``schema`` may have a finite value; else the local ``$ref`` targets that have
    none (``["#"]`` for the root itself), for the error message."""
    refs = _local_refs(schema)
    productive: set[str] = set()
    changed = True
    while changed:  # each pass makes at least one more target productive, or stops
        changed = False
        for ref in refs:
            if ref not in productive and _satisfiable(_resolve(schema, ref), schema, productive):
                productive.add(ref)
                changed = True
    if _satisfiable(schema, schema, productive):
        return None
    return sorted(refs - productive) or ["#"]


def _satisfiable(node: Any, root: Any, productive: set[str]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and _is_local(ref) and ref not in productive:
        return False
    if "const" in node or "enum" in node:  # literal values: finite by nature (llguidance checks them)
        return True
    if isinstance(node.get("allOf"), list) and not all(_satisfiable(s, root, productive) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_satisfiable(s, root, productive) for s in branches):
            return False
    types = node.get("type", list(_TYPES))
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else list(_TYPES)
    return any(_type_satisfiable(node, t, root, productive) for t in types)


def _type_satisfiable(node: dict, type_: Any, root: Any, productive: set[str]) -> bool:
    if type_ == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_satisfiable(props.get(name, extra), root, productive) for name in required if isinstance(name, str))
    if type_ == "array":
        count = node.get("minItems", 0)
        if not isinstance(count, int) or count <= 0:
            return True
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # draft 7's tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        needed = prefix[:count] + ([items] if count > len(prefix) else [])
        return all(_satisfiable(s, root, productive) for s in needed)
    return True


def _local_refs(schema: Any) -> set[str]:
    """Every local ``$ref`` in the document (walked without recursion: schemas come from clients)."""
    refs, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and _is_local(ref):
                refs.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _is_local(ref: str) -> bool:
    return ref == "#" or ref.startswith("#/")


def _resolve(schema: Any, ref: str) -> Any:
    """The target of a local JSON pointer; True (anything) when it does not resolve: llguidance
    reports a dangling pointer itself."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node
