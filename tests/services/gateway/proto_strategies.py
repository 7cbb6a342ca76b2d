"""Hypothesis strategies for arbitrary protobuf messages, built from their descriptors.

Every field may be set to any value its wire type can carry: integers at and around the
type's bounds, NaN and infinite floats, any Unicode text, any bytes, enum numbers outside
the declared values (proto3 enums are open), one member of each oneof, nested messages to a
depth limit and repeated fields up to a size cap. `with_invalid_utf8` then corrupts one
string field on the wire, which no generated Python message can hold.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_REPEATED = 8
MAX_DEPTH = 4
_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_SMALL = st.integers(-3, 300)
# text protobuf can encode (no lone surrogates), small and occasionally long
_TEXT = st.one_of(st.text(st.characters(codec="utf-8"), max_size=24),
                  st.sampled_from(["", "<think>", "</think>", "tiny", "\x00", "a" * 5000]))


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    extremes = st.sampled_from([low, high, low + 1, high - 1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1])
    return st.one_of(_SMALL, extremes, st.integers(low, high)).filter(lambda value: low <= value <= high)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INT_BOUNDS:
        return _integers(*_INT_BOUNDS[field.type])
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_ENUM:
        declared = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(declared), _integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field type {field.type} of {field.full_name}")


def messages(message_class: type[Message], sparse: bool = False) -> st.SearchStrategy[Message]:
    """Arbitrary instances of `message_class` (any field may be set to any value); `sparse`:
    each field is set one time in five (so one odd value meets otherwise default fields)."""
    return _messages(message_class.DESCRIPTOR, message_class, 0, sparse)


def variants(base: Message) -> st.SearchStrategy[Message]:
    """`base` (a valid request) with a few fields replaced by arbitrary values: reaches the
    checks behind the first validation error that a wholly random message stops at."""

    def merged(change: Message) -> Message:
        message = type(base)()
        message.CopyFrom(base)
        message.MergeFrom(change)
        return message

    return messages(type(base), sparse=True).map(merged)


def _messages(descriptor: Descriptor, message_class: Any, depth: int, sparse: bool) -> st.SearchStrategy[Message]:
    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = message_class()
        oneof_members = {field.name: oneof.name for oneof in descriptor.oneofs for field in oneof.fields}
        chosen = {oneof.name: draw(st.sampled_from([None, *[f.name for f in oneof.fields]]))
                  for oneof in descriptor.oneofs}
        for field in descriptor.fields:
            if field.name in oneof_members:
                if chosen[oneof_members[field.name]] != field.name:
                    continue
            elif draw(st.integers(0, 4 if sparse else 1)) != 0:
                continue
            _fill(draw, message, field, depth, sparse)
        return message

    return build()


def _fill(draw: st.DrawFn, message: Message, field: FieldDescriptor, depth: int, sparse: bool) -> None:
    is_message = field.type == FieldDescriptor.TYPE_MESSAGE
    if is_message and depth >= MAX_DEPTH:
        return
    if is_message and field.message_type.GetOptions().map_entry:  # map<scalar, scalar>
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        entries = draw(st.dictionaries(_scalar(key), _scalar(value), max_size=MAX_REPEATED))
        getattr(message, field.name).update(entries)
    elif _repeated(field):
        if is_message:
            sub_class = GetMessageClass(field.message_type)
            for item in draw(st.lists(_messages(field.message_type, sub_class, depth + 1, sparse), max_size=MAX_REPEATED)):
                getattr(message, field.name).add().CopyFrom(item)
        else:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=MAX_REPEATED)))
    elif is_message:
        sub_message = getattr(message, field.name)
        sub_message.CopyFrom(draw(_messages(field.message_type, type(sub_message), depth + 1, sparse)))
        sub_message.SetInParent()
    else:
        setattr(message, field.name, draw(_scalar(field)))


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


INVALID_UTF8 = (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"a\xfe")  # stray byte, overlong, surrogate, mixed


def with_invalid_utf8(message: Message, field_name: str, bad: bytes) -> bytes:
    """`message` on the wire with the string `field_name` (a top-level field) set to `bad`:
    invalid UTF-8 that a proto3 string must not hold (a later field wins when parsing)."""
    number = message.DESCRIPTOR.fields_by_name[field_name].number
    return message.SerializeToString() + _varint(number << 3 | 2) + _varint(len(bad)) + bad


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)
