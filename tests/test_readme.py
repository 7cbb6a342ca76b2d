"""Every example in README.md runs as written, so a README that drifts from the code fails.

Each fenced ```bash/```sh, ```python and ```js/```javascript block is one test, named by its
line, run verbatim from the repository root: shell blocks with `bash -euo pipefail`, Python
blocks with this interpreter, Node blocks with `node` (packages from tests/clients/node,
installed the way tests/clients/test_node_client.py does). They talk to one CPU stack with
the shipped reasoner, started once for the module on the README's own ports (gRPC 50051,
HTTP 8000) and in colocated mode, the quickest to start; the examples are the same in every
mode. Its gateway takes request priorities (`--scheduling-policy priority`), as the
Priorities example says it must; nothing else differs from `cleave up`. A busy port skips the module, naming it. ```text and unlabelled blocks are not run,
nor a block right under an HTML comment `<!-- not run: REASON -->` (it is skipped with the
reason).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from cleave.cli._model import served_name
from cleave.cli._ownership import PortInUse, check_ports_free
from cleave.cli._stack import ProcessStack, StackSpec
from cleave.engine.llm import default_model_path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NODE_DIR = ROOT / "tests" / "clients" / "node"
GRPC_PORT, HTTP_PORT = 50051, 8000  # the ports README's examples name
RUNNERS = {"bash": "bash", "sh": "bash", "python": "python", "js": "node", "javascript": "node"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<language>[\w+-]*)\s*$")
BLOCK_TIMEOUT_S = 120  # a guard against a hang; the examples take seconds
# A guard against a hang, not a wait: the stack is up once every service reports SERVING.
START_HANG_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README: its opening fence's 1-based line, its language,
    its code, and the reason it is not run (None: it runs)."""

    line: int
    language: str
    code: str
    not_run: str | None


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of `text`, in order."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].rstrip() != "```":
            index += 1
        above = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = NOT_RUN.search(above)
        blocks.append(Block(line=start + 1, language=match["language"].lower(),
                            code="\n".join(lines[start + 1:index]) + "\n",
                            not_run=marker["reason"] if marker else None))
        index += 1
    return blocks


RUNNABLE = [block for block in readme_blocks(README.read_text()) if block.language in RUNNERS]


def test_the_parser_finds_fences_languages_and_markers():
    text = "intro\n```bash\necho hi\n```\n\n<!-- not run: needs a GPU -->\n\n```python\nprint(1)\n```\n```\nplain\n```\n"
    assert readme_blocks(text) == [
        Block(line=2, language="bash", code="echo hi\n", not_run=None),
        Block(line=8, language="python", code="print(1)\n", not_run="needs a GPU"),
        Block(line=11, language="", code="plain\n", not_run=None),
    ]


def test_the_readme_has_runnable_examples():
    assert {block.language for block in RUNNABLE} >= {"bash", "python", "js"}
    assert [block for block in RUNNABLE if block.not_run is None]


def _wait_ready(url: str, timeout_s: float) -> None:
    """Poll the gateway's readiness route until it answers 200 (or fail at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 in {timeout_s:g} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def readme_stack(tmp_path_factory):
    model = default_model_path()
    if model is None:
        pytest.skip("the shipped reasoner (cleave/assets/reasoner) is not in this checkout")
    try:
        check_ports_free("127.0.0.1", [(GRPC_PORT, "the README's gRPC port"), (HTTP_PORT, "the README's HTTP port")])
    except PortInUse as error:
        pytest.skip(f"README examples use fixed ports: {error}")
    spec = StackSpec(model=model, mode="colocated", grpc_port=GRPC_PORT, http_port=HTTP_PORT,
                     served_model_name=served_name(None, model), log_level="WARNING", metrics=False,
                     gateway_args=("--scheduling-policy", "priority"))  # the Priorities example sends one
    stack = ProcessStack(spec, tmp_path_factory.mktemp("readme-stack"))
    try:
        stack.start(timeout_s=START_HANG_S)  # stops what it started if it fails
        _wait_ready(f"http://127.0.0.1:{HTTP_PORT}/ready", START_HANG_S)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def node_path() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the README's Node.js example (install Node.js 18+)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True,
                       timeout=300)
    return NODE_DIR / "node_modules"


def _command(block: Block, script: Path) -> list[str]:
    runner = RUNNERS[block.language]
    if runner == "bash":
        return ["bash", "-euo", "pipefail", str(script)]
    if runner == "python":
        return [sys.executable, str(script)]
    return ["node", str(script)]


@pytest.mark.timeout(START_HANG_S + BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line{block.line}-{block.language}" for block in RUNNABLE])
def test_readme_example_runs(block, request, tmp_path):
    if block.not_run is not None:
        pytest.skip(f"README.md:{block.line} is marked not run: {block.not_run}")
    first_word = block.code.split()[0]
    if block.language in ("bash", "sh") and first_word not in ("cleave", "python") and shutil.which(first_word) is None:
        pytest.skip(f"README.md:{block.line} needs {first_word}, which is not installed")
    request.getfixturevalue("readme_stack")  # after the skips: a run of skipped blocks starts no stack
    env = dict(os.environ)
    # `python` and `cleave` are this interpreter's, as after `pip install -e .` into it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language in ("js", "javascript"):
        env["NODE_PATH"] = str(request.getfixturevalue("node_path"))
    suffix = {"bash": ".sh", "python": ".py", "node": ".js"}[RUNNERS[block.language]]
    script = tmp_path / f"readme_line{block.line}{suffix}"
    script.write_text(block.code)
    completed = subprocess.run(_command(block, script), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    shown = f"README.md:{block.line} ({block.language})\n--- stdout\n{completed.stdout}\n--- stderr\n{completed.stderr}"
    assert completed.returncode == 0, shown
    assert completed.stdout.strip(), shown  # every example prints what it got
    assert '"error"' not in completed.stdout, shown  # an HTTP error body (curl -s exits 0 on it)
    if RUNNERS[block.language] == "node":
        assert not completed.stderr.strip(), shown  # the example's error handler writes here


GRPCURL_CALL = re.compile(r"-d '(?P<body>[^']*)'\s*\\?\s*\S+\s+(?P<service>[\w.]+)/(?P<method>\w+)")


def test_grpcurl_examples_name_a_real_method_and_a_valid_request():
    """Without grpcurl installed the grpcurl block is skipped above; its request body and
    method are still checked against the protobuf contract here."""
    from google.protobuf import json_format
    from google.protobuf.descriptor_pool import Default
    from google.protobuf.message_factory import GetMessageClass

    from cleave.proto.cleave.v1 import gateway_pb2  # noqa: F401  (registers cleave.v1 in the pool)

    calls = [match for block in RUNNABLE if block.code.startswith("grpcurl") for match in GRPCURL_CALL.finditer(block.code)]
    assert calls, "the README's grpcurl example is gone or no longer matches `-d '{...}' ADDRESS SERVICE/METHOD`"
    for call in calls:
        method = Default().FindServiceByName(call["service"]).methods_by_name[call["method"]]
        json_format.Parse(call["body"], GetMessageClass(method.input_type)())  # raises on an unknown field
