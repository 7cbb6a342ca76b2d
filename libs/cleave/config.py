"""Typed runtime configuration of the cleave services, read once from flags and environment.

Every flag `--some-name` can also be set with the environment variable `CLEAVE_SOME_NAME`;
a flag given on the command line wins over the environment, which wins over the default.
List flags (`--prefill A --prefill B`) read a comma-separated variable (`CLEAVE_PREFILL=A,B`).
The dataclasses are built once in a service's `__main__` and passed down; nothing below reads
the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cleave.api_keys import ApiKeys
from cleave.engine.config import KV_CACHE_DTYPES
from cleave.generation.reasoning_formats import REASONING_PARSERS
from cleave.tls import CA_FLAG, CERT_FLAG, KEY_FLAG, TlsConfig, TlsConfigError

ENV_PREFIX = "CLEAVE_"
SCHEDULING_POLICIES = ("fcfs", "priority")  # the gateway's --scheduling-policy
PRIORITY_FLOOR_PREFIX = "priority>="  # after a key on its line of --api-key-file: the key's priority floor
# The reasoning model shipped inside the package: every service defaults to it, so the stack
# runs with no download.
SHIPPED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "reasoner"
DEFAULT_MODEL = str(SHIPPED_MODEL_DIR)
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # one KVStore.Put message holds a whole block
# The gateway's clients send prompts, not KV: a lower limit refuses a huge request before
# it is read into memory (32 MiB holds a 1M-token prompt as text or as token ids).
DEFAULT_GATEWAY_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # one HTTP request body at the gateway
DEFAULT_PORTS = {"gateway": 50051, "prefill": 50061, "decode": 50071, "kvstore": 50081}
DEFAULT_HTTP_PORT = 8000
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# The shared secret between cleave's services (`cleave.rpc.auth`); `--internal-token-file`
# (env CLEAVE_INTERNAL_TOKEN_FILE) names a file holding it instead.
INTERNAL_TOKEN_ENV = "CLEAVE_INTERNAL_TOKEN"
API_KEY_ENV = "CLEAVE_API_KEY"  # the gateway's --api-key
# Internal services (workers, kvstore) listen on loopback unless told otherwise; the public
# gateway listens on every interface.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RpcConfig:
    """gRPC server settings shared by every service."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 10.0  # in-flight calls get this long to finish on SIGTERM
    reflection: bool = True
    # Bind with SO_REUSEPORT, so replicas of a stateless service (gateways) share one port
    # and the kernel spreads connections over them. Off by default: then a second process
    # on a port in use fails at start instead of silently taking half its connections.
    share_port: bool = False
    # Client connections the server holds at once; past it a connection is closed at once
    # (the gateway's HTTP API answers it 503). None: from the open-file limit
    # (`cleave.rpc.connection_limits`).
    max_connections: int | None = None
    tls: TlsConfig | None = None  # --tls-cert-file / --tls-key-file / --tls-ca-file; None: plain text
    # With `tls` and its CA: clients must present a certificate the CA signed (internal services).
    mutual_tls: bool = False


@dataclass(frozen=True)
class TracingConfig:
    """Where a process's OpenTelemetry spans go (`cleave.tracing.setup_tracing`); neither set:
    tracing is off and costs nothing."""

    service_name: str  # the resource's service.name, e.g. "cleave-decode"
    otlp_endpoint: str | None = None  # OTLP/HTTP collector base URL; spans are POSTed to <url>/v1/traces
    trace_file: Path | None = None  # one JSON object per finished span, appended

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.trace_file is not None


@dataclass(frozen=True)
class MetricsConfig:
    """Where a process serves its Prometheus metrics (`cleave.metrics`); absent: not served."""

    port: int  # 0: any free port
    host: str = ""  # empty: the host of the service's gRPC --listen (internal services stay on loopback)
    port_file: Path | None = None  # the bound port is written here once it listens


