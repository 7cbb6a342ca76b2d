"""A JSON schema's `$ref`s are checked before it is compiled: a reference that is not a JSON
pointer into the schema (which xgrammar compiles as any JSON value, fetching nothing) is
refused naming the request's field, wherever a schema may hold it; local references, and
"$ref" keys in data, pass."""

from __future__ import annotations

import re

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.schema_refs import MAX_REF_CHAIN, check_refs, relocated
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
    {"$ref": "#/$defs/a0", "$defs": {**{f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(63)},
                                      "a63": {"type": "string"}}},  # 64 references in a row: the most
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


def chain(links: int, start: str) -> dict:
    """A schema whose $ref chain from `start` ("root" or "property") follows `links` references
    in a row, then a string; the later links sit first under $defs, so the check meets them
    before the chain's start."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in reversed(range(links - 1))}
    defs[f"a{links - 1}"] = {"type": "string"}
    if start == "root":
        return {"$defs": defs, "$ref": "#/$defs/a0"}
    return {"$defs": defs, "properties": {"p": {"$ref": "#/$defs/a0"}}}


@pytest.mark.parametrize("start", ["root", "property"])
@pytest.mark.parametrize("links", [MAX_REF_CHAIN + 1, 2000])
def test_a_chain_longer_than_the_bound_is_refused_naming_the_field(start, links):
    with pytest.raises(InvalidArgument) as raised:
        check_refs(chain(links, start), "response_format.json_schema.schema")
    assert raised.value.field == "response_format.json_schema.schema"
    assert f"at most {MAX_REF_CHAIN}" in raised.value.message
    if links == MAX_REF_CHAIN + 1:  # only the chain's start sees it whole
        where = "#" if start == "root" else "#/properties/p"
        assert f"$ref chain from {where} follows {links} references in a row" in raised.value.message
    else:  # refused where the check first meets it past the bound (from the root, or a later link)
        followed = re.search(r"\$ref chain from \S+ follows (\d+) references in a row", raised.value.message)
        assert followed and MAX_REF_CHAIN < int(followed[1]) <= links


@pytest.mark.parametrize("start", ["root", "property"])
def test_a_chain_at_the_bound_passes(start):
    check_refs(chain(MAX_REF_CHAIN, start), "guided_json")
    # many chains of the bound's length, sharing their links, pass too
    schema = chain(MAX_REF_CHAIN, start)
    schema["properties"] = {f"p{i}": {"$ref": f"#/$defs/a{i}"} for i in range(MAX_REF_CHAIN)}
    check_refs(schema, "guided_json")


def test_validate_refuses_a_long_chain():
    spec = StructuredOutput.json_schema(chain(2000, "root"))
    assert len(spec.spec) <= 64 * 1024
    with pytest.raises(InvalidArgument, match="chain from # follows 2000 references in a row") as raised:
        spec.validate("guided_json")
    assert raised.value.field == "guided_json"


def test_a_relocated_schema_refers_into_its_new_place():
    tool = {"type": "object", "$defs": {"a": {"type": "integer"}},
            "properties": {"a": {"$ref": "#/$defs/a"}, "self": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
                           "far": {"$ref": REMOTE}},
            "default": {"$ref": "#/$defs/a"}}
    moved = relocated(tool, "#/properties/p")
    assert moved["properties"]["a"] == {"$ref": "#/properties/p/$defs/a"}
    assert moved["properties"]["self"]["anyOf"][1] == {"$ref": "#/properties/p"}
    assert moved["properties"]["far"] == {"$ref": REMOTE}  # left for check_refs to refuse
    assert moved["default"] == {"$ref": "#/$defs/a"}  # data
    assert tool["properties"]["a"] == {"$ref": "#/$defs/a"}  # a copy
    del moved["properties"]["far"]
    check_refs({"type": "object", "properties": {"p": moved}}, "tool_choice")
