"""KVStore KVBlock messages encoded straight from a block's bytes (one copy of the payload)
and decoded into a view of the message's bytes (no copy).

A Put streams one `cleave.v1.KVBlock` per block, and a block holds every layer's K and V
(512 KiB on a Llama-3.2-1B-shaped model, so 16 MiB per 512-token prompt). Built as protobuf
objects, each payload is copied three times on the sender (into `bytes`, into the message,
out again when gRPC serializes it), all with the GIL held, on the prefill worker whose engine
thread and event loop need that GIL. `encode_kv_block` writes the message's wire bytes
instead: the small fields go through protobuf, the payload's bytes are appended once. Proto
serializers write fields in field-number order and `payload` (KVBlock) and `data` (Tensor)
are the last fields, so the bytes equal `KVBlock(...).SerializeToString()`; the stream sends
them as they are (`PUT_METHOD` with no request serializer).

`decode_kv_block` is the receiving side (the store's Put, a client's Get): protobuf would
copy the payload into its message and again out of it on each read of `data`; the decoder
reads the small fields and returns the payload as a memoryview of the message it was given.
It accepts what a protobuf parser accepts for this message (fields in any order, unknown
fields, packed or unpacked `shape`, a repeated field's last value), and hands anything else
it does not take apart itself (a `payload` split over several fields, groups) to protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from cleave.proto.cleave.v1 import common_pb2, kvstore_pb2

_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
PUT_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Put'].name}"  # "/cleave.v1.KVStore/Put"
GET_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Get'].name}"  # "/cleave.v1.KVStore/Get"
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5  # protobuf wire types


def _varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field_number: int) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED)


_PAYLOAD_TAG = _tag(kvstore_pb2.KVBlock.DESCRIPTOR.fields_by_name["payload"].number)
_DATA_TAG = _tag(common_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number)


def encode_kv_block(
    block_hash: bytes,
    parent_hash: bytes,
    layout_id: str,
    dtype: int,
    shape: Sequence[int],
    data: memoryview,
) -> bytes:
    """Wire bytes of `KVBlock(hash, parent_hash, layout_id, payload=Tensor(dtype, shape,
    data))`, copying `data` (the block's raw bytes, `cleave.v1.DType` `dtype`) once."""
    head = kvstore_pb2.KVBlock(hash=block_hash, parent_hash=parent_hash, layout_id=layout_id).SerializeToString()
    tensor_head = common_pb2.Tensor(dtype=dtype, shape=shape).SerializeToString()
    num_data_bytes = data.nbytes
    if num_data_bytes:  # proto3 leaves an empty bytes field out
        tensor_head += _DATA_TAG + _varint(num_data_bytes)
    tensor_length = len(tensor_head) + num_data_bytes
    return b"".join((head, _PAYLOAD_TAG, _varint(tensor_length), tensor_head, data))


@dataclass(frozen=True)
class WireKVBlock:
    """A `cleave.v1.KVBlock` read from its wire bytes; `data` views those bytes (no copy), so
    it keeps the whole message alive. Unvalidated: `dtype` is the raw `cleave.v1.DType`."""

    hash: bytes
    parent_hash: bytes
    layout_id: str
    has_payload: bool
    dtype: int
    shape: tuple[int, ...]
    data: memoryview


class _Unhandled(Exception):
    """Valid protobuf the fast path leaves to the protobuf parser."""


def _read_varint(buffer: memoryview, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end:
            raise DecodeError("truncated varint")
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def _fields(buffer: memoryview, position: int, end: int):
    """(field number, wire type, value, start, stop) of each field in buffer[position:end];
    value is the int of a varint or fixed field; start:stop spans a length-delimited one."""
    while position < end:
        key, position = _read_varint(buffer, position, end)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value = start = stop = 0
        if wire_type == _VARINT:
            value, position = _read_varint(buffer, position, end)
        elif wire_type == _LENGTH_DELIMITED:
            length, start = _read_varint(buffer, position, end)
            stop = position = start + length
            if stop > end:
                raise DecodeError("truncated length-delimited field")
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            if position + size > end:
                raise DecodeError("truncated fixed-width field")
            value = int.from_bytes(buffer[position:position + size], "little")
            position += size
        else:  # groups (deprecated, never written by proto3) or an invalid wire type
            raise _Unhandled
        yield number, wire_type, value, start, stop


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _utf8(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"string field is not UTF-8: {exc}") from exc


def _decode_fast(buffer: memoryview) -> WireKVBlock:
    block_hash = parent_hash = b""
    layout_id = ""
    payload: tuple[int, int] | None = None
    for number, wire_type, _, start, stop in _fields(buffer, 0, len(buffer)):
        if wire_type != _LENGTH_DELIMITED:
            if number <= 4:
                raise _Unhandled  # a known field of another wire type: protobuf keeps it as unknown
            continue  # an unknown field
        if number == 1:
            block_hash = bytes(buffer[start:stop])
        elif number == 2:
            parent_hash = bytes(buffer[start:stop])
        elif number == 3:
            layout_id = _utf8(buffer[start:stop])
        elif number == 4:
            if payload is not None:
                raise _Unhandled  # protobuf merges repeated sub-messages
            payload = (start, stop)
    dtype, shape, data = 0, [], buffer[0:0]
    if payload is not None:
        for number, wire_type, value, start, stop in _fields(buffer, *payload):
            if number == 1 and wire_type == _VARINT:
                dtype = _int32(value)
            elif number == 2 and wire_type == _VARINT:
                shape.append(_int64(value))
            elif number == 2 and wire_type == _LENGTH_DELIMITED:
                position = start
                while position < stop:
                    value, position = _read_varint(buffer, position, stop)
                    shape.append(_int64(value))
            elif number == 3 and wire_type == _LENGTH_DELIMITED:
                data = buffer[start:stop]
            elif number <= 3:
                raise _Unhandled
    return WireKVBlock(block_hash, parent_hash, layout_id, payload is not None, dtype, tuple(shape), data)


def decode_kv_block(message: bytes) -> WireKVBlock:
    """The fields of a KVBlock's wire bytes, its payload's `data` a view of `message`.
    Raises `google.protobuf.message.DecodeError` where protobuf's parser would."""
    try:
        return _decode_fast(memoryview(message))
    except _Unhandled:
        parsed = kvstore_pb2.KVBlock.FromString(message)
        return WireKVBlock(parsed.hash, parsed.parent_hash, parsed.layout_id, parsed.HasField("payload"),
                           parsed.payload.dtype, tuple(parsed.payload.shape), memoryview(parsed.payload.data))
