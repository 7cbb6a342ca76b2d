"""Metrics of a real CPU stack (`cleave up`'s processes, disaggregated, tiny model) move
exactly with the work: N requests make N TTFT samples and N finish reasons, KV usage goes
back to 0 when idle, a repeated prompt counts prefix-cache hits, transfer bytes are blocks
times block bytes; and a real Prometheus scrapes every process from `cleave up`'s targets
file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.metrics.scrape import Samples, has, scrape, value
from tests.metrics.test_dashboard import dashboard_exprs

NUM_REQUESTS = 6
MAX_TOKENS = 8
BLOCK_SIZE = 16  # the workers' default
REASONING = {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("metrics") / "model")
    (directory / "cleave_config.json").write_text(json.dumps({"reasoning": REASONING}))
    return directory


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    spec = StackSpec(model=tiny_model, mode="disaggregated", grpc_port=0, http_port=0, num_kv_blocks=256,
                     served_model_name="tiny", log_level="WARNING")
    running = ProcessStack(spec, tmp_path_factory.mktemp("stack"))
    running.start(timeout_s=90)  # stops what it started when it fails
    try:
        yield running
    finally:
        running.stop()


def metrics_of(stack: ProcessStack, name: str) -> Samples:
    return scrape(f"http://{stack.metrics_addresses()[name]}/metrics")


def block_bytes(model: Path) -> int:
    """[num_layers, 2, block_size, num_kv_heads, head_dim] float32."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4


async def complete_all(stack: ProcessStack, prompts: list[str]) -> list:
    async with GatewayClient(stack.gateway_address) as client:
        return await asyncio.gather(*(client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
                                      for prompt in prompts))


def test_every_process_reports_its_metrics_port(stack):
    addresses = stack.metrics_addresses()
    assert set(addresses) == {"kvstore", "prefill-0", "decode-0", "gateway"}
    targets = json.loads(stack.prometheus_targets_file.read_text())
    assert {t["labels"]["service"]: t["targets"][0] for t in targets} == addresses
    for name, address in addresses.items():
        assert address.startswith("127.0.0.1:")  # internal services stay on loopback
        assert has(metrics_of(stack, name), "cleave:grpc_server_handled_total"), name
    assert value(metrics_of(stack, "decode-0"), "cleave:kv_cache_num_blocks", worker_id="decode-0",
                 model_name="tiny") == 255  # 256 minus the null block


