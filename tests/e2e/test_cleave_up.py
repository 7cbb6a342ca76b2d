"""`cleave up --demo` starts the stack as processes, answers one question and stops cleanly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from cleave.cli.up import resolve_gateways
from cleave.engine.llm import default_model_path

ON_A_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "device", "gateways"), [
    ("disaggregated", "cpu", "auto"), ("colocated", "cpu", "auto"),
    ("colocated", "cpu", "2"),  # gateway processes sharing the ports, the demo's call on one of them
    # the README's first command on a GPU host: KV over CUDA IPC between the workers (auto: a
    # gateway per 4 host cores, up to 4)
    pytest.param("disaggregated", "cuda", "auto", marks=ON_A_GPU),
])
def test_cleave_up_demo_prints_reasoning_and_answer(mode, device, gateways, tmp_path):
    if default_model_path() is None:
        pytest.skip("the shipped reasoner (cleave/assets/reasoner) is not in this checkout")
    completed = subprocess.run(
        [sys.executable, "-m", "cleave.cli.main", "up", "--demo", "--mode", mode, "--device", device, "--grpc-port", "0",
         "--http-port", "0", "--gateways", gateways, "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=170,
    )
    num_gateways = resolve_gateways(gateways if gateways == "auto" else int(gateways), device)
    gateway_names = {"gateway"} | {f"gateway-{index}" for index in range(1, num_gateways)}
    assert completed.returncode == 0, completed.stdout + completed.stderr
    out = completed.stdout
    assert re.search(r"gRPC gateway: 127\.0\.0\.1:\d+", out)
    assert re.search(r"OpenAI HTTP:  http://127\.0\.0\.1:\d+/v1", out)
    metrics = dict(re.findall(r"metrics:\s+(\S+) (http://127\.0\.0\.1:\d+/metrics)", out))
    assert set(metrics) == {"kvstore", "decode-0"} | gateway_names | ({"prefill-0"} if mode == "disaggregated" else set())
    assert len(set(metrics.values())) == len(metrics)  # a port of its own each
    reasoning = out.split("[reasoning]", 1)[1].split("[answer]", 1)[0]
    assert re.search(r"\d\+\d\+\d=\d\d", reasoning)  # the scratchpad is reasoning, not answer
    answer = out.split("[answer]", 1)[1]
    assert re.search(r"The answer is -?\d+", answer)
    assert "<think>" not in out and "</think>" not in out
    assert "stopping cleave" in out
    logs = {path.name: path.read_text() for path in tmp_path.glob("*.log")}
    assert set(logs) == ({"kvstore.log", "decode-0.log"} | {f"{name}.log" for name in gateway_names}
                         | ({"prefill-0.log"} if mode == "disaggregated" else set()))
