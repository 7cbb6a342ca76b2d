"""decode_kv_block reads what protobuf reads, with the payload a view of the message."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError

from cleave.proto.cleave.v1 import common_pb2 as c, kvstore_pb2 as k
from cleave.rpc.kvstore_wire import WireKVBlock, decode_kv_block, encode_kv_block
from services.kvstore.store import StoreConfig
from tests.services.kvstore.test_store import Store

DATA = bytes(range(256)) * 2


def expected(message: k.KVBlock) -> WireKVBlock:
    return WireKVBlock(message.hash, message.parent_hash, message.layout_id, message.HasField("payload"),
                       message.payload.dtype, tuple(message.payload.shape), memoryview(message.payload.data))


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (lengths < 128)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


CASES = {
    "serialized": k.KVBlock(hash=b"h" * 32, parent_hash=b"p" * 32, layout_id="lay",
                            payload=c.Tensor(dtype=c.DTYPE_BFLOAT16, shape=[2, 128], data=DATA)).SerializeToString(),
    "encoded": encode_kv_block(b"h", b"", "l", c.DTYPE_FLOAT32, (128,), memoryview(DATA)),
    "no payload": k.KVBlock(hash=b"h", layout_id="l").SerializeToString(),
    "empty tensor": k.KVBlock(hash=b"h", payload=c.Tensor(dtype=c.DTYPE_INT8, shape=[0])).SerializeToString(),
    "negative dim": k.KVBlock(hash=b"h", payload=c.Tensor(shape=[-3, 2])).SerializeToString(),
    # fields in reverse order, an unknown varint (9) and an unknown length-delimited field (10)
    "reordered + unknown": field(4, bytes([3 << 3 | 2, 4]) + b"abcd" + bytes([1 << 3, 5])) + bytes([9 << 3, 7])
    + field(10, b"zz") + field(3, b"lay") + field(2, b"pp") + field(1, b"hh"),
    # shape unpacked (one varint field per dimension), and a repeated hash: the last one counts
    "unpacked shape": field(1, b"first") + field(4, bytes([2 << 3, 3, 2 << 3, 5, 1 << 3, 6])) + field(1, b"last"),
    # two payload fields: protobuf merges them (shape appended, data replaced)
    "merged payload": field(4, bytes([2 << 3, 3]) + field(3, b"ab")) + field(4, bytes([2 << 3, 4]) + field(3, b"cd")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fields_equal_protobuf_parse(name):
    message = CASES[name]
    assert decode_kv_block(message) == expected(k.KVBlock.FromString(message))


def test_payload_is_a_view_of_the_message():
    message = CASES["serialized"]
    block = decode_kv_block(message)
    assert block.data.obj is message and block.data.nbytes == len(DATA) and bytes(block.data) == DATA


@pytest.mark.parametrize("message", [
    CASES["serialized"][:-1],  # cut short inside the payload
    field(3, b"\xff\xfe"),  # layout_id is not UTF-8
    bytes([1 << 3 | 2, 0x80]),  # truncated length varint
    bytes([0 << 3 | 2, 0]),  # field number 0
])
def test_invalid_messages_raise_decode_error(message):
    with pytest.raises(DecodeError):
        k.KVBlock.FromString(message)
    with pytest.raises(DecodeError):
        decode_kv_block(message)


async def test_store_answers_invalid_argument_for_a_message_that_does_not_parse():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        put = store.client._channel.stream_unary("/cleave.v1.KVStore/Put", response_deserializer=k.PutResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await put(iter([CASES["serialized"][:-1]]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("blocks[0]: is not a cleave.v1.KVBlock message")
        short = encode_kv_block(b"h", b"", store.client.layout_id, c.DTYPE_FLOAT32, (2, 2, 4, 2, 4), memoryview(DATA[:500]))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await put(iter([short]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(
            "blocks[0].payload.data: holds 500 bytes but shape [2, 2, 4, 2, 4] of float32 needs 512")
