"""`cleave bench serve` against a real CPU stack (colocated, shipped reasoner): the counts it
reports are the server's, its files are written, and a bad endpoint is one line and exit 2.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import cleave
from cleave.cli._stack import ProcessStack, StackSpec

SHIPPED_MODEL = Path(cleave.__file__).parent / "assets" / "reasoner"
NUM_PROMPTS = 6
OUTPUT_LEN = 8
EXIT_BAD_ENDPOINT = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (SHIPPED_MODEL / "config.json").is_file():
        pytest.skip("the shipped reasoner (cleave/assets/reasoner) is not in this checkout")
    spec = StackSpec(model=SHIPPED_MODEL, mode="colocated", grpc_port=0, http_port=0, num_kv_blocks=128,
                     log_level="WARNING")
    process_stack = ProcessStack(spec, tmp_path_factory.mktemp("bench-stack"))
    process_stack.start(timeout_s=120)  # stops what it started when it fails
    yield process_stack
    process_stack.stop()


def base_url(stack: ProcessStack) -> str:
    return f"http://127.0.0.1:{stack.http_port}"


def bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cleave.cli.main", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def metric_total(url: str, name: str, required: bool = True) -> float:
    """The sum over label sets of one metric in the gateway's Prometheus text (a labelled
    counter has no line before its first request: 0 unless `required`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [float(match) for match in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values or not required, f"{name} is not in the gateway's /metrics"
    return sum(values)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_reports_what_the_server_served(stack, tmp_path, endpoint):
    url = base_url(stack)
    successes_before = metric_total(url, "cleave:request_success_total", required=False)
    first_tokens_before = metric_total(url, "cleave:time_to_first_token_seconds_count", required=False)
    completed = bench("--base-url", url, "--endpoint", endpoint, "--num-prompts", str(NUM_PROMPTS),
                      "--random-input-len", "24", "--random-output-len", str(OUTPUT_LEN), "--request-rate", "50",
                      "--max-concurrency", "3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                      "--result-dir", str(tmp_path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (result_file,) = tmp_path.glob("bench-serve-*.json")
    assert result_file.with_suffix(".png").stat().st_size > 10_000
    result = json.loads(result_file.read_text())
    summary, records = result["summary"], result["records"]

    assert result["command"].startswith("cleave bench serve --base-url")
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        served = json.loads(response.read())["data"][0]["id"]  # the benchmark asks the server, as here
    assert result["endpoint"]["url"] == url + endpoint and result["endpoint"]["model"] == served
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", result["date"])
    assert (summary["completed"], summary["failed"], summary["goodput_requests"]) == (NUM_PROMPTS, 0, NUM_PROMPTS)
    assert len(records) == NUM_PROMPTS and all(r["success"] and r["usage_reported"] for r in records)
    # ignore_eos + min_tokens pin every output and the server's usage says how many it made;
    # a chunk holds one token or more (the gateway may merge a step's tokens)
    assert [r["output_tokens"] for r in records] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(0 <= len(r["itl_s"]) <= r["output_tokens"] - 1 for r in records)
    assert sum(len(r["itl_s"]) + 1 for r in records) > NUM_PROMPTS
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert summary["total_input_tokens"] == sum(r["prompt_len"] for r in records) > 0
    assert f"Successful requests:{NUM_PROMPTS:>{52 - len('Successful requests:')}}" in completed.stdout
    assert f"{NUM_PROMPTS * OUTPUT_LEN}" in completed.stdout
    # the gateway counted the same requests: the run's and the endpoint check's
    served = NUM_PROMPTS + result["probe_requests"]
    assert metric_total(url, "cleave:request_success_total") - successes_before == served
    assert metric_total(url, "cleave:time_to_first_token_seconds_count") - first_tokens_before == served


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["refused", "wrong path", "gRPC port"])
def test_a_bad_endpoint_is_one_line_and_exit_2(stack, tmp_path, case):
    args = {
        "refused": ["--base-url", f"http://127.0.0.1:{closed_port()}"],
        "wrong path": ["--base-url", base_url(stack), "--endpoint", "/v1/complete"],
        "gRPC port": ["--base-url", f"http://{stack.gateway_address}"],
    }[case]
    completed = bench(*args, "--num-prompts", "2", "--result-dir", str(tmp_path / "results"), timeout_s=60)
    assert completed.returncode == EXIT_BAD_ENDPOINT, completed.stdout + completed.stderr
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in completed.stderr
    expected = {"refused": "cannot reach", "wrong path": "HTTP 404", "gRPC port": "not HTTP/1.1"}[case]
    assert expected in errors[0]
    assert not (tmp_path / "results").exists()