async def test_n_requests_make_n_first_tokens_and_n_finish_reasons(stack, tiny_model):
    before = metrics_of(stack, "gateway")
    prefill_before = metrics_of(stack, "prefill-0")
    prompts = [f"metrics request {index}: " + "count the tokens " * 4 for index in range(NUM_REQUESTS)]
    results = await complete_all(stack, prompts)
    after = metrics_of(stack, "gateway")
    prefill_after = metrics_of(stack, "prefill-0")

    def delta(name: str, old: Samples = before, new: Samples = after, **labels: str) -> float:
        return value(new, name, **labels) - value(old, name, **labels)

    assert delta("cleave:time_to_first_token_seconds_count", model_name="tiny", worker_id="gateway-0") == NUM_REQUESTS
    assert delta("cleave:request_success_total") == NUM_REQUESTS
    reasons = {result.samples[0].finish_reason for result in results}
    assert sum(delta("cleave:request_success_total", finished_reason=reason) for reason in reasons) == NUM_REQUESTS
    assert delta("cleave:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert delta("cleave:request_queue_time_seconds_count") == NUM_REQUESTS
    assert delta("cleave:routing_decisions_total", prefill="remote") == NUM_REQUESTS
    assert delta("cleave:request_failure_total") == 0
    assert delta("cleave:request_generation_tokens_sum") == sum(r.usage.completion_tokens for r in results)
    assert delta("cleave:request_prompt_tokens_sum") == sum(r.usage.prompt_tokens for r in results)
    assert delta("cleave:grpc_server_handled_total", grpc_method="Generate", grpc_code="OK") == NUM_REQUESTS
    assert value(after, "cleave:num_requests_running") == value(after, "cleave:num_requests_waiting") == 0
    # the prefill worker shipped each prompt's KV once: bytes are blocks times one block's bytes
    transfers = delta("cleave:kv_transfers_total", prefill_before, prefill_after, transport="tcp")
    blocks = delta("cleave:kv_transfer_blocks_total", prefill_before, prefill_after, transport="tcp")
    sent = delta("cleave:kv_transfer_bytes_total", prefill_before, prefill_after, transport="tcp")
    assert transfers == NUM_REQUESTS and blocks >= NUM_REQUESTS
    assert sent == blocks * block_bytes(tiny_model)
    assert delta("cleave:kv_transfer_seconds_total", prefill_before, prefill_after) > 0
    # every step's tokens are the tokens the scheduler computed
    for worker in ("prefill-0", "decode-0"):
        samples = metrics_of(stack, worker)
        computed = value(samples, "cleave:prompt_tokens_total") + value(samples, "cleave:generation_tokens_total")
        assert value(samples, "cleave:iteration_tokens_total_sum") == computed > 0, worker
        assert value(samples, "cleave:engine_steps_total", runner="eager") == value(
            samples, "cleave:engine_step_seconds_count") > 0
        assert value(samples, "cleave:engine_steps_total", runner="cuda_graph") == 0  # CPU: no graphs


async def test_kv_usage_rises_while_a_request_runs_and_returns_to_zero(stack):
    async with GatewayClient(stack.gateway_address) as client:
        call = client.generate("a long answer, please " * 3, max_tokens=400, ignore_eos=True, temperature=0.0)
        stream = aiter(call)
        await anext(stream)  # the first token, from the prefill worker
        await anext(stream)  # the decode worker's: it runs there now
        running = metrics_of(stack, "decode-0")
        routed = metrics_of(stack, "gateway")
        call.cancel()
    assert value(running, "cleave:kv_cache_usage_perc") > 0
    assert value(routed, "cleave:num_decode_worker_requests", decode_worker="decode-0") == 1
    assert value(running, "cleave:num_sequences_running") == 1
    deadline = time.monotonic() + 10
    while True:
        idle = metrics_of(stack, "decode-0")
        if value(idle, "cleave:kv_cache_usage_perc") == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert value(idle, "cleave:kv_cache_usage_perc") == 0
    assert value(idle, "cleave:num_sequences_running") == value(idle, "cleave:num_sequences_waiting") == 0
    assert value(metrics_of(stack, "prefill-0"), "cleave:kv_cache_usage_perc") == 0


async def test_a_repeated_prompt_counts_prefix_cache_hits(stack):
    prompt = "the same prompt twice, long enough to fill a few KV blocks " * 3
    before = metrics_of(stack, "prefill-0")
    (first,) = await complete_all(stack, [prompt])
    (second,) = await complete_all(stack, [prompt])
    after = metrics_of(stack, "prefill-0")
    hits = value(after, "cleave:prefix_cache_hits_total") - value(before, "cleave:prefix_cache_hits_total")
    queries = value(after, "cleave:prefix_cache_queries_total") - value(before, "cleave:prefix_cache_queries_total")
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 2 * BLOCK_SIZE
    assert queries == 2 * first.usage.prompt_tokens
    assert hits == second.usage.cached_prompt_tokens == (first.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


async def test_the_gateway_serves_metrics_on_its_http_port(stack):
    await complete_all(stack, ["over http's port"])
    base = stack.http_url.removesuffix("/v1")
    samples = scrape(f"{base}/metrics")
    own = metrics_of(stack, "gateway")
    assert value(samples, "cleave:request_success_total") == value(own, "cleave:request_success_total") > 0
    assert has(samples, "cleave:time_to_first_token_seconds_bucket")


def _query(prometheus_url: str, promql: str) -> list[dict]:
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released): Prometheus has
    no way to report a port it bound itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def prometheus(stack, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CLEAVE_REQUIRE_PROMETHEUS"):  # CI installs it: missing there is a failure
            pytest.fail("CLEAVE_REQUIRE_PROMETHEUS is set but the prometheus binary is not on PATH")
        pytest.skip("the prometheus binary is not installed (.ci/run installs Debian's prometheus package)")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "cleave", "scrape_interval": "1s", "file_sd_configs": [
            {"files": [str(stack.prometheus_targets_file)], "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.timeout(120)
async def test_prometheus_scrapes_every_process_of_cleave_up(stack, prometheus):
    await complete_all(stack, ["scraped by prometheus"])
    expected = value(metrics_of(stack, "gateway"), "cleave:request_success_total")
    services = set(stack.metrics_addresses())
    deadline = time.monotonic() + 60
    success, up = [], []
    while time.monotonic() < deadline:
        try:
            success = _query(prometheus, 'sum(cleave:request_success_total{model_name="tiny"})')
            up = _query(prometheus, 'up{job="cleave"} == 1')
        except OSError:  # not listening yet
            success, up = [], []
        if success and float(success[0]["value"][1]) == expected and {s["metric"]["service"] for s in up} == services:
            break
        await asyncio.sleep(0.5)
    assert success and float(success[0]["value"][1]) == expected > 0, success
    assert {series["metric"]["service"] for series in up} == services
    ttft = _query(prometheus, "histogram_quantile(0.5, sum by (le) (cleave:time_to_first_token_seconds_bucket))")
    assert ttft and float(ttft[0]["value"][1]) > 0
    for expr in dashboard_exprs():  # every panel's query is valid PromQL
        if not expr.startswith("label_values("):  # a Grafana function, not PromQL
            try:
                _query(prometheus, expr.replace("$model", ".*").replace("$__rate_interval", "1m"))
            except urllib.error.HTTPError as error:
                pytest.fail(f"{expr}: {error.read().decode()}")


def test_a_restarted_process_serves_metrics_on_its_port_again(stack):
    # last in the module: the kvstore loses its blocks (prefill workers treat it as optional)
    kvstore = next(child for child in stack.children if child.name == "kvstore")
    address = stack.metrics_addresses()["kvstore"]
    kvstore.process.kill()
    kvstore.process.wait()
    restarted = stack.restart(kvstore)
    deadline = time.monotonic() + 60
    while not (stack.metrics_addresses().get("kvstore") and stack.is_serving(restarted)):
        assert restarted.process.poll() is None, restarted.log_tail()
        assert time.monotonic() < deadline, "the restarted kvstore did not come back"
        time.sleep(0.1)
    assert stack.metrics_addresses()["kvstore"] == address
    samples = scrape(f"http://{address}/metrics")
    assert value(samples, "cleave:kvstore_hits_total") == 0  # a new process: counters start again