@dataclass(frozen=True)
class ServiceConfig:
    """Process-level settings every service has."""

    name: str
    listen: str  # host:port; port 0 picks a free port
    port_file: Path | None = None  # the bound port is written here once the server listens
    log_level: str = "INFO"
    log_json: bool | None = None  # None: JSON unless stderr is a terminal
    rpc: RpcConfig = RpcConfig()
    tracing: TracingConfig = TracingConfig(service_name="cleave")  # off unless an exporter is set
    # Shared secret sent on every call to another cleave service; prefill, decode and kvstore
    # also require it on their own calls (health and reflection stay open). None: auth off.
    internal_token: str | None = field(default=None, repr=False)
    # This process's certificate and key, and its peers' CA (`cleave.tls`): its servers serve
    # TLS, its calls and bulk KV connections to other services use it. None: plain text.
    tls: TlsConfig | None = None
    metrics: MetricsConfig | None = None  # --metrics-port; None: no metrics server
    parent_pid: int | None = None  # --parent-pid: exit with this process (`cleave.parent_death`)
    # How long a thread may hold the GIL while another waits for it (sys.setswitchinterval);
    # None: Python's 5 ms. Workers run the engine's launches on one thread and gRPC on the
    # event loop's: each wake-up of the loop may wait this long for a launch burst.
    gil_switch_interval_ms: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Which model a service serves."""

    source: str = DEFAULT_MODEL  # local model directory (HF layout)
    served_name: str = ""  # id clients use; empty: `source`
    max_context_length: int = 0  # 0: from the model's config
    is_reasoning_model: bool = True
    # thinking tags: auto (cleave_config.json, else recognised from the checkpoint), none, or
    # a named format (`cleave.generation.reasoning_formats.REASONING_PARSERS`)
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"ModelConfig.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    @property
    def id(self) -> str:
        return self.served_name or self.source

    @property
    def effective_reasoning_parser(self) -> str:
        """`reasoning_parser`, or none for a model marked as not reasoning (--no-reasoning-model)."""
        return self.reasoning_parser if self.is_reasoning_model else "none"


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway: public gRPC + OpenAI-compatible HTTP API, routing to workers."""

    service: ServiceConfig
    model: ModelConfig
    http_listen: str | None  # None: no HTTP server
    mode: Literal["disaggregated", "colocated", "conditional"]
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    gateway_id: str
    store_to_kvstore: bool = True  # prefill workers put new prompt blocks into the kvstore
    share_port: bool = False  # gRPC and HTTP ports shared with other gateway replicas (SO_REUSEPORT)
    local_prefill_max_tokens: int = 1024  # conditional mode: longer uncached prompts prefill remotely
    remote_prefill_max_queue_tokens: int = 65536  # conditional mode: ... unless the prefill queue is longer
    remote_prefill_idle_tokens: int = 0  # conditional mode: short prompts too go to a prefill worker this idle
    local_prefill_max_running: int = 32  # conditional mode: a decode worker with more requests sends short prompts
    remote_prefill_busy_max_queue_tokens: int = 8192  # ... to a prefill worker with at most this many queued
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # HTTP body limit (413 above it)
    # prompt text refused before tokenizing above this many UTF-8 bytes; 0: the most the
    # context could hold (max_model_len * the longest token's bytes)
    max_prompt_bytes: int = 0
    # Public routes (HTTP /v1, gRPC Gateway) require `Bearer <key>` for one of the keys
    # (--api-key and each line of --api-key-file); None: open
    api_keys: ApiKeys | None = field(default=None, repr=False)
    max_requests_per_key: int = 0  # requests one API key (with one key or none: all) may run at once; 0: no cap
    # samples (n, or scaling.num_samples under a strategy) one API key may have running at once; 0: no cap
    max_samples_per_key: int = 0
    tenant_metrics: bool = False  # per-key (tag) request and token counters on /metrics
    # "priority": requests may set `priority` (lower scheduled first); "fcfs": a non-zero one is refused
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    http_port_file: Path | None = None  # the HTTP API's bound port is written here once it listens


