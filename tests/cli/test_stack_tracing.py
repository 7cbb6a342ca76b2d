"""ProcessStack with `trace_dir`: every child gets its own `--trace-file` (no process is
started), and `cleave up --trace-dir` sets it."""

from __future__ import annotations

from cleave.cli._stack import StackSpec
from cleave.cli.main import build_parser
from tests.cli.test_stack import _flag, started  # noqa: F401 - `started` is a fixture


def test_each_child_writes_its_own_trace_file(started, tmp_path):
    commands = started(StackSpec(model=tmp_path / "model", grpc_port=0, http_port=None, trace_dir=tmp_path / "traces"))
    assert set(commands) == {"kvstore", "prefill-0", "decode-0", "gateway"}
    for name, command in commands.items():
        assert _flag(command, "--trace-file") == str(tmp_path / "traces" / f"{name}.jsonl")


def test_no_trace_dir_no_trace_flags(started, tmp_path):
    commands = started(StackSpec(model=tmp_path / "model", grpc_port=0, http_port=None))
    assert all("--trace-file" not in command for command in commands.values())


def test_cleave_up_takes_a_trace_dir(tmp_path):
    assert build_parser().parse_args(["up", "--trace-dir", str(tmp_path)]).trace_dir == str(tmp_path)
    assert build_parser().parse_args(["up"]).trace_dir is None
