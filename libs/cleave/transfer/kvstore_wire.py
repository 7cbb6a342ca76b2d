"""KVStore Put messages encoded straight from a block's bytes: one copy of the payload.

A Put streams one `cleave.v1.KVBlock` per block, and a block holds every layer's K and V
(512 KiB on a Llama-3.2-1B-shaped model, so 16 MiB per 512-token prompt). Built as protobuf
objects, each payload is copied three times on the sender (into `bytes`, into the message,
out again when gRPC serializes it), all with the GIL held, on the prefill worker whose engine
thread and event loop need that GIL. `encode_kv_block` writes the message's wire bytes
instead: the small fields go through protobuf, the payload's bytes are appended once. Proto
serializers write fields in field-number order and `payload` (KVBlock) and `data` (Tensor)
are the last fields, so the bytes equal `KVBlock(...).SerializeToString()`; the stream sends
them as they are (`PUT_METHOD` with no request serializer).
"""

from __future__ import annotations

from collections.abc import Sequence

from cleave.proto.cleave.v1 import common_pb2, kvstore_pb2

_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]
PUT_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Put'].name}"  # "/cleave.v1.KVStore/Put"
_LENGTH_DELIMITED = 2  # protobuf wire type of bytes and sub-messages


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
