"""bench/ncu_step.py's reading of Nsight Compute's raw CSV and the command it profiles with
(ncu itself needs a GPU whose runtime lets it read counters)."""

from __future__ import annotations

import argparse

import pytest

from bench.ncu_step import METRICS, SECTIONS, by_kernel, main, ncu_command, parse_raw_csv

HEADER = ['"ID"', '"Process ID"', '"Kernel Name"', '"gpu__time_duration.sum"',
          '"dram__throughput.avg.pct_of_peak_sustained_elapsed"', '"sm__warps_active.avg.pct_of_peak_sustained_active"',
          '"launch__registers_per_thread"']
UNITS = ['""', '""', '""', '"nsecond"', '"%"', '"%"', '"register/thread"']
RAW = "\n".join([
    "==PROF== Connected to process 4242",
    ",".join(HEADER),
    ",".join(UNITS),
    '"0","4242","_gemv_kernel","2,500","80.5","40.0","96"',
    '"1","4242","_paged_decode_split_kernel","9,000","60.0","n/a","128"',
    '"2","4242","_gemv_kernel","7,500","90.5","20.0","96"',
    "==PROF== Disconnected from process 4242",
])


def test_raw_rows_carry_microseconds_and_none_for_what_ncu_did_not_give():
    rows = parse_raw_csv(RAW)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert rows[0]["kernel"] == "_gemv_kernel" and rows[0]["us"] == pytest.approx(2.5)
    assert rows[1]["us"] == pytest.approx(9.0) and rows[1]["occupancy_pct"] is None
    assert rows[0]["dram_pct"] == pytest.approx(80.5) and rows[0]["registers"] == 96
    assert rows[0]["sm_pct"] is None and rows[0]["long_scoreboard"] is None  # not in this output
    assert set(rows[0]) == {"index", "kernel", *METRICS}


def test_kernels_are_summed_by_name_with_duration_weighted_averages():
    summary = by_kernel("b64/ctx1024", parse_raw_csv(RAW))
    assert [(row["kernel"], row["calls"], row["us"]) for row in summary] == [
        ("_gemv_kernel", 2, 10.0), ("_paged_decode_split_kernel", 1, 9.0)]
    assert summary[0]["dram_pct"] == pytest.approx((2.5 * 80.5 + 7.5 * 90.5) / 10, abs=0.05)
    assert summary[1]["occupancy_pct"] is None


def test_a_kernel_averages_only_the_calls_ncu_gave_a_value_for():
    rows = parse_raw_csv(RAW.replace('"7,500","90.5","20.0"', '"7,500","90.5","n/a"'))
    (gemv,) = [row for row in by_kernel("b1/ctx1024", rows) if row["kernel"] == "_gemv_kernel"]
    assert gemv["occupancy_pct"] == pytest.approx(40.0)  # not diluted by the call without one


@pytest.mark.parametrize(("unit", "us"), [("ns", 2.5), ("usecond", 2500.0), ("us", 2500.0), ("ms", 2.5e6)])
def test_durations_are_read_in_the_unit_ncu_printed(unit, us):
    """Recent ncu prints "ns"/"us"/"ms", older ones spell the units out."""
    (first, *_) = parse_raw_csv(RAW.replace('"nsecond"', f'"{unit}"'))
    assert first["us"] == pytest.approx(us)


def test_a_duration_in_an_unknown_unit_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="duration in 'cycle'"):
        parse_raw_csv(RAW.replace('"nsecond"', '"cycle"'))


def test_output_without_a_csv_header_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        parse_raw_csv("==PROF== No kernels were profiled.")


def test_the_step_runs_under_ncu_node_by_node_with_the_clocks_left_alone():
    args = argparse.Namespace(model="qwen3-30b-a3b", block_size=16, max_model_len=2048, kernels=None)
    command = ncu_command("/opt/ncu", args, "1x1024")
    assert command[0] == "/opt/ncu"
    assert command[command.index("--clock-control") + 1] == "none"
    assert command[command.index("--graph-profiling") + 1] == "node"
    assert command[command.index("--profile-from-start") + 1] == "off"
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--section"] == list(SECTIONS)
    tail = command[command.index("--run"):]
    assert tail[tail.index("--cases") + 1] == "1x1024" and tail[tail.index("--model") + 1] == "qwen3-30b-a3b"


def test_a_missing_ncu_is_named():
    with pytest.raises(SystemExit, match="no-such-ncu"):
        main(["--ncu", "no-such-ncu"])


def test_kernels_narrows_what_ncu_profiles():
    args = argparse.Namespace(model="qwen3-30b-a3b", block_size=16, max_model_len=2048, kernels="_gate_up|_down_sum")
    command = ncu_command("/opt/ncu", args, "1x1024")
    assert command[command.index("--kernel-name") + 1] == "regex:_gate_up|_down_sum"
    args.kernels = None
    assert "--kernel-name" not in ncu_command("/opt/ncu", args, "1x1024")


def test_an_ncu_run_past_its_timeout_says_what_to_do(monkeypatch, tmp_path):
    import subprocess

    import bench.ncu_step as ncu_step

    def slow(command, **kwargs):  # noqa: ANN001, ANN003, ANN202
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(ncu_step.subprocess, "run", slow)
    monkeypatch.setattr(ncu_step.shutil, "which", lambda name: "/opt/ncu")
    with pytest.raises(SystemExit, match="did not finish 1x1024 in 5 s: profile fewer kernels"):
        main(["--cases", "1x1024", "--timeout", "5", "--ncu", "ncu"])
