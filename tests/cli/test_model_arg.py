"""`cleave generate` and `cleave up` name a missing or unusable --model in one line (exit 2),
before loading anything."""

from __future__ import annotations

import pytest

from cleave.cli.main import main


@pytest.mark.parametrize("command", [["generate", "hello"], ["up"]])
def test_a_missing_model_directory_is_one_line_naming_it(command, capsys, tmp_path):
    missing = tmp_path / "nonexistent"
    assert main([command[0], "--model", str(missing), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --model {missing}: no such directory"


@pytest.mark.parametrize("command", [["generate", "hello"], ["up"]])
def test_a_directory_without_config_is_not_a_checkpoint(command, capsys, tmp_path):
    assert main([command[0], "--model", str(tmp_path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model {tmp_path}: not a checkpoint directory (it has no config.json)")
    assert "\n" not in err


@pytest.mark.parametrize("command", [["generate", "hello"], ["up"]])
@pytest.mark.parametrize(("config", "reason"), [
    ('{"architectures": ["GPT2LMHeadModel"], "n_layer": 1}',
     "unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"),
    ('{"model_type": "llama"}', "config.json must name exactly one architecture, got []"),
    ('{"architectures": ["LlamaForCausalLM"], ', "its config.json is not JSON"),
])
def test_a_model_cleave_cannot_load_is_one_line_naming_why(command, config, reason, capsys, tmp_path):
    (tmp_path / "config.json").write_text(config)
    assert main([command[0], "--model", str(tmp_path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model {tmp_path}: {reason}") and "\n" not in err, err


def test_generate_names_a_field_its_architectures_config_lacks(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 10}')
    assert main(["generate", "--model", str(tmp_path), "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --model {tmp_path}: config.json of a LlamaForCausalLM has no 'num_attention_heads'", err
