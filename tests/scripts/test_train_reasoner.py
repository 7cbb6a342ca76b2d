"""scripts/train_reasoner.py is reproducible: the same seed writes bit-identical weights.

A tiny model trains for a few steps in fresh interpreters, as a user would run the script;
two runs with one seed must produce the same model.safetensors bytes, and another seed must
not (so the check cannot pass on weights that ignore the seed).
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_reasoner.py"
TINY = ["--steps", "100", "--stop-step", "3", "--batch-size", "4", "--hidden-size", "32", "--num-layers", "1",
        "--eval-every", "0", "--eval-problems", "0"]
RUN_TIMEOUT_S = 240


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three short trainings run side by side: seed 0 twice, seed 1 once; name -> (out dir, record)."""
    root = tmp_path_factory.mktemp("train_reasoner")
    seeds = {"first": 0, "second": 0, "other_seed": 1}
    processes = {}
    try:
        for name, seed in seeds.items():
            command = [sys.executable, str(SCRIPT), *TINY, "--seed", str(seed), "--out", str(root / name),
                       "--record", str(root / f"{name}.json")]
            processes[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, process in processes.items():
            output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
            assert process.returncode == 0, f"{name} run failed:\n{output}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return {name: (root / name, json.loads((root / f"{name}.json").read_text())) for name in seeds}


def test_same_seed_writes_bit_identical_weights(runs):
    (first_dir, first), (second_dir, second) = runs["first"], runs["second"]
    assert sha256(first_dir / "model.safetensors") == sha256(second_dir / "model.safetensors")
    assert first["model_sha256"] == second["model_sha256"] == sha256(first_dir / "model.safetensors")


def test_another_seed_writes_different_weights(runs):
    assert runs["other_seed"][1]["model_sha256"] != runs["first"][1]["model_sha256"]


def test_record_names_versions_threads_and_config(runs):
    out_dir, record = runs["first"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["numpy"] == numpy.__version__
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert record["torch_threads"] == 1
    assert (record["config"]["seed"], record["config"]["stop_step"], record["config"]["hidden_size"]) == (0, 3, 32)
    assert "--seed 0" in record["command"]
    assert "evaluation" not in record
    assert (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()
