"""An in-process cleave stack for gateway tests: kvstore, prefill, decode and gateway servers
(real servicers and engine backends) on ephemeral ports in the test's event loop. The internal
servers ask for `INTERNAL_TOKEN`, as under `cleave up`; the gateway asks for `api_key` if given."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import openai
from prometheus_client import CollectorRegistry

from cleave.config import ModelConfig
from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.rpc import Readiness, Server, aio_channel, serve
from cleave.api_keys import ApiKeys
from cleave.rpc.auth import MetadataAuth, api_key_auth, internal_auth
from services.decode.__main__ import registration as decode_registration
from services.decode.engine_backend import EngineDecodeBackend
from services.decode.servicer import DecodeServicer
from services.gateway.__main__ import registration as gateway_registration
from services.gateway.client_errors import ClientSafeBackend
from services.gateway.disagg_policy import DisaggregationPolicy
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.model import ServedModel
from services.gateway.router import GatewayOptions, RoutingBackend
from services.gateway.servicer import GatewayServicer
from services.gateway.workers import PoolOptions
from services.kvstore.__main__ import registration as kvstore_registration
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore, StoreConfig
from services.prefill.__main__ import registration as prefill_registration
from services.prefill.engine_backend import EnginePrefillBackend
from services.prefill.servicer import PrefillServicer

MODEL_NAME = "tiny"
NUM_BLOCKS = 96
MAX_MODEL_LEN = 256
REASONING = {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": True}
INTERNAL_TOKEN = secrets.token_urlsafe(16)


def write_reasoning_config(model_dir: Path) -> None:
    """Mark a tiny checkpoint as a reasoning model whose prompt opens the think block."""
    (model_dir / "cleave_config.json").write_text(json.dumps({"reasoning": REASONING}))


def engine_config(model_dir: Path, max_num_seqs: int = 64, max_model_len: int = MAX_MODEL_LEN) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", enforce_eager=True,
        scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
    )


@dataclass
class Stack:
    """Running servers; `gateway_address` / `http_url` are what clients use."""

    servers: list[Server] = field(default_factory=list)
    backends: list = field(default_factory=list)
    decode: list[EngineDecodeBackend] = field(default_factory=list)
    prefill: list[EnginePrefillBackend] = field(default_factory=list)
    router: RoutingBackend | None = None
    kvstore_address: str = ""
    gateway_address: str = ""
    http_url: str = ""
    http_runner: object = None
    openai_clients: dict[str, openai.AsyncOpenAI] = field(default_factory=dict)

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The real OpenAI client of this stack's HTTP API for `api_key`, one a key, closed with
        the stack (in its event loop: a client left open is closed by its finalizer in whatever
        loop runs then, and fails there once its own loop has closed)."""
        client = self.openai_clients.get(api_key)
        if client is None:
            client = openai.AsyncOpenAI(base_url=self.http_url, api_key=api_key, max_retries=0)
            self.openai_clients[api_key] = client
        return client

    async def close(self) -> None:
        for client in self.openai_clients.values():
            await client.close()
        if self.http_runner is not None:
            await self.http_runner.cleanup()  # type: ignore[attr-defined]
        for server in reversed(self.servers):
            await server.drain(0)
        for backend in reversed(self.backends):
            await backend.shutdown()


async def _serve(stack: Stack, registration, backend,  # type: ignore[no-untyped-def]
                 auth: MetadataAuth | None = internal_auth(INTERNAL_TOKEN),
                 readiness: Readiness | None = None) -> Server:
    """Start a backend and serve it, SERVING at once or (with `readiness`) following it, as
    `run_service` does."""
    if backend is not None:
        await backend.start()
        stack.backends.append(backend)
    server = await serve([registration], "127.0.0.1:0", handle_signals=False, auth=auth)
    if readiness is None:
        await server.set_ready()
    else:
        await server.follow(readiness)
    stack.servers.append(server)
    return server


async def start_stack(
    model_dir: Path,
    mode: Literal["disaggregated", "colocated", "conditional"] = "disaggregated",
    num_decode: int = 1,
    health_interval_s: float = 0.2,
    max_migrations: int = GatewayOptions.max_migrations,
    policy: DisaggregationPolicy = DisaggregationPolicy(),
    api_key: str | ApiKeys | None = None,
    num_prefill: int = 1,
    priorities: bool = False,
    max_num_seqs: int = 64,
    max_model_len: int = MAX_MODEL_LEN,
) -> Stack:
    """Start kvstore, prefill (not colocated), decode worker(s) and the gateway (asking
    clients for `api_key`, or one of several, when given; taking requests' priorities with
    `priorities`, as `--scheduling-policy priority` does)."""
    api_keys = ApiKeys((api_key,)) if isinstance(api_key, str) else api_key
    stack = Stack()
    try:
        config = engine_config(model_dir, max_num_seqs, max_model_len)
        store = BlockStore(StoreConfig(ram_bytes=64 * 1024 * 1024))
        kv_server = await _serve(stack, kvstore_registration(KVStoreServicer(store)), None)
        stack.kvstore_address = kv_server.address
        prefill_addresses = []
        for index in range(num_prefill if mode != "colocated" else 0):
            backend = EnginePrefillBackend(config, worker_id=f"prefill-{index}", model_id=MODEL_NAME,
                                           kvstore_address=kv_server.address, internal_token=INTERNAL_TOKEN)
            server = await _serve(stack, prefill_registration(PrefillServicer(backend, MODEL_NAME)), backend)
            stack.prefill.append(backend)
            prefill_addresses.append(server.address)
        decode_addresses = []
        for index in range(num_decode):
            backend = EngineDecodeBackend(config, worker_id=f"decode-{index}", model_id=MODEL_NAME,
                                          transfer_listen="127.0.0.1:0", internal_token=INTERNAL_TOKEN)
            server = await _serve(stack, decode_registration(DecodeServicer(backend)), backend)
            stack.decode.append(backend)
            decode_addresses.append(server.address)
        served = ModelConfig(source=str(model_dir), served_name=MODEL_NAME, max_context_length=max_model_len)
        model = ServedModel(served)
        router = RoutingBackend(
            model, prefill_addresses, decode_addresses,
            GatewayOptions(gateway_id="gw-test", mode=mode,
                           pool=PoolOptions(health_interval_s=health_interval_s, internal_token=INTERNAL_TOKEN),
                           max_migrations=max_migrations, policy=policy, priorities=priorities),
        )
        stack.router = router
        models = [served]
        servicer = GatewayServicer(ClientSafeBackend(router), models, api_keys)
        gateway = await _serve(stack, gateway_registration(servicer), router, auth=api_key_auth(api_keys),
                               readiness=router.routability)
        stack.gateway_address = gateway.address
        api = OpenAIApi(ClientSafeBackend(router), models, lambda token_id: model.tokenizer.decode([token_id]),
                        api_keys=api_keys, routability=router.routability, served_model=model,
                        metrics_registry=CollectorRegistry())
        stack.http_runner = await start_http(api, "127.0.0.1:0")
        stack.http_url = f"http://127.0.0.1:{bound_port(stack.http_runner)}/v1"  # type: ignore[arg-type]
    except BaseException:  # a start that fails part-way stops what it started
        await stack.close()
        raise
    return stack


def channel(stack: Stack):  # type: ignore[no-untyped-def]
    return aio_channel(stack.gateway_address)
