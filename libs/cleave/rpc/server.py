"""`serve()`: the one way every cleave service runs its gRPC server.

A served process goes through NOT_SERVING (bound, loading) -> SERVING (`set_ready()`) ->
NOT_SERVING (draining, on SIGTERM/SIGINT or `drain()`) -> stopped. A service with a `Drainable`
backend drains for real: health says NOT_SERVING at once, the backend refuses new work
(UNAVAILABLE with a retry hint) while health, load, abort and token streams stay open, and
admitted work gets `grace_seconds` to finish before the server stops; without one, in-flight
calls get the grace period (`grpc.aio.Server.stop`). Health is reported per service name and overall (""), so load
balancers and `cleave health` can wait for readiness. A service whose readiness depends on
others (the gateway: on its workers) hands `run_service` a `Readiness`, and health follows it
between SERVING and NOT_SERVING after start-up; draining wins over it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cleave.config import RpcConfig, ServiceConfig
from cleave.parent_death import follow_parent
from cleave.rpc.auth import MetadataAuth
from cleave.rpc.client import channel_options
from cleave.rpc.connection_limits import connection_cap, raise_open_file_limit
from cleave.rpc.interceptor import RequestInterceptor
from cleave.tracing import TRACING_OFF, Tracing

if TYPE_CHECKING:
    from cleave.metrics.service import ServiceMetrics

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServiceRegistration:
    """A servicer and the generated function that adds it to a server.

    Example: `ServiceRegistration("cleave.v1.Gateway", servicer,
    gateway_pb2_grpc.add_GatewayServicer_to_server)`.
    """

    name: str  # full service name, as reflection and health report it
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


class Server:
    """A started gRPC server: its bound port, readiness and shutdown."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        service_names: Sequence[str],
        host: str,
        port: int,
        grace_seconds: float,
    ) -> None:
        self._server = server
        self._health = health_servicer
        self._service_names = tuple(service_names)
        self._grace_seconds = grace_seconds
        self._drain_task: asyncio.Task[None] | None = None
        self._work: Drainable | None = None
        self._health_lock = asyncio.Lock()  # one set_ready at a time: the last one asked wins everywhere
        self.host = host
        self.port = port
        self.log = structlog.get_logger("cleave.rpc").bind(port=port)

    @property
    def address(self) -> str:
        """host:port the server listens on (with the real port when 0 was asked for)."""
        return f"{self.host}:{self.port}"

    async def set_ready(self, ready: bool = True) -> None:
        """Report SERVING (or NOT_SERVING again) for every service and overall; ignored once
        draining (which reports NOT_SERVING for good)."""
        status = _SERVING if ready else _NOT_SERVING
        async with self._health_lock:
            if self._drain_task is not None:
                return
            for name in (*self._service_names, ""):
                await self._health.set(name, status)
        self.log.info("ready" if ready else "not ready")

    async def follow(self, readiness: Readiness) -> None:
        """Report `readiness` now, then every change of it (until draining)."""
        readiness.watch(self.set_ready)
        await self.set_ready(readiness.is_ready)

    def drain_work_of(self, work: Drainable) -> None:
        """Have a drain wait for `work`'s admitted requests before the server stops."""
        self._work = work

    async def drain(self, grace_seconds: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, give in-flight calls the grace period.

        Safe to call more than once; later calls wait for the first drain to finish.
        """
        if self._drain_task is None:
            grace = self._grace_seconds if grace_seconds is None else grace_seconds
            self._drain_task = asyncio.ensure_future(self._drain(grace))
        await asyncio.shield(self._drain_task)

    async def _drain(self, grace_seconds: float) -> None:
        self.log.info("draining", grace_seconds=grace_seconds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        await self._health.enter_graceful_shutdown()
        if self._work is not None and grace_seconds > 0:
            try:
                await asyncio.wait_for(self._work.drain(), grace_seconds)
                self.log.info("drained: admitted work finished")
            except asyncio.TimeoutError:
                self.log.warning("grace period over with work still running", grace_seconds=grace_seconds)
        await self._server.stop(max(deadline - loop.time(), 0.0))
        self.log.info("stopped")

    async def wait(self) -> None:
        """Return once the server has stopped (after a drain)."""
        await self._server.wait_for_termination()
        if self._drain_task is not None:
            await self._drain_task

    def handle_signals(self) -> None:
        """Drain on SIGTERM and SIGINT (the process then leaves `wait()` and exits)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        self.log.info("signal received", signal=signal.Signals(signum).name)
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(self._grace_seconds))


