"""A Node.js client built from protos/ alone (@grpc/grpc-js + @grpc/proto-loader) streams a
Generate call from a running gateway and sees the same text as the Python client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.e2e.conftest import START_HANG_S
from tests.services.gateway.stack import start_stack, write_reasoning_config

NODE_DIR = Path(__file__).parent / "node"
PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROMPT = "Hello world!"


@pytest.fixture(scope="module")
def node_packages() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to build the Node.js client (install Node.js 18+)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True,
                       timeout=300)
    return NODE_DIR


@pytest.mark.timeout(300)
async def test_node_client_streams_generate(node_packages, tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "model")
    write_reasoning_config(model_dir)
    stack = await start_stack(model_dir, "colocated")
    try:
        async with GatewayClient(stack.gateway_address) as client:
            expected = await client.complete(PROMPT, max_tokens=12, temperature=0.0)
        process = await asyncio.create_subprocess_exec(
            "node", str(node_packages / "generate.js"), str(PROTO_ROOT), stack.gateway_address, PROMPT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
    finally:
        await stack.close()
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    assert result["text"] == expected.samples[0].text
    assert result["reasoning"] == expected.samples[0].reasoning_text
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["completion_tokens"] == 12
    assert result["messages"] >= 2


@pytest.mark.timeout(300)
async def test_node_client_streams_generate_over_tls(node_packages, tmp_path):
    """The same call to a gateway serving TLS (`cleave up --tls`), checked against the stack's CA."""
    model_dir = write_tiny_checkpoint(tmp_path / "model")
    write_reasoning_config(model_dir)
    spec = StackSpec(model=model_dir, mode="colocated", grpc_port=0, http_port=None, log_level="WARNING",
                     metrics=False, tls=True)
    stack = ProcessStack(spec, tmp_path / "stack")
    try:
        stack.start(timeout_s=START_HANG_S)
        async with GatewayClient(stack.gateway_address, credentials=stack.channel_credentials()) as client:
            expected = await client.complete(PROMPT, max_tokens=12, temperature=0.0)
        plain = await _node_generate(node_packages, stack.gateway_address)
        process = await _node_generate(node_packages, stack.gateway_address, str(stack.tls.ca_file))
    finally:
        stack.stop()
    assert plain.returncode != 0 and "Generate failed: 14" in plain.stderr  # plain text to TLS: UNAVAILABLE
    assert process.returncode == 0, process.stderr
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["text"] == expected.samples[0].text and result["completion_tokens"] == 12


async def _node_generate(node_packages: Path, address: str, *ca_file: str) -> subprocess.CompletedProcess:
    process = await asyncio.create_subprocess_exec(
        "node", str(node_packages / "generate.js"), str(PROTO_ROOT), address, PROMPT, *ca_file,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    return subprocess.CompletedProcess(["node", "generate.js"], process.returncode, stdout.decode(), stderr.decode())