@dataclass(frozen=True)
class WorkerConfig:
    """A GPU worker (prefill or decode)."""

    service: ServiceConfig
    model: ModelConfig
    worker_id: str
    device: str  # "cuda", "cuda:1", "cpu"
    kvstore_address: str | None  # None: no shared KV store
    num_kv_blocks: int  # 0: size the cache from free device memory
    kv_listen: str  # host:port of the bulk TCP KV endpoint
    dtype: str = "auto"  # weights and KV: auto (checkpoint's on CUDA, float32 on CPU), bfloat16, ...
    block_size: int = 16  # tokens per KV block
    # the KV cache's element type: auto (the model's dtype) or fp8 (float8 e4m3, scale 1.0, half
    # the bytes); a prefill and a decode worker hand KV over only when theirs are the same
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256  # sequences per engine step
    max_num_batched_tokens: int = 2048  # tokens per engine step
    # a prompt with more tokens than this left gets at most this many per step before shorter
    # prompts are admitted, and the rest of the budget after them (0: off)
    long_prefill_token_threshold: int = 0
    # steps between reports of a running request's new tokens (1: every step; a first report
    # and a sample's end go at once); `worker_config` gives decode workers 2
    stream_interval: int = 1
    # a step prefilling one sequence's at most this many new tokens replays a CUDA graph (0: eager;
    # CUDA only: off CUDA workers prefill eagerly whatever this says)
    prefill_graph_max_tokens: int = 1024
    # this process's share of the device's total memory (weights, activations, KV cache);
    # workers sharing one GPU get shares that sum to at most 1 (`cleave up` splits 0.9)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs
    pdl: bool = True  # decode kernels launch with programmatic dependent launch (Hopper+)
    packed_experts: bool = False  # a checkpoint's MXFP4 experts stay packed in memory (gpt-oss)
    transfer_timeout_s: float = 30.0  # an admitted request's KV must arrive (and Start come) by then
    max_queued_admissions: int = 256  # decode: Admits waiting for free KV blocks at most (then RESOURCE_EXHAUSTED)
    # prefill: kvstore prefixes shorter than this are neither fetched nor put (a round trip costs more)
    kvstore_min_prefix_tokens: int = 256
    # prefill: send the KV layer by layer during the forward ("auto": over CUDA IPC only,
    # "on": any transport, "off": after the step)
    layer_streaming: str = "auto"
    # decode: ranks the model is split over, one process each (this one is rank 0;
    # `cleave.worker.rank_processes`); each rank receives its slice of KV sent by prefill workers
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class KVStoreConfig:
    """The content-addressed KV block store."""

    service: ServiceConfig
    ram_bytes: int
    disk_path: Path | None  # None: RAM tier only
    disk_bytes: int


def env_name(flag: str) -> str:
    """`--http-listen` -> `CLEAVE_HTTP_LISTEN`."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    """Parse an environment boolean ("1", "true", "yes", "on" / "0", "false", "no", "off")."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}; use true or false")


