"""Frames of the bulk KV control/data socket.

Sender -> receiver, first, when the stack has an internal token (`cleave.rpc.auth`):
    b"CLVKV1" || u32 big-endian N || N bytes of the token (UTF-8); a receiver that has a token
    closes a connection that opens otherwise.
Sender -> receiver, one frame per chunk:
    u32 big-endian N || N bytes of `cleave.v1.KVChunkHeader` || header.byte_length raw bytes
    (TCP transport: the gathered `[2, n, BS, Hkv, D]` tensor; CUDA_IPC and NCCL transports:
    byte_length is 0, the data went through device memory or NCCL).
Receiver -> sender, one frame per finished or failed transfer:
    u32 big-endian N || N bytes of `cleave.v1.ErrorDetail`; `request_id` is the transfer id,
    `code` is ERROR_CODE_UNSPECIFIED when every layer arrived.
"""

from __future__ import annotations

import asyncio
import struct

import grpc
from google.protobuf.message import DecodeError

from cleave.errors import CleaveError, InvalidArgument, Unauthenticated
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.errors import error_code_for

MAX_FRAME_BYTES = 1 << 20  # headers hold block ids: 1 MiB is >200k blocks
READ_SLICE_BYTES = 4 << 20
_LENGTH = struct.Struct(">I")
HELLO_MAGIC = b"CLVKV1"
MAX_TOKEN_BYTES = 4096


def encode_frame(message) -> bytes:
    """Length-prefixed serialized protobuf."""
    body = message.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise InvalidArgument(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(body)) + body


def verdict(transfer_id: str, error: CleaveError | None) -> common_pb2.ErrorDetail:
    """The result frame of a transfer: code UNSPECIFIED on success, else the error's code."""
    reply = common_pb2.ErrorDetail(request_id=transfer_id)
    if error is not None:
        reply.code = error_code_for(getattr(grpc.StatusCode, error.status_code, grpc.StatusCode.UNKNOWN))
        reply.message = str(error)
    return reply


def encode_hello(internal_token: str) -> bytes:
    """The first bytes a sender writes on a connection: the stack's internal token."""
    body = internal_token.encode()
    return HELLO_MAGIC + _LENGTH.pack(len(body)) + body


async def read_hello(reader: asyncio.StreamReader) -> bytes:
    """The token a connection opened with (Unauthenticated when it opened with anything else)."""
    if await reader.readexactly(len(HELLO_MAGIC)) != HELLO_MAGIC:
        raise Unauthenticated("the bulk KV connection did not open with the internal token; start the "
                              "sender with the same CLEAVE_INTERNAL_TOKEN as this receiver")
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_TOKEN_BYTES:
        raise Unauthenticated(f"internal token of {length} bytes exceeds {MAX_TOKEN_BYTES}")
    return await reader.readexactly(length)


async def _read_message(reader: asyncio.StreamReader, message_type):
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise InvalidArgument(f"frame length {length} exceeds {MAX_FRAME_BYTES}; corrupt stream?")
    body = await reader.readexactly(length)
    try:
        return message_type.FromString(body)
    except DecodeError as exc:
        raise InvalidArgument(f"corrupt {message_type.DESCRIPTOR.name}: {exc}") from None


async def read_header(reader: asyncio.StreamReader) -> common_pb2.KVChunkHeader:
    """The next chunk header (raises asyncio.IncompleteReadError at end of stream)."""
    return await _read_message(reader, common_pb2.KVChunkHeader)


async def read_reply(reader: asyncio.StreamReader) -> common_pb2.ErrorDetail:
    """The next per-transfer result frame."""
    return await _read_message(reader, common_pb2.ErrorDetail)


async def read_payload(reader: asyncio.StreamReader, into: memoryview) -> None:
    """Fill `into` (a writable byte view) with exactly len(into) bytes from the stream."""
    position, total = 0, len(into)
    while position < total:
        data = await reader.read(min(total - position, READ_SLICE_BYTES))
        if not data:
            raise asyncio.IncompleteReadError(bytes(into[:position]), total)
        into[position : position + len(data)] = data
        position += len(data)


async def skip_payload(reader: asyncio.StreamReader, num_bytes: int) -> None:
    """Read and drop num_bytes (the payload of a refused chunk)."""
    remaining = num_bytes
    while remaining > 0:
        data = await reader.read(min(remaining, READ_SLICE_BYTES))
        if not data:
            raise asyncio.IncompleteReadError(b"", num_bytes)
        remaining -= len(data)
