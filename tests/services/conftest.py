"""Fixtures: the four real servicers (with unwired backends) in one in-process server."""

from __future__ import annotations

import pytest

from cleave.config import ModelConfig
from cleave.rpc import aio_channel, serve
from services.decode.__main__ import registration as decode_registration
from services.decode.servicer import DecodeServicer
from services.gateway.__main__ import registration as gateway_registration
from services.gateway.servicer import GatewayServicer
from services.kvstore.__main__ import registration as kvstore_registration
from services.kvstore.servicer import KVStoreServicer
from services.prefill.__main__ import registration as prefill_registration
from services.prefill.servicer import PrefillServicer
from tests.services.doubles import (
    UnwiredDecodeBackend,
    UnwiredGatewayBackend,
    UnwiredKVStoreBackend,
    UnwiredPrefillBackend,
)

MODEL = ModelConfig(source="org/tiny-model", served_name="tiny", max_context_length=4096)


@pytest.fixture
async def channel():
    """A channel to one server that hosts all four services, ready."""
    registrations = [
        gateway_registration(GatewayServicer(UnwiredGatewayBackend(), [MODEL])),
        prefill_registration(PrefillServicer(UnwiredPrefillBackend("prefill-7"), MODEL.id)),
        decode_registration(DecodeServicer(UnwiredDecodeBackend("decode-3"))),
        kvstore_registration(KVStoreServicer(UnwiredKVStoreBackend())),
    ]
    server = await serve(registrations, "127.0.0.1:0", handle_signals=False)
    await server.set_ready()
    async with aio_channel(server.address) as open_channel:
        yield open_channel
    await server.drain(0)
