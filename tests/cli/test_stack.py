"""ProcessStack's child command lines: each GPU worker carries its share of the device's
memory (no process is started: Popen and the health wait are replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.cli import _stack
from cleave.cli._memory_split import MemorySplit
from cleave.cli._stack import ProcessStack, StackSpec
from cleave.cli.main import build_parser


class FakeProcess:
    """Records the command and environment; exits at once when signalled."""

    def __init__(self, command: list[str], **kwargs: object) -> None:
        self.command = command
        self.env = kwargs.get("env")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        self.returncode = -9


@pytest.fixture
def started(monkeypatch, tmp_path):
    """start() a spec without processes; returns {child name: its command line}."""
    monkeypatch.setattr(_stack.subprocess, "Popen", FakeProcess)

    def healthy(self, children, timeout_s):
        for child in children:
            child.address = f"127.0.0.1:{50000 + len(self.children)}"

    monkeypatch.setattr(ProcessStack, "_wait_healthy", healthy)
    monkeypatch.setattr(ProcessStack, "_wait_attached", lambda self, decode, num_gateways, timeout_s: None)

    def start(spec: StackSpec) -> dict[str, list[str]]:
        stack = ProcessStack(spec, tmp_path / "stack")
        stack.start()
        commands = {child.name: child.process.command for child in stack.children}
        stack.stop()
        return commands

    return start


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _flag_values(command: list[str], flag: str) -> list[str]:
    """Every value `flag` is given, in order (a bare number could also be, say, a pid)."""
    return [value for name, value in zip(command, command[1:]) if name == flag]


def test_one_prefill_one_decode_on_one_gpu_split_its_memory(started):
    commands = started(StackSpec(model=Path("/m"), device="cuda"))
    assert list(commands) == ["kvstore", "prefill-0", "decode-0", "gateway"]
    assert commands["prefill-0"][2] == "services.prefill" and commands["decode-0"][2] == "services.decode"
    assert _flag(commands["prefill-0"], "--gpu-memory-utilization") == "0.3"
    assert _flag(commands["decode-0"], "--gpu-memory-utilization") == "0.6"
    assert _flag(commands["decode-0"], "--num-kv-blocks") == "0"  # sized from the share
    assert "--gpu-memory-utilization" not in commands["gateway"] + commands["kvstore"]


def test_two_prefill_two_decode_and_explicit_blocks(started):
    commands = started(StackSpec(model=Path("/m"), device="cuda:1", num_prefill=2, num_decode=2, num_kv_blocks=500))
    shares = {name: _flag(command, "--gpu-memory-utilization") for name, command in commands.items()
              if name.startswith(("prefill", "decode"))}
    assert shares == {"prefill-0": "0.15", "prefill-1": "0.15", "decode-0": "0.3", "decode-1": "0.3"}
    assert {_flag(commands[name], "--num-kv-blocks") for name in shares} == {"500"}  # blocks are what was asked


def test_colocated_decode_gets_the_whole_utilization_and_split_is_overridable(started):
    commands = started(StackSpec(model=Path("/m"), mode="colocated", device="cuda"))
    assert [name for name in commands if name.startswith(("prefill", "decode"))] == ["decode-0"]
    assert _flag(commands["decode-0"], "--gpu-memory-utilization") == "0.9"
    commands = started(StackSpec(model=Path("/m"), device="cuda", gpu_memory_utilization=0.8,
                                 gpu_memory_split=MemorySplit(1, 1)))
    assert _flag(commands["prefill-0"], "--gpu-memory-utilization") == "0.4"
    assert _flag(commands["decode-0"], "--gpu-memory-utilization") == "0.4"


def test_cpu_workers_carry_no_share(started):
    commands = started(StackSpec(model=Path("/m")))
    assert "--gpu-memory-utilization" not in commands["prefill-0"] + commands["decode-0"]
    assert _flag(commands["decode-0"], "--num-kv-blocks") == str(_stack.DEFAULT_CPU_KV_BLOCKS)


def test_cleave_up_flags(capsys):
    args = build_parser().parse_args(["up", "--device", "cuda", "--gpu-memory-split", "1:1",
                                      "--gpu-memory-utilization", "0.8"])
    assert (args.gpu_memory_split, args.gpu_memory_utilization) == (MemorySplit(1, 1), 0.8)
    defaults = build_parser().parse_args(["up"])
    assert (defaults.gpu_memory_split, defaults.gpu_memory_utilization) == (MemorySplit(1, 2), 0.9)
    for bad in (["--gpu-memory-split", "2"], ["--gpu-memory-utilization", "1.2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *bad])
    assert "PREFILL:DECODE" in capsys.readouterr().err


def test_gateway_replicas_share_the_first_ones_port_under_their_own_ids(started):
    commands = started(StackSpec(model=Path("/m"), num_gateways=3, grpc_port=0, http_port=8123))
    gateways = [name for name in commands if name.startswith("gateway")]
    assert gateways == ["gateway", "gateway-1", "gateway-2"]
    first_port = _flag(commands["gateway"], "--listen").rpartition(":")[2]
    assert first_port == "0"
    for index, name in enumerate(gateways):
        assert "--share-port" in commands[name]
        assert _flag(commands[name], "--gateway-id") == f"gateway-{index}"
        assert _flag(commands[name], "--http-listen") == "127.0.0.1:8123"
    # replicas bind the port the first gateway reported
    assert {_flag(commands[name], "--listen") for name in gateways[1:]} == {"127.0.0.1:50004"}  # the fake health wait numbers ports by child count


def test_one_gateway_does_not_share_its_port(started):
    commands = started(StackSpec(model=Path("/m")))
    assert "--share-port" not in commands["gateway"] and "--gateway-id" not in commands["gateway"]


def test_every_child_gets_the_stacks_token_in_its_environment_never_on_its_command_line(monkeypatch, tmp_path):
    monkeypatch.setattr(_stack.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(ProcessStack, "_wait_healthy", lambda self, children, timeout_s: None)
    monkeypatch.setattr(ProcessStack, "_wait_attached", lambda self, decode, num_gateways, timeout_s: None)
    monkeypatch.setenv("CLEAVE_INTERNAL_TOKEN_FILE", "/elsewhere/token")  # would give the children another secret
    stacks = [ProcessStack(StackSpec(model=Path("/m"), num_gateways=2), tmp_path / f"stack-{i}") for i in range(2)]
    for stack in stacks:
        stack.start()
        stack.stop()
    first, second = stacks
    assert first.internal_token != second.internal_token and len(first.internal_token) >= 32  # one per stack
    assert first.internal_token not in repr(first)
    names = [child.name for child in first.children]
    assert names == ["kvstore", "prefill-0", "decode-0", "gateway", "gateway-1"]
    for child in first.children:
        env = child.process.env
        assert env["CLEAVE_INTERNAL_TOKEN"] == first.internal_token, child.name
        assert "CLEAVE_INTERNAL_TOKEN_FILE" not in env and env["PYTHONUNBUFFERED"] == "1"
        assert not any(first.internal_token in arg for arg in child.process.command), child.name
        assert "--internal-token-file" not in child.process.command


def test_a_childs_environment_parses_to_the_stacks_token(tmp_path):
    from cleave.config import gateway_config, kvstore_config, worker_config

    stack = ProcessStack(StackSpec(model=Path("/m")), tmp_path)
    env = stack.child_env({"HOME": "/root"})
    assert env["HOME"] == "/root"
    for config in (gateway_config([], env), worker_config("decode", [], env), kvstore_config([], env)):
        assert config.service.internal_token == stack.internal_token


def test_prefill_args_reach_prefill_workers_only_and_come_last(started, tmp_path):
    commands = started(StackSpec(model=tmp_path, mode="disaggregated", grpc_port=0, http_port=None,
                                 worker_args=("--max-num-batched-tokens", "2048"),
                                 prefill_args=("--max-num-batched-tokens", "8192")))
    prefill, decode = commands["prefill-0"], commands["decode-0"]
    assert _flag_values(prefill, "--max-num-batched-tokens") == ["2048", "8192"]  # the last wins
    assert _flag_values(decode, "--max-num-batched-tokens") == ["2048"]


def test_pools_are_placed_on_their_gpus_and_each_worker_alone_gets_the_whole_share(started, tmp_path):
    spec = StackSpec(model=Path("/m"), device="cuda", num_decode=2, prefill_gpus=(0,), decode_gpus=(1, 2))
    commands = started(spec)
    devices = {name: _flag(command, "--device") for name, command in commands.items() if _flag(command, "--device")}
    assert devices == {"prefill-0": "cuda:0", "decode-0": "cuda:1", "decode-1": "cuda:2"}
    assert {_flag(commands[name], "--gpu-memory-utilization") for name in devices} == {"0.9"}
    assert ProcessStack(spec, tmp_path).devices_shared() == 1  # no device to share: no MPS


def test_more_workers_than_gpus_go_round_robin_and_share(started, tmp_path):
    spec = StackSpec(model=Path("/m"), device="cuda", num_prefill=2, num_decode=3, prefill_gpus=(0,),
                     decode_gpus=(1, 2))
    commands = started(spec)
    assert [_flag(commands[f"decode-{index}"], "--device") for index in range(3)] == ["cuda:1", "cuda:2", "cuda:1"]
    assert _flag(commands["decode-0"], "--gpu-memory-utilization") == "0.45"  # two decode workers on cuda:1
    assert _flag(commands["decode-1"], "--gpu-memory-utilization") == "0.9"
    assert _flag(commands["prefill-1"], "--gpu-memory-utilization") == "0.45"
    assert ProcessStack(spec, tmp_path).devices_shared() == 2


def test_gpu_placement_needs_cuda_and_indexes(capsys):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StackSpec(model=Path("/m"), device="cpu", decode_gpus=(1,))
    with pytest.raises(ValueError, match=">= 0"):
        StackSpec(model=Path("/m"), device="cuda", prefill_gpus=(-1,))
    args = build_parser().parse_args(["up", "--device", "cuda", "--prefill-gpus", "0", "--decode-gpus", "1,2"])
    assert (args.prefill_gpus, args.decode_gpus) == ((0,), (1, 2))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--decode-gpus", "one"])
    assert "CUDA device indexes" in capsys.readouterr().err
    from cleave.cli.up import run

    assert run(build_parser().parse_args(["up", "--decode-gpus", "1"])) == 2  # --device auto is cpu on this host
    assert "pass --device cuda" in capsys.readouterr().err
