"""`cleave generate` in a subprocess on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

from cleave.cli.main import build_parser
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint


def test_generate_json_prints_one_line_per_sample(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=2)
    command = [
        sys.executable, "-m", "cleave.cli.main", "generate", "--model", str(path), "--json",
        "--max-tokens", "6", "--temperature", "0.7", "--seed", "4", "--n", "2", "--device", "cpu", "Hello world",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1]

    (expected,) = LLM(path, device="cpu", seed=4).generate(
        "Hello world", SamplingParams(max_tokens=6, temperature=0.7, seed=4, n=2)
    )
    for record, sample in zip(records, expected.outputs):
        assert set(record) == {"index", "text", "token_ids", "reasoning", "finish_reason"}
        assert record["token_ids"] == sample.token_ids and len(record["token_ids"]) <= 6
        assert record["text"] == sample.text and record["finish_reason"] == sample.finish_reason.value


def test_generate_is_registered_with_its_options():
    args = build_parser().parse_args(["generate", "--max-tokens", "3", "--raw", "hi"])
    assert args.command == "generate" and args.max_tokens == 3 and args.raw and args.model is None
