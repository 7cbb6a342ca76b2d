"""encode_kv_block writes exactly the bytes protobuf would, from one copy of the payload."""

from __future__ import annotations

import pytest
import torch

from cleave.proto.cleave.v1 import common_pb2, kvstore_pb2
from cleave.rpc.kvstore_wire import PUT_METHOD, encode_kv_block
from cleave.transfer.tensors import as_bytes


def reference(block_hash: bytes, parent_hash: bytes, layout_id: str, dtype: int, payload: torch.Tensor) -> bytes:
    return kvstore_pb2.KVBlock(
        hash=block_hash, parent_hash=parent_hash, layout_id=layout_id,
        payload=common_pb2.Tensor(dtype=dtype, shape=payload.shape, data=bytes(as_bytes(payload))),
    ).SerializeToString()


@pytest.mark.parametrize(
    ("shape", "dtype", "parent_hash"),
    [
        ((2, 2, 4, 2, 4), torch.float32, b"p" * 32),  # 512 B: two-byte length varints
        ((16, 2, 16, 8, 64), torch.bfloat16, b""),  # 512 KiB (a 1B-model block): three-byte varints, first block
        ((1, 2, 1, 1, 1), torch.float32, b"q"),  # 8 B: one-byte varints
    ],
)
def test_bytes_equal_protobuf_serialization(shape, dtype, parent_hash):
    payload = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    proto_dtype = common_pb2.DTYPE_BFLOAT16 if dtype is torch.bfloat16 else common_pb2.DTYPE_FLOAT32
    encoded = encode_kv_block(b"h" * 32, parent_hash, "layout-7", proto_dtype, payload.shape, as_bytes(payload))
    assert encoded == reference(b"h" * 32, parent_hash, "layout-7", proto_dtype, payload)
    decoded = kvstore_pb2.KVBlock.FromString(encoded)
    assert (decoded.hash, decoded.parent_hash, decoded.layout_id) == (b"h" * 32, parent_hash, "layout-7")
    assert tuple(decoded.payload.shape) == shape and decoded.payload.data == bytes(as_bytes(payload))


def test_empty_payload_leaves_the_data_field_out():
    empty = torch.empty(0, 2, 4, dtype=torch.float32)
    encoded = encode_kv_block(b"h", b"", "l", common_pb2.DTYPE_FLOAT32, empty.shape, as_bytes(empty))
    assert encoded == reference(b"h", b"", "l", common_pb2.DTYPE_FLOAT32, empty)


def test_put_method_path():
    assert PUT_METHOD == "/cleave.v1.KVStore/Put"
