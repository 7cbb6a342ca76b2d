"""A JSON schema's `$ref`s are checked before it is compiled: a reference that is not a JSON
pointer into the schema (which xgrammar compiles as any JSON value, fetching nothing) is
refused naming the request's field, wherever a schema may hold it; local references, and
"$ref" keys in data, pass."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.schema_refs import check_refs
from cleave.generation.structured_output import StructuredOutput

REMOTE = "https://example.com/s.json"


@pytest.mark.parametrize(("schema", "ref", "pointer"), [
    ({"$ref": REMOTE}, REMOTE, "#"),
    ({"type": "object", "properties": {"a": {"$ref": REMOTE}}}, REMOTE, "#/properties/a"),
    ({"type": "object", "properties": {"a": {"$ref": REMOTE, "type": "integer"}}}, REMOTE, "#/properties/a"),
    ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"$ref": "other.json#/x"}]}}, "other.json#/x",
     "#/items/anyOf/1"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#name"}}}, "#name", "#/$defs/a"),  # an anchor
    ({"$id": "https://example.com/r", "$ref": "https://example.com/r#/$defs/a", "$defs": {"a": {}}},
     "https://example.com/r#/$defs/a", "#"),
    ({"properties": {"a/b": {"additionalProperties": {"$ref": "s.json"}}}}, "s.json",
     "#/properties/a~1b/additionalProperties"),
    # reached only through a local reference into a place no keyword names
    ({"$ref": "#/x-shared/a", "x-shared": {"a": {"$ref": REMOTE}}}, REMOTE, "#/x-shared/a"),
])
def test_a_reference_out_of_the_schema_is_refused_naming_the_field(schema, ref, pointer):
    with pytest.raises(InvalidArgument) as raised:
        check_refs(schema, "response_format.json_schema.schema")
    assert raised.value.field == "response_format.json_schema.schema"
    assert f"$ref {ref!r} at {pointer} is not a local reference" in raised.value.message
    assert "only local references" in raised.value.message


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"$ref": "#/definitions/a%20b", "definitions": {"a b": {"type": "string"}}},
    {"$ref": "#/$defs/t/0", "$defs": {"t": [{"type": "integer"}]}},
    {"const": {"$ref": REMOTE}},  # data, not a schema
    {"enum": [{"$ref": REMOTE}], "default": {"$ref": REMOTE}, "examples": [{"$ref": REMOTE}]},
    {"properties": {"$ref": {"type": "string"}}},  # a property named "$ref"
    {"$ref": "#/$defs/missing"},  # points nowhere: the compiler refuses it, naming the pointer
    True,
])
def test_local_references_and_data_pass(schema):
    check_refs(schema, "guided_json")


def test_validate_checks_the_references_of_a_json_schema():
    with pytest.raises(InvalidArgument, match="not a local reference") as raised:
        StructuredOutput.json_schema({"$ref": REMOTE}).validate("sampling.structured_output")
    assert raised.value.field == "sampling.structured_output"


@pytest.mark.parametrize(("schema", "loop"), [
    ({"$ref": "#"}, "# -> #"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"properties": {"p": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a", "type": "string"}}},
     "#/$defs/a -> #/$defs/a"),  # a reference's siblings are not read: no content
    ({"$ref": "#/definitions/t/0", "definitions": {"t": [{"$ref": "#/definitions/t/0"}]}},
     "#/definitions/t/0 -> #/definitions/t/0"),
    ({"$ref": "#/not", "not": {"$ref": "#"}}, "# -> #/not -> #"),
])
def test_a_chain_of_references_back_to_itself_is_refused_naming_it(schema, loop):
    with pytest.raises(InvalidArgument) as raised:
        check_refs(schema, "sampling.structured_output")
    assert raised.value.field == "sampling.structured_output"
    assert f"$ref chain {loop} comes back to itself with no schema on the way" in raised.value.message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}}},
    {"allOf": [{"$ref": "#"}]},
    {"$ref": "#/$defs/a0", "$defs": {**{f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(100)},
                                      "a100": {"type": "string"}}},
    {"properties": {f"p{i}": {"$ref": "#/$defs/a"} for i in range(50)}, "$defs": {"a": {"$ref": "#/$defs/b"},
                                                                                "b": {"type": "integer"}}},
])
def test_recursion_through_a_schema_with_content_passes(schema):
    check_refs(schema, "guided_json")


def test_a_long_loop_is_named_by_its_ends():
    links = {f"a{i}": {"$ref": f"#/$defs/a{(i + 1) % 2000}"} for i in range(2000)}
    with pytest.raises(InvalidArgument) as raised:
        check_refs({"$ref": "#/$defs/a0", "$defs": links}, "guided_json")
    assert "#/$defs/a0 -> #/$defs/a1 -> #/$defs/a2 -> ... (1996 more) -> #/$defs/a1999 -> #/$defs/a0 " \
        in raised.value.message
    assert len(raised.value.message) < 300
