"""`--model ORG/NAME[@REVISION]` resolves through huggingface_hub's cache, with no network:
the cache is laid out as huggingface_hub lays it out (models--ORG--NAME/snapshots/<sha>/,
refs/main) and HF_HUB_OFFLINE=1 keeps every lookup local. Offline mode and a model that is
not cached give one line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cleave.model.source import hub_id

REPO = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
OLD_SHA = "fedcba9876543210fedcba9876543210fedcba98"


def write_cached_model(cache: Path, repo: str, sha: str, vocab_size: int, ref: str | None = "main") -> Path:
    """A snapshot in huggingface_hub's cache layout (files directly in the snapshot; the
    real cache symlinks them to blobs/, which resolution does not look at)."""
    model_root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = model_root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "max_position_embeddings": 64}
    (snapshot / "config.json").write_text(json.dumps(config))
    if ref is not None:
        (model_root / "refs").mkdir(exist_ok=True)
        (model_root / "refs" / ref).write_text(sha)
    return snapshot


def resolve_offline(hf_home: Path, model_arg: str) -> subprocess.CompletedProcess[str]:
    """Resolve in a fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE at import."""
    code = ("import sys; from cleave.model.source import resolve_model_dir, ModelNotFound\n"
            "try:\n    print(resolve_model_dir(sys.argv[1]))\n"
            "except ModelNotFound as error:\n    print(error, file=sys.stderr); sys.exit(2)\n")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO / 'libs'}:{REPO}"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code, model_arg], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def hf_home(tmp_path):
    cache = tmp_path / "hf" / "hub"
    write_cached_model(cache, "acme/tiny", SHA, vocab_size=11)
    write_cached_model(cache, "acme/tiny", OLD_SHA, vocab_size=7, ref=None)
    return tmp_path / "hf"


def test_hub_ids_are_told_from_paths():
    assert hub_id("acme/tiny") == ("acme/tiny", None)
    assert hub_id("acme/tiny@v1.0") == ("acme/tiny", "v1.0")
    assert hub_id("/models/tiny") is None
    assert hub_id("./tiny") is None
    assert hub_id("tiny") is None


def test_a_hub_id_resolves_to_the_snapshot_refs_main_names(hf_home):
    result = resolve_offline(hf_home, "acme/tiny")
    assert result.returncode == 0, result.stderr
    resolved = Path(result.stdout.strip())
    assert resolved == hf_home / "hub" / "models--acme--tiny" / "snapshots" / SHA
    assert json.loads((resolved / "config.json").read_text())["vocab_size"] == 11


def test_a_revision_picks_that_snapshot(hf_home):
    result = resolve_offline(hf_home, f"acme/tiny@{OLD_SHA}")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).name == OLD_SHA


def test_offline_and_not_cached_is_one_line_naming_the_model(hf_home):
    result = resolve_offline(hf_home, "acme/absent")
    assert result.returncode == 2
    error = result.stderr.strip()
    assert "\n" not in error
    assert error.startswith("--model acme/absent: not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in error


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.chdir(tmp_path)
    from cleave.model.source import resolve_model_dir

    assert resolve_model_dir("acme/tiny") == Path("acme/tiny")


def test_cleave_up_serves_a_hub_model_under_its_hub_id(tmp_path):
    from cleave.cli._model import served_name

    assert served_name("acme/tiny@v1", tmp_path / "snapshots" / SHA) == "acme/tiny"
    assert served_name(None, tmp_path / "reasoner") == "reasoner"
