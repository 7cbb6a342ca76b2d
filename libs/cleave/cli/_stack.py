"""The cleave stack as local processes: kvstore, prefill worker(s), decode worker(s), gateway.

Each service is `python -m services.<name>` on an ephemeral port it reports through
`--port-file`; a service counts as up once `grpc.health.v1` says SERVING. The gateway's ports
are checked free before anything starts. Workers start in parallel after the kvstore, the
gateway last (it routes only to healthy workers). `restart(child)` starts a dead child again
with the same command on the same address (`cleave.cli._supervisor` decides when). `stop()`
sends SIGTERM to every child (gateway first), waits for them to drain and kills stragglers.
Children get SIGTERM from the kernel if the stack's process dies first (`_ownership`).
Each child's output goes to `<workdir>/<name>.log`; with `StackSpec.trace_dir` each child
also writes its trace spans to `<trace_dir>/<name>.jsonl` (`bench/hops.py` reads them).
With `StackSpec.metrics` (on by default) each child serves Prometheus metrics on a port of its
own (`--metrics-port 0`, reported in `<workdir>/<name>.metrics.port`; gateway replicas too; a
restarted child gets its port back), and `<workdir>/prometheus-targets.json` lists them for a
Prometheus `file_sd_configs` entry.
Every stack makes its own random internal token (`cleave.rpc.auth`) and hands it to each
child in its environment (CLEAVE_INTERNAL_TOKEN), never on the command line, which `ps` shows.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import grpc

from cleave.cli._mps import ACTIVE_THREAD_PERCENTAGE_ENV, MpsDaemon, MpsSetting, MpsUnavailable, wants_mps
from cleave.cli._memory_split import (
    DEFAULT_GPU_MEMORY_UTILIZATION, MemorySplit, PlacedWorker, device_key, memory_shares,
)
from cleave.cli._ownership import check_ports_free
from cleave.cli.health import EXIT_SERVING, check
from cleave.cli.tls_certs import write_certificates
from cleave.config import INTERNAL_TOKEN_ENV, env_name
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc
from cleave.rpc.auth import INTERNAL_TOKEN_KEY
from cleave.tls import CA_FLAG, CERT_FLAG, KEY_FLAG, TlsConfig

DEFAULT_CPU_KV_BLOCKS = 1024


@dataclass(frozen=True)
class StackSpec:
    """What to start."""

    model: Path
    mode: Literal["disaggregated", "colocated", "conditional"] = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    grpc_port: int = 50051  # 0: any free port
    http_port: int | None = 8000  # 0: any free port; None: no HTTP API
    device: str = "cpu"
    num_kv_blocks: int = 0  # 0: DEFAULT_CPU_KV_BLOCKS on CPU, from free memory on GPUs
    served_model_name: str = ""
    host: str = "127.0.0.1"
    log_level: str = "INFO"
    worker_args: tuple[str, ...] = ()  # extra flags for prefill and decode workers
    prefill_args: tuple[str, ...] = ()  # extra flags for prefill workers only (after worker_args)
    gateway_args: tuple[str, ...] = ()  # extra flags for the gateway
    num_gateways: int = 1  # gateway replicas sharing the gRPC and HTTP ports (SO_REUSEPORT)
    store_to_kvstore: bool = True  # prefill workers put new prompt blocks into the kvstore
    trace_dir: Path | None = None  # each child writes its spans to <trace_dir>/<name>.jsonl
    # GPU workers on one device split this share of its memory by role weight (_memory_split)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    gpu_memory_split: MemorySplit = MemorySplit()
    metrics: bool = True  # each child serves Prometheus metrics on a port of its own
    # GPU workers sharing one device run under an MPS daemon of the stack's (_mps): auto, on, off
    mps: MpsSetting = "auto"
    # under MPS, the share of the SMs a prefill worker may occupy (None: all), so its long
    # compute-bound kernels leave decode steps SMs to run on (`_mps`)
    prefill_sm_percent: int | None = None
    # CUDA device indexes the prefill / decode workers are placed on, round-robin in start
    # order (`--prefill-gpus 0 --decode-gpus 1,2`); empty: every worker on `device`
    prefill_gpus: tuple[int, ...] = ()
    decode_gpus: tuple[int, ...] = ()
    # ranks each decode worker splits its model over (colocated or disaggregated mode: in the
    # latter each rank receives its KV heads' slice over TCP; prefill workers keep one rank);
    # on CUDA a worker on cuda:K uses cuda:K..K+N-1
    decode_tensor_parallel_size: int = 1
    # every service serves TLS with a certificate of the stack's own CA (`cleave tls-certs`,
    # written under the work directory), checks its peers against it, and the HTTP API is HTTPS
    tls: bool = False

    def __post_init__(self) -> None:
        if self.decode_tensor_parallel_size < 1:
            raise ValueError("decode_tensor_parallel_size must be >= 1")
        if self.decode_tensor_parallel_size > 1 and self.mode not in ("colocated", "disaggregated"):
            raise ValueError(
                f"tensor-parallel decode workers run in --mode colocated or --mode disaggregated (prefill workers "
                f"keep one rank); --mode {self.mode} is not tested with them yet"
            )
        if (self.prefill_gpus or self.decode_gpus) and not self.device.startswith("cuda"):
            raise ValueError(f"GPU placement (prefill_gpus / decode_gpus) needs a CUDA device, not {self.device!r}")
        if any(index < 0 for index in self.prefill_gpus + self.decode_gpus):
            raise ValueError("GPU indexes must be >= 0")

    def worker_device(self, role: str, index: int) -> str:
        """The device of the `index`-th worker of `role` ("prefill" or "decode")."""
        gpus = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return f"cuda:{gpus[index % len(gpus)]}" if gpus else self.device


@dataclass
class Child:
    """One started service process (and how to start it again)."""

    name: str
    process: subprocess.Popen
    port_file: Path
    log_path: Path
    log: IO[bytes]
    address: str = ""
    module: str = ""
    args: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.monotonic)

    def log_tail(self, num_lines: int = 20) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


@dataclass
class ProcessStack:
    """Starts and stops the stack described by a StackSpec.

    Args:
        spec: the stack.
        workdir: port files and logs go here.
    """

    spec: StackSpec
    workdir: Path
    children: list[Child] = field(default_factory=list)
    http_port: int | None = None
    # the secret the stack's services send each other; a caller of a worker or the kvstore
    # (tests, benchmarks) passes it to `aio_channel(..., internal_token=)`
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    mps: MpsDaemon | None = None  # the stack's MPS daemon while it runs
    tls: TlsConfig | None = None  # with `spec.tls`: the stack's CA and certificate, once started

    @property
    def gateway(self) -> Child:
        return next(child for child in self.children if child.name == "gateway")

    @property
    def gateway_address(self) -> str:
        return self.gateway.address

    @property
    def http_url(self) -> str | None:
        scheme = "https" if self.spec.tls else "http"
        return None if self.http_port is None else f"{scheme}://{self.spec.host}:{self.http_port}/v1"

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials a client of the stack's services connects with (the stack's CA, and its
        certificate for the services that ask for one); None without TLS."""
        return None if self.tls is None else self.tls.channel_credentials()

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        child = self._launch(name, module, args, open(self.workdir / f"{name}.log", "wb"))
        self.children.append(child)
        return child

    def _launch(self, name: str, module: str, args: list[str], log: IO[bytes]) -> Child:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        # --parent-pid: the child ends with this process (`cleave.parent_death`)
        command = [sys.executable, "-m", module, "--port-file", str(port_file), "--parent-pid", str(os.getpid()),
                   "--log-level", self.spec.log_level, "--no-log-json", *args]
        if self.spec.trace_dir is not None:
            command += ["--trace-file", str(self.spec.trace_dir / f"{name}.jsonl")]
        if self.spec.metrics:
            # a restarted child keeps its metrics port, so the targets file stays right
            previous = self.metrics_addresses().get(name)
            metrics_port = previous.rpartition(":")[2] if previous else "0"
            metrics_port_file = self.metrics_port_file(name)
            metrics_port_file.unlink(missing_ok=True)
            command += ["--metrics-port", metrics_port, "--metrics-port-file", str(metrics_port_file)]
        env = self.child_env(os.environ)
        if name.startswith("prefill") and self.mps is not None and self.spec.prefill_sm_percent:
            env[ACTIVE_THREAD_PERCENTAGE_ENV] = str(self.spec.prefill_sm_percent)
        # own session: a terminal's Ctrl-C reaches only `cleave up`, which stops the children in order
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Child(name, process, port_file, log_path, log, module=module, args=tuple(args))

    def metrics_port_file(self, name: str) -> Path:
        """Where the child `name` reports its metrics port."""
        return self.workdir / f"{name}.metrics.port"

    def metrics_addresses(self) -> dict[str, str]:
        """Child name -> host:port of its /metrics, for the children that reported one (read
        now: a restarted child reports a new port)."""
        addresses = {}
        for child in self.children:
            path = self.metrics_port_file(child.name)
            text = path.read_text().strip() if path.is_file() else ""
            if text:
                addresses[child.name] = f"{self.spec.host}:{int(text)}"
        return addresses

    @property
    def prometheus_targets_file(self) -> Path:
        return self.workdir / "prometheus-targets.json"

    def write_prometheus_targets(self) -> Path:
        """Write every child's metrics address as Prometheus file-based service discovery
        (`file_sd_configs: [{files: [<this file>]}]`), each target labelled with its service
        name; returns the file."""
        targets = [{"targets": [address], "labels": {"service": name}}
                   for name, address in self.metrics_addresses().items()]
        path = self.prometheus_targets_file
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(targets, indent=2) + "\n")
        tmp.replace(path)
        return path

    def restart(self, child: Child) -> Child:
        """Start an exited child again with its command, listening where it listened (its
        peers keep the address); its log continues in the same file. Returns the new Child,
        which replaces the old one in `children`; it reports its port file as it comes up."""
        assert child.process.poll() is not None, f"{child.name} is still running"
        args = list(child.args)
        if child.address and "--listen" in args:
            args[args.index("--listen") + 1] = child.address
        if "--http-port-file" in args and self.http_port is not None:  # the HTTP port it bound and reported
            at = args.index("--http-port-file")
            del args[at:at + 2]
            args[args.index("--http-listen") + 1] = f"{self.spec.host}:{self.http_port}"
        child.log.close()
        log = open(child.log_path, "ab")
        log.write(f"\n---- {child.name} restarted ----\n".encode())
        log.flush()
        restarted = self._launch(child.name, child.module, args, log)
        restarted.address = child.address
        self.children[self.children.index(child)] = restarted
        return restarted

    def is_serving(self, child: Child) -> bool:
        """Whether a child answers SERVING now (one health check)."""
        return bool(child.address) and check(child.address, timeout_s=1.0, credentials=self.channel_credentials())[0] == EXIT_SERVING

    def child_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """A child's environment: `environ` with this stack's internal token and TLS files (a
        token file or certificates named there would give the children other secrets than the
        stack's, and its health checks could not reach them)."""
        own = {f"{INTERNAL_TOKEN_ENV}_FILE", *(env_name(flag) for flag in (CERT_FLAG, KEY_FLAG, CA_FLAG))}
        env = {key: value for key, value in environ.items() if key not in own}
        mps = self.mps.env if self.mps is not None else {}
        tls = {} if self.tls is None else {env_name(CERT_FLAG): str(self.tls.cert_file),
                                           env_name(KEY_FLAG): str(self.tls.key_file),
                                           env_name(CA_FLAG): str(self.tls.ca_file)}
        return {**env, **mps, **tls, "PYTHONUNBUFFERED": "1", INTERNAL_TOKEN_ENV: self.internal_token}

    def _start_mps(self) -> None:
        """Start the stack's MPS daemon when its GPU workers share a device (`_mps`); with
        `mps="auto"` a host that cannot run one goes on without it, with a warning."""
        spec = self.spec
        if not wants_mps(spec.mps, spec.device, self.devices_shared()):
            return
        try:
            self.mps = MpsDaemon.start(self.workdir / "mps", dict(os.environ))
        except MpsUnavailable as error:
            if spec.mps == "on":
                raise
            print(f"warning: GPU workers share the device without MPS: {error}", file=sys.stderr)

    @staticmethod
    def _wait_for(children: list[Child], ready: Callable[[Child], bool], timeout_s: float, poll_s: float,
                  late: Callable[[str], str]) -> None:
        """Poll `ready` on each child until every one is; past `timeout_s`, TimeoutError with
        `late(the pending children's names)`."""
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            pending = [child for child in pending if not ready(child)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(late(", ".join(child.name for child in pending)))
            if pending:
                time.sleep(poll_s)

    def _wait_healthy(self, children: list[Child], timeout_s: float) -> None:
        self._wait_for(children, self._is_healthy, timeout_s, 0.1,
                       lambda names: f"{names} did not become healthy in {timeout_s:g} s; see logs in {self.workdir}")

    def _is_healthy(self, child: Child) -> bool:
        """Whether `child` serves; RuntimeError with its log's tail when it exited."""
        if child.process.poll() is not None:
            hint = ""
            if self.mps is not None and child.name.startswith(("prefill", "decode")):
                hint = "\n(it ran under the stack's MPS daemon: if its CUDA start failed, --mps off runs without)"
            raise RuntimeError(
                f"{child.name} exited with code {child.process.returncode}; its log "
                f"({child.log_path}) ends with:\n{child.log_tail()}{hint}"
            )
        if not child.address and child.port_file.is_file():
            text = child.port_file.read_text().strip()
            if text:
                child.address = f"{self.spec.host}:{int(text)}"
        return bool(child.address) and check(child.address, timeout_s=1.0, credentials=self.channel_credentials())[0] == EXIT_SERVING

    def _wait_attached(self, decode: list[Child], num_gateways: int, timeout_s: float) -> None:
        """Wait until every gateway streams from every decode worker: a gateway attaches to a
        worker once it is in its rotation, so the first requests spread over all of them
        (a worker whose first health check timed out would otherwise join a moment later)."""
        metadata = ((INTERNAL_TOKEN_KEY, self.internal_token),) if self.internal_token else ()
        credentials = self.channel_credentials()

        def attached(child: Child) -> bool:
            with (grpc.insecure_channel(child.address) if credentials is None
                  else grpc.secure_channel(child.address, credentials)) as channel:
                try:
                    load = decode_pb2_grpc.DecodeStub(channel).GetLoad(
                        common_pb2.GetLoadRequest(), timeout=2.0, metadata=metadata).load
                except grpc.RpcError:
                    return False
            return load.num_attached_gateways >= num_gateways

        self._wait_for(decode, attached, timeout_s, 0.05, lambda names: (
            f"the gateway did not attach to {names} in {timeout_s:g} s; see logs in {self.workdir}"))

    def placed_workers(self) -> list[PlacedWorker]:
        """The prefill and decode workers `start()` runs, in start order, with their devices
        (`spec.prefill_gpus` / `decode_gpus`, else `spec.device`; CUDA_VISIBLE_DEVICES is
        inherited by all, so the indexes count the devices it leaves visible)."""
        spec = self.spec
        num_prefill = spec.num_prefill if spec.mode != "colocated" else 0
        return ([PlacedWorker(f"prefill-{index}", "prefill", spec.worker_device("prefill", index))
                 for index in range(num_prefill)]
                + [PlacedWorker(f"decode-{index}", "decode", spec.worker_device("decode", index))
                   for index in range(spec.num_decode)])

    def devices_shared(self) -> int:
        """The most GPU workers placed on one device (MPS is for two or more)."""
        counts = Counter(device_key(placed.device) for placed in self.placed_workers())
        counts.pop(None, None)
        return max(counts.values(), default=0)

    def memory_shares(self) -> dict[str, float]:
        """Worker name -> its `--gpu-memory-utilization` (GPU workers only)."""
        spec = self.spec
        return memory_shares(self.placed_workers(), spec.gpu_memory_utilization, spec.gpu_memory_split)

    def _worker_args(self, worker_id: str, kvstore: str) -> list[str]:
        spec = self.spec
        device = next(placed.device for placed in self.placed_workers() if placed.name == worker_id)
        blocks = spec.num_kv_blocks or (DEFAULT_CPU_KV_BLOCKS if spec.device == "cpu" else 0)
        args = ["--listen", f"{spec.host}:0", "--model", str(spec.model), "--worker-id", worker_id,
                "--device", device, "--kvstore", kvstore, "--num-kv-blocks", str(blocks),
                "--kv-listen", f"{spec.host}:0", "--grace-seconds", "5"]
        if spec.served_model_name:
            args += ["--served-model-name", spec.served_model_name]
        if spec.device == "cpu":
            args.append("--enforce-eager")
        share = self.memory_shares().get(worker_id)
        if share is not None:  # passed with --num-kv-blocks too; the worker then allocates the blocks asked for
            args += ["--gpu-memory-utilization", f"{share:g}"]
        if worker_id.startswith("prefill"):
            role_args: tuple[str, ...] = spec.prefill_args
        elif spec.decode_tensor_parallel_size > 1:
            role_args = ("--tensor-parallel-size", str(spec.decode_tensor_parallel_size))
        else:
            role_args = ()
        return args + list(spec.worker_args) + list(role_args)

    @property
    def http_port_file(self) -> Path:
        """Where the first gateway reports the HTTP port it bound (`--http-port 0`)."""
        return self.workdir / "gateway.http.port"

    def _http_args(self) -> list[str]:
        """The gateway's HTTP flags: none; the port asked for or bound before (replicas and
        restarts keep it); or any free port, bound by the gateway itself and reported in
        `http_port_file` (a port picked here and passed on could be taken in between)."""
        spec = self.spec
        if spec.http_port is None:
            return ["--http-listen", ""]
        if self.http_port is not None:
            return ["--http-listen", f"{spec.host}:{self.http_port}"]
        self.http_port_file.unlink(missing_ok=True)
        return ["--http-listen", f"{spec.host}:0", "--http-port-file", str(self.http_port_file)]

    def _reported_http_port(self) -> int:
        text = self.http_port_file.read_text().strip() if self.http_port_file.is_file() else ""
        if not text:
            raise RuntimeError(f"the gateway serves but did not report its HTTP port in {self.http_port_file}")
        return int(text)

    def _gateway_args(self, workers: list[Child], index: int = 0, port: int | str | None = None) -> list[str]:
        spec = self.spec
        port = spec.grpc_port if port is None else port
        args = ["--listen", f"{spec.host}:{port}", "--model", str(spec.model), "--mode", spec.mode,
                *self._http_args(),
                "--grace-seconds", "5", "--store-to-kvstore" if spec.store_to_kvstore else "--no-store-to-kvstore"]
        if spec.served_model_name:
            args += ["--served-model-name", spec.served_model_name]
        for worker in workers:
            args += ["--prefill" if worker.name.startswith("prefill") else "--decode", worker.address]
        if spec.num_gateways > 1:
            args += ["--share-port", "--gateway-id", f"gateway-{index}"]
        return args + list(spec.gateway_args)

    def start(self, timeout_s: float = 120.0) -> None:
        """Start everything and return once the gateway is SERVING and streams from every
        decode worker (stops all on failure)."""
        spec = self.spec
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports = [(spec.grpc_port, "gateway gRPC, --grpc-port")]
        if spec.http_port is not None:
            ports.append((spec.http_port, "gateway HTTP, --http-port"))
        check_ports_free(spec.host, ports)
        if spec.tls:
            self.tls = write_certificates(self.workdir / "tls", hosts=[spec.host])
        try:
            self._start_mps()
            kvstore = self._spawn("kvstore", "services.kvstore", [
                "--listen", f"{spec.host}:0", "--ram-bytes", str(1024**3), "--grace-seconds", "2"])
            self._wait_healthy([kvstore], timeout_s)
            workers = [self._spawn(placed.name, f"services.{placed.role}",
                                   self._worker_args(placed.name, kvstore.address))
                       for placed in self.placed_workers()]
            self._wait_healthy(workers, timeout_s)
            self.http_port = spec.http_port or None  # 0: the gateway binds one and reports it
            gateway = self._spawn("gateway", "services.gateway", self._gateway_args(workers))
            self._wait_healthy([gateway], timeout_s)  # SERVING once its HTTP API listens too
            if spec.http_port == 0:
                self.http_port = self._reported_http_port()
            # Replicas bind the first one's port; each attaches to the decode workers under
            # its own gateway id, and the kernel spreads client connections over them.
            replicas = [self._spawn(f"gateway-{index}", "services.gateway",
                                    self._gateway_args(workers, index, gateway.address.rpartition(":")[2]))
                        for index in range(1, spec.num_gateways)]
            self._wait_healthy(replicas, timeout_s)
            decode = [worker for worker in workers if worker.name.startswith("decode")]
            self._wait_attached(decode, spec.num_gateways, timeout_s)
            if spec.metrics:
                self.write_prometheus_targets()
        except BaseException:
            self.stop()
            raise

    def exited(self) -> list[Child]:
        """Children that are no longer running."""
        return [child for child in self.children if child.process.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (gateway first, kvstore last), wait, SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            child.log.close()
        if self.mps is not None:  # after its clients: a daemon told to quit waits for them
            self.mps.stop()
            self.mps = None
