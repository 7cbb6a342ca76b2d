"""The gateway runs without torch or Triton: it imports, parses its flags and builds its
servicer, model and HTTP API in a process where importing either raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# A meta-path finder ahead of every other: importing torch or triton (or any submodule)
# raises, so a module that needs them anywhere on the gateway's path fails loudly.
BLOCK = textwrap.dedent(
    """
    import sys

    class _Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ImportError(f"the gateway imported {name}")
            return None

    sys.meta_path.insert(0, _Blocked())
    """
)


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    env_path = f"{REPO / 'libs'}:{REPO}"
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        cwd=REPO, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


def test_the_blocker_blocks():
    result = run_blocked("import cleave.engine.llm_engine")
    assert result.returncode != 0
    assert "the gateway imported torch" in result.stderr


def test_gateway_modules_import_without_torch():
    result = run_blocked(
        """
        import services.gateway
        import services.gateway.__main__
        import services.gateway.servicer
        import services.gateway.http_api
        import services.gateway.sample_text
        import services.gateway.migration
        import cleave.generation.outputs, cleave.generation.reasoning, cleave.generation.stop
        assert not any(name.split(".")[0] in ("torch", "triton") for name in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr


def test_gateway_builds_its_servicer_and_api_without_torch(model_dir):
    result = run_blocked(
        f"""
        from services.gateway.__main__ import build
        from cleave.config import gateway_config

        config = gateway_config(["--model", {str(model_dir)!r}, "--mode", "colocated", "--decode", "127.0.0.1:1",
                                 "--http-listen", "127.0.0.1:0"], {{}})
        servicer, process = build(config)
        assert process.api is not None
        print(process.backend.model.is_reasoning_model, process.backend.model.vocab_size)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "512"]
