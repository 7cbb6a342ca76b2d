"""`--reasoning-parser`: the same choice on the gateway and the workers, refused when unknown."""

from __future__ import annotations

import pytest

from cleave.config import ModelConfig, gateway_config, worker_config
from cleave.engine.config import EngineConfig
from cleave.worker import engine_config_from_worker

WORKER_ENV = {"CLEAVE_DEVICE": "cpu"}


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "auto"),
        (["--reasoning-parser", "gpt_oss"], {}, "gpt_oss"),
        ([], {"CLEAVE_REASONING_PARSER": "deepseek_r1"}, "deepseek_r1"),
        (["--reasoning-parser", "qwen3"], {"CLEAVE_REASONING_PARSER": "none"}, "qwen3"),  # the flag wins
        (["--no-reasoning-model"], {}, "none"),
    ],
)
def test_gateway_and_workers_resolve_the_same_parser(argv, env, expected):
    gateway = gateway_config(argv, env)
    assert gateway.model.effective_reasoning_parser == expected
    for name in ("prefill", "decode"):
        worker = worker_config(name, argv, {**WORKER_ENV, **env})
        assert worker.model.effective_reasoning_parser == expected
        assert engine_config_from_worker(worker).reasoning_parser == expected


@pytest.mark.parametrize("name", ["gateway", "decode"])
def test_an_unknown_flag_value_is_refused_by_argparse_naming_the_choices(name, capsys):
    with pytest.raises(SystemExit) as exited:
        if name == "gateway":
            gateway_config(["--reasoning-parser", "gptoss"], {})
        else:
            worker_config(name, ["--reasoning-parser", "gptoss"], WORKER_ENV)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "'gptoss'" in error
    assert "auto" in error and "none" in error and "qwen3" in error and "deepseek_r1" in error and "gpt_oss" in error


def test_an_unknown_environment_value_is_refused_naming_the_variable():
    with pytest.raises(SystemExit, match=r"CLEAVE_REASONING_PARSER.*'r1'.*auto, none, qwen3, deepseek_r1, gpt_oss"):
        gateway_config([], {"CLEAVE_REASONING_PARSER": "r1"})


def test_no_reasoning_model_contradicting_a_named_parser_is_refused():
    with pytest.raises(SystemExit, match="--no-reasoning-model contradicts --reasoning-parser qwen3"):
        gateway_config(["--no-reasoning-model", "--reasoning-parser", "qwen3"], {})


def test_typed_configs_refuse_unknown_names():
    with pytest.raises(ValueError, match="ModelConfig.reasoning_parser must be one of auto, none"):
        ModelConfig(reasoning_parser="harmony")
    with pytest.raises(ValueError, match="EngineConfig.reasoning_parser must be one of auto, none"):
        EngineConfig(model="m", reasoning_parser="harmony")