def _split_host(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen address {address!r} must be host:port, e.g. 0.0.0.0:50051")
    return host


async def serve(
    services: Sequence[ServiceRegistration],
    address: str,
    config: RpcConfig = RpcConfig(),
    *,
    handle_signals: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tracing: Tracing = TRACING_OFF,
    auth: MetadataAuth | None = None,
    metrics_interceptor: grpc.aio.ServerInterceptor | None = None,
) -> Server:
    """Start a gRPC server with health, reflection and the request interceptor.

    The server starts NOT_SERVING; call `Server.set_ready()` once the service can take
    traffic. Port 0 in `address` binds a free port, reported as `Server.port`. Every call
    gets a server span in `tracing` (`cleave.tracing.setup_tracing`). With `auth`
    (`cleave.rpc.auth.internal_auth`, `api_key_auth`) every call but health and reflection
    must carry its secret, or ends UNAUTHENTICATED. With `config.tls` the port serves TLS
    (`cleave.tls`; `config.mutual_tls`: clients present a certificate). `metrics_interceptor`
    (`cleave.rpc.metrics_interceptor`) runs outermost, so it sees the status callers get.
    """
    host = _split_host(address)
    outermost = [metrics_interceptor] if metrics_interceptor is not None else []
    server = grpc.aio.server(
        interceptors=[*outermost, RequestInterceptor(tracing, auth), *interceptors],
        # With SO_REUSEPORT a second process "binds" a port that is in use and the kernel
        # splits connections between the two: only replicas that mean to share ask for it.
        options=[*channel_options(config.max_message_bytes), ("grpc.so_reuseport", int(config.share_port)),
                 ("grpc.max_allowed_incoming_connections", connection_cap(config.max_connections))],
    )
    names = [service.name for service in services]
    for service in services:
        service.add_to_server(service.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in (*names, ""):
        await health_servicer.set(name, _NOT_SERVING)
    if config.reflection:
        reflection.enable_server_reflection(
            (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    try:
        if config.tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, config.tls.server_credentials(mutual=config.mutual_tls))
    except RuntimeError as exc:
        await server.stop(None)
        raise OSError(f"cannot listen on {address}: {exc}; is the port already in use?") from exc
    await server.start()
    handle = Server(server, health_servicer, names, host, port, config.grace_seconds)
    if handle_signals:
        handle.handle_signals()
    handle.log.info("listening", address=handle.address, services=names,
                    tls="off" if config.tls is None else "mutual" if config.mutual_tls and config.tls.ca_file else "on")
    return handle


def write_port_file(path: Path, port: int) -> None:
    """Write the bound port atomically, so a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


ReadyCallback = Callable[[bool], Awaitable[None]]


class Readiness(Protocol):
    """Whether a started service can take traffic now, for a service where that changes
    after start-up (the gateway is ready while a worker can take a request)."""

    @property
    def is_ready(self) -> bool:
        """True when the service can take a request now."""

    def watch(self, on_change: ReadyCallback) -> None:
        """Have `on_change(is_ready)` awaited whenever `is_ready` changes."""


class Drainable(Protocol):
    """A backend whose admitted work a drain waits for."""

    async def drain(self) -> None:
        """Refuse new work from now on (Unavailable, which carries a retry hint) and return
        once every admitted request has finished and its last output went out; the server
        bounds the wait by its grace period, then stops."""


class Lifecycle(Protocol):
    """Start-up and shutdown hooks of a service backend."""

    async def start(self) -> None:
        """Load models, connect peers; the service reports SERVING after this returns."""

    async def shutdown(self) -> None:
        """Release resources after the server stopped."""


def set_gil_switch_interval(ms: float | None) -> None:
    """The process's GIL switch interval (`ServiceConfig.gil_switch_interval_ms`; None: leave
    Python's)."""
    if ms is not None:
        sys.setswitchinterval(ms / 1000)


async def run_service(
    services: Sequence[ServiceRegistration],
    config: ServiceConfig,
    backend: Lifecycle,
    *,
    on_listening: Callable[[str], None] | None = None,
    tracing: Tracing = TRACING_OFF,
    auth: MetadataAuth | None = None,
    readiness: Readiness | None = None,
    work: Drainable | None = None,
    metrics: ServiceMetrics | None = None,
    fatal: Callable[[], Awaitable[BaseException]] | None = None,
) -> None:
    """A service process's life: listen, write the port file, start the backend, report
    SERVING, serve until SIGTERM/SIGINT, drain, shut the backend down. `on_listening` gets
    the bound host:port before the backend starts (a decode worker puts it in its handles);
    `tracing` gets a server span per call; `auth` checks every call's secret (the gateway's
    API key; internal services pass `internal_auth(config.internal_token)`); with
    `readiness`, health follows it after start-up instead of staying SERVING; with `work`, a
    drain refuses new work and waits for the admitted (see `Drainable`); with `metrics`,
    every call is counted and the registry is served on its port from before the backend
    starts until after it shut down; with `fatal` (awaited once the backend started: a
    worker's engine failing, `cleave.worker.engine_failure`), its error ends the service as
    a signal would, and then the process, with exit code 1 (SystemExit), for its supervisor
    to restart."""
    follow_parent(config.parent_pid)  # before anything that takes long: a dead parent ends this
    raise_open_file_limit()  # before the servers size their connection caps from it
    set_gil_switch_interval(config.gil_switch_interval_ms)
    server = await serve(services, config.listen, config.rpc, tracing=tracing, auth=auth,
                         metrics_interceptor=metrics.interceptor if metrics is not None else None)
    if work is not None:
        server.drain_work_of(work)
    if on_listening is not None:
        on_listening(server.address)
    if config.port_file is not None:
        write_port_file(config.port_file, server.port)
    if metrics is not None:
        metrics.start(server.host)
    failure: BaseException | None = None
    try:
        await backend.start()
        if readiness is None:
            await server.set_ready()
        else:
            await server.follow(readiness)
        failure = await _serve_until_stopped(server, fatal)
    finally:
        await server.drain()
        await backend.shutdown()
        if metrics is not None:
            metrics.close()
    if failure is not None:
        raise SystemExit(1)


async def _serve_until_stopped(server: Server, fatal: Callable[[], Awaitable[BaseException]] | None
                               ) -> BaseException | None:
    """Serve until a signal's drain stopped the server (None) or `fatal()` returned (its error)."""
    if fatal is None:
        await server.wait()
        return None
    # `stopped` is left to end with the drain that follows (cancelling grpc's wait for
    # termination cancels the caller's next await too)
    stopped = asyncio.ensure_future(server.wait())
    failed = asyncio.ensure_future(fatal())
    try:
        await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
    if failed.done() and not failed.cancelled():
        error = failed.result()
        server.log.error("the engine failed; stopping this worker so that its supervisor restarts it",
                         error=repr(error))
        return error
    return None
