"""The `$ref`s of a JSON schema, checked before the workers compile it
(`StructuredOutput.validate`, so in the gateway, before a request is placed).

xgrammar resolves local references only: JSON pointers into the schema itself ("#",
"#/$defs/name"). Any other (a URL, a relative file name, an anchor such as "#name") it
compiles as any JSON value, with a warning on the worker's stderr and the reference's
siblings ("type", ...) dropped with it, and nothing is fetched: the answer would silently go
unconstrained there. Such a reference is refused.
"""

from __future__ import annotations

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


def check_refs(schema: object, field: str) -> None:
    """Raise InvalidArgument (naming `field`) when a `$ref` of `schema` (parsed JSON) is not
    a JSON pointer into `schema` itself."""
    for node, pointer in _schemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and not _is_local(ref):
            raise InvalidArgument(
                f"schema's $ref {ref!r} at {pointer} is not a local reference; only local references are "
                "supported (\"#\" or \"#/...\": JSON pointers into this schema), and nothing is fetched: "
                "copy the schema it names under $defs and refer to it as \"#/$defs/<name>\"", field=field)


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
    """Every schema object of `root` once, with its JSON pointer: those under the schema
    keywords, and those a local reference points to (wherever they are), without recursion."""
    seen: set[int] = set()
    pending: list[tuple[object, str]] = [(root, "#")]
    while pending:
        node, pointer = pending.pop()
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