class _FlagSet:
    """argparse with environment-variable defaults."""

    def __init__(self, prog: str, environ: Mapping[str, str]) -> None:
        self.parser = argparse.ArgumentParser(prog=prog)
        self.environ = environ
        self._list_defaults: dict[str, tuple[str, ...]] = {}
        self._choices: dict[str, tuple[str, Sequence[Any]]] = {}  # dest -> (flag, choices)

    def add(self, flag: str, default: Any, help: str, aliases: Sequence[str] = (), **kwargs: Any) -> None:
        env = env_name(flag)
        value = self.environ.get(env)
        if kwargs.get("action") == "append":
            parsed = tuple(v for v in value.split(",") if v) if value is not None else default
            help = f"{help} (repeatable; env {env}, comma-separated; default {default})"
            self.parser.add_argument(flag, help=help, **kwargs)
            self._list_defaults[flag] = parsed
            return
        if kwargs.get("action") is argparse.BooleanOptionalAction and value is not None:
            try:
                value = parse_bool(value)
            except ValueError as exc:
                raise SystemExit(f"{env}: {exc}") from exc
        if "choices" in kwargs:
            self._choices[flag.lstrip("-").replace("-", "_")] = (flag, kwargs["choices"])
        self.parser.add_argument(
            flag, *aliases, default=default if value is None else value, help=f"{help} (env {env})", **kwargs
        )

    def parse(self, argv: Sequence[str] | None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        for dest, (flag, choices) in self._choices.items():  # argparse checks the command line's only
            if getattr(args, dest) not in choices:
                raise SystemExit(f"{flag} ({env_name(flag)}): {getattr(args, dest)!r} is not one of "
                                 f"{', '.join(map(str, choices))}")
        for flag, default in self._list_defaults.items():
            dest = flag.lstrip("-").replace("-", "_")
            if getattr(args, dest) is None:
                setattr(args, dest, tuple(default))
            else:
                setattr(args, dest, tuple(getattr(args, dest)))
        return args


def _flags(name: str, environ: Mapping[str, str], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> _FlagSet:
    flags = _FlagSet(f"python -m services.{name}", environ)
    host = "0.0.0.0" if name == "gateway" else LOOPBACK
    flags.add("--listen", f"{host}:{DEFAULT_PORTS[name]}", "gRPC address host:port (port 0: any)")
    flags.add("--port-file", None, "write the bound gRPC port to this file", type=Path)
    flags.add("--log-level", "INFO", "DEBUG, INFO, WARNING or ERROR")
    flags.add("--log-json", None, "JSON log lines (default: unless stderr is a terminal)",
              action=argparse.BooleanOptionalAction)
    flags.add("--max-message-bytes", max_message_bytes, "gRPC message size limit", type=int)
    flags.add("--grace-seconds", 10.0, "time in-flight calls get to finish on SIGTERM", type=float)
    flags.add("--max-connections", None, "client connections each server of this process holds at once (gRPC, "
              "and the gateway's HTTP API); more are closed at once, HTTP ones answered 503 (default: half the "
              "open-file limit left after 256)", type=int)
    flags.add("--trace-file", None, "append this process's trace spans to this JSON-lines file", type=Path)
    # the OpenTelemetry variable is the default, so collectors set up for any OTel app just work
    flags.add("--otlp-endpoint", environ.get(OTLP_ENDPOINT_ENV) or None,
              f"OTLP/HTTP collector URL; spans go to <url>/v1/traces (default: {OTLP_ENDPOINT_ENV})")
    flags.add("--internal-token-file", None, f"file holding the shared secret between cleave services "
              f"(default: env {INTERNAL_TOKEN_ENV}; neither: internal calls are not authenticated)", type=Path)
    flags.parser.set_defaults(internal_token=environ.get(INTERNAL_TOKEN_ENV) or None)
    flags.add(CERT_FLAG, None, "PEM certificate this process serves TLS with and presents to the services it "
              "calls (with --tls-key-file; unset: plain text)", type=Path)
    flags.add(KEY_FLAG, None, "PEM private key of --tls-cert-file", type=Path)
    flags.add(CA_FLAG, None, "PEM CA that signed the peers' certificates: servers this process calls are "
              "checked against it (unset: the system's roots), and prefill, decode and kvstore accept only "
              "clients presenting a certificate it signed", type=Path)
    flags.add("--metrics-port", None, "serve Prometheus metrics at http://<host>:<port>/metrics "
              "(0: any free port; unset: no metrics server)", type=int)
    flags.add("--metrics-host", "", "address the metrics server binds (default: the --listen host)")
    flags.add("--metrics-port-file", None, "write the bound metrics port to this file", type=Path)
    flags.add("--parent-pid", None, "receive SIGTERM (and drain) when this process dies (Linux; `cleave up` "
              "passes its own pid)", type=int)
    flags.add("--gil-switch-interval-ms", None, "longest a thread holds the GIL while another waits "
              "(sys.setswitchinterval; default: Python's 5 ms)", type=float)
    return flags


def _internal_token(args: argparse.Namespace) -> str | None:
    """The token from --internal-token-file, else from CLEAVE_INTERNAL_TOKEN, else None."""
    if args.internal_token_file is None:
        return args.internal_token
    try:
        token = args.internal_token_file.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"--internal-token-file: cannot read {args.internal_token_file}: {exc}") from exc
    if not token:
        raise SystemExit(f"--internal-token-file: {args.internal_token_file} is empty; write the token into it "
                         f"or leave the flag out")
    return token


def gateway_api_keys(environ: Mapping[str, str]) -> ApiKeys | None:
    """The API keys a gateway started with `environ` and no key flags takes (`cleave up`'s
    demo sends the first)."""
    key_file = environ.get(env_name("--api-key-file"))
    return _api_keys(environ.get(API_KEY_ENV) or None, Path(key_file) if key_file else None)


def _api_keys(api_key: str | None, key_file: Path | None) -> ApiKeys | None:
    """The gateway's keys: --api-key's, then each line of --api-key-file; None: none."""
    keys = [api_key] if api_key is not None else []
    floors: dict[str, int] = {}
    if key_file is not None:
        try:
            lines = key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--api-key-file: cannot read {key_file}: {exc}") from exc
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise SystemExit(f"--api-key-file: {key_file} holds no key; write one a line or leave the flag out")
        for line in from_file:
            key, floor = _key_line(line)
            keys.append(key)
            if floor is not None:
                floors[key] = floor
    try:
        return ApiKeys(tuple(keys), floors) if keys else None
    except ValueError as exc:
        raise SystemExit(f"--api-key / --api-key-file: {exc}") from None


def _key_line(line: str) -> tuple[str, int | None]:
    """A key file's line: the key, and its priority floor when `priority>=N` follows it."""
    parts = line.rsplit(None, 1)
    if len(parts) == 2 and parts[1].startswith(PRIORITY_FLOOR_PREFIX):
        value = parts[1].removeprefix(PRIORITY_FLOOR_PREFIX)
        try:
            return parts[0], int(value)
        except ValueError:
            raise SystemExit(f"--api-key-file: {PRIORITY_FLOOR_PREFIX} takes an integer, got {value!r}") from None
    return line, None


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return TlsConfig.from_files(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    except TlsConfigError as exc:
        raise SystemExit(str(exc)) from None


def _add_model_flags(flags: _FlagSet, default_model: str = DEFAULT_MODEL) -> None:
    flags.add("--model", default_model, "model directory (HF layout: config.json, safetensors, tokenizer)")
    flags.add("--served-model-name", "", "model id clients use (default: --model)")
    flags.add("--max-context-length", 0, "context length (0: from the model config)", type=int)
    flags.add("--reasoning-model", True, "the model thinks before answering (--no-reasoning-model: "
              "--reasoning-parser none)", action=argparse.BooleanOptionalAction)
    flags.add("--reasoning-parser", "auto", "thinking tags: auto (cleave_config.json's reasoning section, else "
              "recognised from the checkpoint: gpt-oss, Qwen3, DeepSeek-R1 templates), none, or a named format; "
              "give every service the same value", choices=REASONING_PARSERS)


def _service(name: str, args: argparse.Namespace) -> ServiceConfig:
    if args.max_message_bytes <= 0:
        raise SystemExit("--max-message-bytes must be positive")
    if args.max_connections is not None and args.max_connections < 1:
        raise SystemExit(f"--max-connections must be >= 1, got {args.max_connections}")
    tls = _tls(args)
    return ServiceConfig(
        name=name,
        listen=args.listen,
        port_file=args.port_file,
        log_level=args.log_level,
        log_json=args.log_json,
        rpc=RpcConfig(max_message_bytes=args.max_message_bytes, grace_seconds=args.grace_seconds,
                      max_connections=args.max_connections, tls=tls, mutual_tls=name != "gateway"),
        tracing=TracingConfig(service_name=f"cleave-{name}", otlp_endpoint=args.otlp_endpoint or None,
                              trace_file=args.trace_file),
        internal_token=_internal_token(args),
        tls=tls,
        metrics=_metrics(args),
        parent_pid=args.parent_pid,
        gil_switch_interval_ms=_switch_interval(args.gil_switch_interval_ms),
    )


def _switch_interval(ms: float | None) -> float | None:
    if ms is not None and not 0 < ms <= 1000:
        raise SystemExit(f"--gil-switch-interval-ms must be in (0, 1000], got {ms:g}")
    return ms


def _metrics(args: argparse.Namespace) -> MetricsConfig | None:
    if args.metrics_port is None:
        if args.metrics_port_file is not None:
            raise SystemExit("--metrics-port-file needs --metrics-port (0: any free port)")
        return None
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    return MetricsConfig(port=args.metrics_port, host=args.metrics_host, port_file=args.metrics_port_file)


def _model(args: argparse.Namespace) -> ModelConfig:
    shipped = args.model in ("", DEFAULT_MODEL)  # empty: compose's unset CLEAVE_MODEL
    if not args.reasoning_model and args.reasoning_parser not in ("auto", "none"):
        raise SystemExit(f"--no-reasoning-model contradicts --reasoning-parser {args.reasoning_parser}; "
                         f"drop one of them")
    return ModelConfig(
        source=args.model or DEFAULT_MODEL,
        # the shipped model is "reasoner" to clients, as under `cleave up`, not its install path
        served_name=args.served_model_name or (SHIPPED_MODEL_DIR.name if shipped else ""),
        max_context_length=args.max_context_length,
        is_reasoning_model=args.reasoning_model,
        reasoning_parser=args.reasoning_parser,
    )


def gateway_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> GatewayConfig:
    """Parse the gateway's flags (`python -m services.gateway --help`)."""
    flags = _flags("gateway", environ, max_message_bytes=DEFAULT_GATEWAY_MAX_MESSAGE_BYTES)
    _add_model_flags(flags)
    flags.add("--http-listen", f"0.0.0.0:{DEFAULT_HTTP_PORT}",
              "OpenAI-compatible HTTP address host:port ('' disables it)")
    flags.add("--http-port-file", None, "write the HTTP API's bound port to this file once it listens", type=Path)
    flags.add("--mode", "disaggregated", "how workers are used (conditional: per request, by prompt length, "
              "decode-side cache and prefill queue)", choices=("disaggregated", "colocated", "conditional"))
    flags.add("--local-prefill-max-tokens", 1024, "conditional mode: uncached prompt tokens a decode worker "
              "prefills itself; longer prompts go to a prefill worker", type=int)
    flags.add("--remote-prefill-max-queue-tokens", 65536, "conditional mode: prefill locally when every "
              "prefill worker has more prompt tokens queued than this", type=int)
    flags.add("--local-prefill-max-running", 32, "conditional mode: a decode worker with more requests than "
              "this (running or waiting) sends short prompts too to a prefill worker with at most "
              "--remote-prefill-busy-max-queue-tokens queued: each local prefill stalls every stream there",
              type=int)
    flags.add("--remote-prefill-busy-max-queue-tokens", 8192, "conditional mode: the prefill queue past which "
              "a busy decode worker still prefills short prompts itself (they would wait behind long ones)",
              type=int)
    flags.add("--remote-prefill-idle-tokens", 0, "conditional mode: a prompt short enough to prefill locally "
              "still goes to a prefill worker that has at most this many prompt tokens queued, so an idle "
              "prefill worker takes load off the decode steps (0: short prompts always prefill locally)", type=int)
    flags.add("--share-port", False, "share the gRPC and HTTP ports with other gateway replicas (SO_REUSEPORT: "
              "each replica has its own --gateway-id; the kernel spreads connections over them)",
              action=argparse.BooleanOptionalAction)
    flags.add("--prefill", (), "prefill worker address", action="append")
    flags.add("--decode", (), "decode worker address", action="append")
    flags.add("--gateway-id", "gateway-0", "stable id of this gateway on decode workers")
    flags.add("--store-to-kvstore", True, "prefill workers put new prompt blocks into the kvstore in the background",
              action=argparse.BooleanOptionalAction)
    flags.add("--api-key", None, "clients of the HTTP /v1 routes and the gRPC Gateway service must send "
              "'Authorization: Bearer <key>' (unset: no key asked; prefer the env variable, `ps` shows flags)")
    flags.add("--api-key-file", None, "more API keys, one a line ('#' comments): any one is taken, and with "
              "two or more in all each key's requests share cached prompt prefixes only with each other; "
              "'<key> priority>=N': with --scheduling-policy priority, the key's requests run at priority N or a "
              "less urgent one (a more urgent or absent priority is raised to N)",
              type=Path)
    flags.add("--max-requests-per-key", 0, "requests one API key may have running at once (with one key or none: "
              "all callers together); more are refused at once (RESOURCE_EXHAUSTED / 429, Retry-After 1 s); 0: no cap",
              type=int)
    flags.add("--max-samples-per-key", 0, "samples one API key may have running at once, summed over its "
              "requests (a request's n, or scaling.num_samples under a scaling strategy; with one key or none: all "
              "callers together); a request that would pass it is refused at once (RESOURCE_EXHAUSTED / 429, "
              "Retry-After 1 s), one asking for more by itself is INVALID_ARGUMENT / 400; 0: no cap", type=int)
    flags.add("--tenant-metrics", False, "with several API keys, count each key's finished requests and tokens "
              "under its tag on /metrics (whoever reads /metrics, which asks for no key, sees every key's usage)",
              action=argparse.BooleanOptionalAction)
    flags.add("--scheduling-policy", "fcfs", "priority: a request's `priority` (lower first) orders it among "
              "waiting requests on every worker, and a lower value is preempted last; fcfs: requests in arrival "
              "order, and a non-zero priority is refused (INVALID_ARGUMENT / 400)", choices=SCHEDULING_POLICIES)
    flags.add("--max-request-bytes", DEFAULT_MAX_REQUEST_BYTES, "HTTP request body limit (larger: 413)", type=int)
    flags.add("--max-prompt-bytes", 0, "prompt text limit in UTF-8 bytes, checked before tokenizing "
              "(0: the context length times the longest token's bytes)", type=int)
    args = flags.parse(argv)
    if args.max_request_bytes <= 0 or args.max_prompt_bytes < 0:
        raise SystemExit("--max-request-bytes must be positive and --max-prompt-bytes >= 0")
    if args.max_requests_per_key < 0:
        raise SystemExit(f"--max-requests-per-key must be >= 0 (0: no cap), got {args.max_requests_per_key}")
    if args.max_samples_per_key < 0:
        raise SystemExit(f"--max-samples-per-key must be >= 0 (0: no cap), got {args.max_samples_per_key}")
    for flag in ("--local-prefill-max-tokens", "--remote-prefill-max-queue-tokens", "--remote-prefill-idle-tokens",
                 "--local-prefill-max-running", "--remote-prefill-busy-max-queue-tokens"):
        if getattr(args, flag.lstrip("-").replace("-", "_")) < 0:
            raise SystemExit(f"{flag} must be >= 0")
    service = _service("gateway", args)
    api_keys = _api_keys(args.api_key or None, args.api_key_file)
    if api_keys is not None and api_keys.has_priority_floors and args.scheduling_policy != "priority":
        raise SystemExit(f"--api-key-file: a key's {PRIORITY_FLOOR_PREFIX} takes effect only with "
                         f"--scheduling-policy priority; add it or drop the floors")
    return GatewayConfig(
        service=replace(service, rpc=replace(service.rpc, share_port=args.share_port)),
        share_port=args.share_port,
        model=_model(args),
        http_listen=args.http_listen or None,
        mode=args.mode,
        prefill_addresses=args.prefill,
        decode_addresses=args.decode,
        gateway_id=args.gateway_id,
        store_to_kvstore=args.store_to_kvstore,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        remote_prefill_max_queue_tokens=args.remote_prefill_max_queue_tokens,
        remote_prefill_idle_tokens=args.remote_prefill_idle_tokens,
        local_prefill_max_running=args.local_prefill_max_running,
        remote_prefill_busy_max_queue_tokens=args.remote_prefill_busy_max_queue_tokens,
        max_request_bytes=args.max_request_bytes,
        max_prompt_bytes=args.max_prompt_bytes,
        api_keys=api_keys,
        max_requests_per_key=args.max_requests_per_key,
        max_samples_per_key=args.max_samples_per_key,
        tenant_metrics=args.tenant_metrics,
        scheduling_policy=args.scheduling_policy,
        http_port_file=args.http_port_file,
    )


def worker_config(
    name: Literal["prefill", "decode"], argv: Sequence[str] | None, environ: Mapping[str, str]
) -> WorkerConfig:
    """Parse a prefill or decode worker's flags."""
    flags = _flags(name, environ)
    _add_model_flags(flags)
    flags.add("--worker-id", f"{name}-0", "stable id of this worker")
    flags.add("--device", "cuda", "torch device the model runs on")
    flags.add("--kvstore", "", "kvstore address host:port ('' for none)")
    flags.add("--num-kv-blocks", 0, "KV cache blocks (0: from free device memory)", type=int,
              aliases=("--num-blocks",))
    flags.add("--kv-listen", f"{LOOPBACK}:0", "bulk TCP KV transfer address host:port", aliases=("--transfer-listen",))
    flags.add("--dtype", "auto", "weights and KV dtype: auto, bfloat16, float16 or float32")
    flags.add("--block-size", 16, "tokens per KV block", type=int)
    flags.add("--kv-cache-dtype", "auto", "KV cache element type: auto (the model's dtype) or fp8 (float8 e4m3 "
              "with scale 1.0, values clamped to +-448: half the bytes, so twice the tokens fit; prefill and "
              "decode workers must use the same)", choices=KV_CACHE_DTYPES)
    flags.add("--max-num-seqs", 256, "sequences per engine step", type=int)
    flags.add("--max-num-batched-tokens", 2048, "tokens per engine step", type=int)
    flags.add("--long-prefill-token-threshold", 0,
              "a prompt with more tokens than this left to compute gets at most this many per step until the "
              "shorter prompts waiting behind it are admitted, then the budget they leave (0: off)", type=int)
    # 2 on decode workers: bench/results/disagg/disagg-20261204T155827Z.md (TPOT 3.0 -> 2.4 ms, 13.3k ->
    # 18.1k tok/s, ITL p99 10.0 -> 5.8 ms under 50 users: the worker's host work per token halves)
    flags.add("--stream-interval", 2 if name == "decode" else 1,
              "steps between reports of a running request's new tokens: N > 1 sends a request's tokens of N "
              "steps in one delta, saving host work per token at the cost of burstier streams (a first token "
              "and an end go at once)", type=int)
    # 1024: bench/results/disagg/disagg-20261204T191159Z.md (one user's 512-token TTFT 16.5 -> 10.2 ms
    # colocated, 17.8 -> 12.9 ms disaggregated: the eager forward was launch-bound)
    flags.add("--prefill-graph-max-tokens", 1024,
              "a step that prefills one prompt of at most this many new tokens replays a CUDA graph captured "
              "for its token-count bucket instead of launching every kernel from Python (0: eager prefill; "
              "CUDA only)", type=int)
    flags.add("--gpu-memory-utilization", 0.9,
              "share of the device's total memory this worker may use for weights, activations and KV "
              "(workers on one GPU: shares summing to at most 1; the KV cache fills it when --num-kv-blocks is 0)",
              type=float)
    flags.add("--enforce-eager", False, "run eagerly, without CUDA graphs", action=argparse.BooleanOptionalAction)
    flags.add("--pdl", True, "launch the decode kernels with programmatic dependent launch (Hopper and later)",
              action=argparse.BooleanOptionalAction)
    flags.add("--packed-experts", False,
              "keep a checkpoint's MXFP4 experts (gpt-oss) packed in memory, read by the expert kernels "
              "(a quarter of bf16's bytes); off: dequantised at load", action=argparse.BooleanOptionalAction)
    flags.add("--transfer-timeout", 30.0, "seconds an admitted request's KV has to arrive", type=float)
    flags.add("--max-queued-admissions", 256,
              "decode: admissions that wait in order for free KV blocks when the pool is full; one more is "
              "RESOURCE_EXHAUSTED with a retry hint", type=int)
    flags.add("--kvstore-min-prefix-tokens", 256,
              "prefill: a prompt prefix goes to or comes from the kvstore only when at least this many of its "
              "tokens are not cached here already (shorter ones cost more in round trips than their compute)",
              type=int)
    flags.add("--layer-streaming", "auto", "prefill: send a prompt's KV layer by layer while its forward runs "
              "(auto: over CUDA IPC, prompts of 4096 tokens or more; on: every prompt, any transport; off: after the step)", choices=("auto", "on", "off"))
    flags.add("--tensor-parallel-size", 1, "decode: split the model over this many ranks, one process and device "
              "each (cuda:K, cuda:K+1, ...); each rank receives its slice of the KV heads a prefill worker sends (TCP)",
              type=int)
    args = flags.parse(argv)
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    if args.tensor_parallel_size > 1 and name == "prefill":
        raise SystemExit("--tensor-parallel-size > 1 is for decode workers; prefill workers run one rank (KV "
                         "export from tensor-parallel ranks is not available yet)")
    if args.num_kv_blocks < 0:
        raise SystemExit("--num-kv-blocks must be >= 0")
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    if not 0 < args.gpu_memory_utilization <= 1 or args.transfer_timeout <= 0:
        raise SystemExit("--gpu-memory-utilization must be in (0, 1] and --transfer-timeout positive")
    if args.max_queued_admissions < 0:
        raise SystemExit("--max-queued-admissions must be >= 0")
    if args.stream_interval < 1:
        raise SystemExit("--stream-interval must be >= 1")
    if args.prefill_graph_max_tokens < 0:
        raise SystemExit("--prefill-graph-max-tokens must be >= 0 (0: eager prefill)")
    if args.long_prefill_token_threshold < 0:
        raise SystemExit("--long-prefill-token-threshold must be >= 0 (0: off)")
    if args.kvstore_min_prefix_tokens < 0:
        raise SystemExit("--kvstore-min-prefix-tokens must be >= 0")
    return WorkerConfig(
        service=_service(name, args),
        model=_model(args),
        worker_id=args.worker_id,
        device=args.device,
        kvstore_address=args.kvstore or None,
        num_kv_blocks=args.num_kv_blocks,
        kv_listen=args.kv_listen,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        stream_interval=args.stream_interval,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        pdl=args.pdl,
        packed_experts=args.packed_experts,
        transfer_timeout_s=args.transfer_timeout,
        max_queued_admissions=args.max_queued_admissions,
        kvstore_min_prefix_tokens=args.kvstore_min_prefix_tokens,
        layer_streaming=args.layer_streaming,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def kvstore_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> KVStoreConfig:
    """Parse the kvstore's flags."""
    flags = _flags("kvstore", environ)
    flags.add("--ram-bytes", 8 * 1024**3, "RAM tier capacity", type=int)
    flags.add("--disk-path", None, "directory of the disk tier (unset: RAM only)", type=Path)
    flags.add("--disk-bytes", 64 * 1024**3, "disk tier capacity: the store's, as the disk "
              "holds every block and RAM caches the recent ones", type=int)
    args = flags.parse(argv)
    if args.ram_bytes <= 0 or args.disk_bytes < 0:
        raise SystemExit("--ram-bytes must be positive and --disk-bytes >= 0")
    return KVStoreConfig(
        service=_service("kvstore", args),
        ram_bytes=args.ram_bytes,
        disk_path=args.disk_path,
        disk_bytes=args.disk_bytes,
    )
