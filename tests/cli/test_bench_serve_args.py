"""`cleave bench serve` arguments: registration, validation, the command kept for results."""

from __future__ import annotations

import math

import pytest

from cleave.cli.bench_serve import command_line, recorded_settings
from cleave.cli.main import build_parser


def test_defaults_and_sweep_rates():
    args = build_parser().parse_args(["bench", "serve", "--request-rates", "1, 2,4.5"])
    assert args.request_rates == (1.0, 2.0, 4.5)
    assert math.isinf(args.request_rate) and args.ignore_eos and args.plot
    assert args.endpoint == "/v1/completions" and args.num_prompts == 100


@pytest.mark.parametrize("argv", [
    ["--request-rate", "2", "--request-rates", "1,2"],  # one or the other
    ["--request-rate", "0"],
    ["--request-rates", "1,-2"],
    ["--num-prompts", "0"],
    ["--max-concurrency", "x"],
])
def test_bad_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["bench", "serve", *argv])
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_command_and_settings_mask_the_api_key():
    argv = ["/usr/bin/cleave", "bench", "serve", "--api-key", "s3cret", "--api-key=other", "--model", "m"]
    assert command_line(argv) == "cleave bench serve --api-key '***' '--api-key=***' --model m"
    settings = recorded_settings(build_parser().parse_args(["bench", "serve", "--api-key", "s3cret"]))
    assert settings["api_key"] == "***" and settings["request_rate"] == "inf" and "handler" not in settings
