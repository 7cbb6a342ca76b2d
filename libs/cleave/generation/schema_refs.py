"""The `$ref`s of a JSON schema, checked before the workers compile it
(`StructuredOutput.validate`, so in the gateway, before a request is placed).

xgrammar resolves local references only: JSON pointers into the schema itself ("#",
"#/$defs/name"). Any other (a URL, a relative file name, an anchor such as "#name") it
compiles as any JSON value, with a warning on the worker's stderr and the reference's
siblings ("type", ...) dropped with it, and nothing is fetched: the answer would silently go
unconstrained there. Such a reference is refused.

A chain of references that comes back to itself with no schema on the way (`{"$ref": "#"}`,
a -> b -> a; a reference's siblings do not count, as xgrammar reads none) the compiler
refuses too, but on a worker, after compiling whatever it reached first (0.37 s for a chain of
1000 references ahead of the loop): it is refused here, in one pass (4 ms for a loop of 2000
references in 64 KiB). A loop through a schema with content (a property, an item, an anyOf
branch) is recursion, and legal.

A chain that does end is refused past `MAX_REF_CHAIN` references in a row: the compiler's
time grows superlinearly with a chain's length (250 references 0.008 s, 1000 0.38 s, 2000
2.0 s on a worker's compile thread). Converting a schema on one CPU core, a chain of 64 took
0.001 s, and 29 chains of 64 filling 64 KiB 0.02 s.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from urllib.parse import unquote

from cleave.errors import InvalidArgument

# Keywords whose value is a schema or a list of schemas, and those whose value maps names to
# schemas; any other keyword's value is data (`const`, `enum`, `default`), which may hold a
# "$ref" key that refers to nothing.
_SUBSCHEMAS = frozenset({
    "items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "contains",
    "propertyNames", "not", "if", "then", "else", "contentSchema", "allOf", "anyOf", "oneOf", "prefixItems",
})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                             "dependencies"})
# References a chain may follow in a row before it reaches a schema with content (64, like
# the nesting bound `MAX_SCHEMA_DEPTH`); real schemas follow one or two.
MAX_REF_CHAIN = 64


def check_refs(schema: object, field: str) -> None:
    """Raise InvalidArgument (naming `field`) when a `$ref` of `schema` (parsed JSON) is not
    a JSON pointer into `schema` itself, or a chain of them loops or runs past `MAX_REF_CHAIN`."""
    settled: dict[int, int] = {}  # a schema whose chain of references ends -> the references it follows
    for node, pointer in _schemas(schema):
        ref = node.get("$ref")
        if not isinstance(ref, str):
            continue
        if _is_local(ref):
            _check_chain(schema, node, pointer, settled, field)
        else:
            raise InvalidArgument(
                f"schema's $ref {ref!r} at {pointer} is not a local reference; only local references are "
                "supported (\"#\" or \"#/...\": JSON pointers into this schema), and nothing is fetched: "
                "copy the schema it names under $defs and refer to it as \"#/$defs/<name>\"", field=field)


def relocated(schema: object, pointer: str) -> object:
    """A copy of `schema` (parsed JSON) to be placed at `pointer` ("#/..."), a JSON pointer
    into another schema: its local `$ref`s ("#", "#/$defs/name", ...) rewritten to point where
    their targets now sit, under `pointer` (a tool's parameters with their own $defs, nested
    in the list of calls a forced tool choice decodes under). Other references stay as they
    are, for `check_refs` to refuse."""
    copy = json.loads(json.dumps(schema))
    for node in [node for node, _ in _schemas(copy)]:  # all found before any is rewritten
        ref = node.get("$ref")
        if isinstance(ref, str) and _is_local(ref):
            node["$ref"] = pointer + ref[1:]
    return copy


def _check_chain(root: object, node: dict, pointer: str, settled: dict[int, int], field: str) -> None:
    """Follow references from `node` (at `pointer`) while each leads to another; refuse a
    chain that comes back to a schema on it, or follows more than `MAX_REF_CHAIN`. Each
    schema is followed once over all calls: `settled` keeps how many references it follows."""
    on_chain: dict[int, int] = {}  # a schema of the chain -> its place in `pointers`
    pointers: list[str] = []
    beyond = 0  # references followed past the end of `pointers` (from a settled schema)
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if id(node) in settled:
            beyond = settled[id(node)]
            break
        if id(node) in on_chain:
            loop = [*pointers[on_chain[id(node)]:], pointer]
            raise InvalidArgument(f"schema's $ref chain {_named(loop)} comes back to itself with no schema "
                                  "on the way; point the $ref at a schema with content (a type, properties, "
                                  "anyOf, ...)", field=field)
        on_chain[id(node)] = len(pointers)
        pointers.append(pointer)
        pointer = node["$ref"]
        if not _is_local(pointer):  # refused where the walk reaches it
            break
        node = _resolve(root, pointer)
    if (length := len(pointers) + beyond) > MAX_REF_CHAIN:
        raise InvalidArgument(f"schema's $ref chain from {pointers[0]} follows {length} references in a row "
                              f"before it reaches a schema with content; at most {MAX_REF_CHAIN}: point the $ref "
                              "at the schema the chain ends in", field=field)
    settled.update((schema_id, length - place) for schema_id, place in on_chain.items())


def _named(chain: list[str]) -> str:
    """A chain of pointers as text; a long one named by its ends."""
    if len(chain) > 6:
        chain = [*chain[:3], f"... ({len(chain) - 5} more)", *chain[-2:]]
    return " -> ".join(chain)


def _is_local(ref: str) -> bool:
    """Whether `ref` is a JSON pointer into the schema itself, the only references resolved."""
    return ref == "#" or ref.startswith("#/")


def _resolve(root: object, ref: str) -> object | None:
    """The value the local reference `ref` points to in `root` (RFC 6901, percent-decoded as
    a URI fragment, as xgrammar reads it), or None when it points nowhere."""
    node = root
    for token in ref[2:].split("/") if ref != "#" else ():
        key = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _schemas(root: object) -> Iterator[tuple[dict, str]]:
    """Every schema object of `root` once, with its JSON pointer, breadth first in the
    document's order (so a loop is named from where the schema first enters it): those under
    the schema keywords, and those a local reference points to (wherever they are)."""
    seen: set[int] = set()
    pending: deque[tuple[object, str]] = deque([(root, "#")])
    while pending:
        node, pointer = pending.popleft()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, pointer
        ref = node.get("$ref")
        if isinstance(ref, str) and _is_local(ref):
            pending.append((_resolve(root, ref), ref))
        for key, value in node.items():
            where = f"{pointer}/{_escape(key)}"
            if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                pending.extend((child, f"{where}/{_escape(name)}") for name, child in value.items())
            elif key in _SUBSCHEMAS and isinstance(value, list):
                pending.extend((child, f"{where}/{index}") for index, child in enumerate(value))
            elif key in _SUBSCHEMAS:
                pending.append((value, where))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
