"""`cleave up`'s model and decode flags reach the services that read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.cli.main import build_parser
from cleave.cli.up import stack_spec


def spec_of(*flags: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["up", *flags])
    return stack_spec(args, Path("/models/tiny"), "tiny")


def test_defaults_pass_nothing_extra():
    spec = spec_of()
    assert spec.worker_args == () and spec.gateway_args == () and spec.served_model_name == "tiny"


def test_the_reasoning_parser_goes_to_gateway_and_workers_and_the_stream_interval_to_the_workers():
    spec = spec_of("--reasoning-parser", "gpt_oss", "--stream-interval", "4", "--mode", "colocated")
    assert spec.gateway_args == ("--reasoning-parser", "gpt_oss")
    assert spec.worker_args == ("--reasoning-parser", "gpt_oss", "--stream-interval", "4")
    assert spec.mode == "colocated"


def test_packed_experts_go_to_the_workers_only():
    spec = spec_of("--packed-experts")
    assert spec.worker_args == ("--packed-experts",) and spec.gateway_args == ()


def test_an_fp8_kv_cache_goes_to_every_worker_and_auto_passes_nothing():
    assert spec_of("--kv-cache-dtype", "fp8").worker_args == ("--kv-cache-dtype", "fp8")
    assert spec_of("--kv-cache-dtype", "auto").worker_args == ()
    assert spec_of("--kv-cache-dtype", "fp8").gateway_args == ()


@pytest.mark.parametrize("flags", [("--reasoning-parser", "nonsense"), ("--stream-interval", "0"),
                                   ("--stream-interval", "two"), ("--kv-cache-dtype", "fp4")])
def test_bad_values_are_refused_by_the_parser(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["up", *flags])
    assert exited.value.code == 2 and flags[0] in capsys.readouterr().err


def test_auto_gateways_are_one_on_the_cpu_and_one_per_four_cores_up_to_four_on_a_gpu(monkeypatch):
    from cleave.cli import up

    assert spec_of("--device", "cpu").num_gateways == 1  # the default is auto
    assert spec_of("--device", "cpu", "--gateways", "3").num_gateways == 3
    for cores, expected in ((2, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(up.os, "cpu_count", lambda: cores)
        assert up.resolve_gateways("auto", "cuda") == expected, cores
        assert up.resolve_gateways("auto", "cuda:1") == expected, cores
        assert up.resolve_gateways("auto", "cpu") == 1
        assert up.resolve_gateways(2, "cuda") == 2


@pytest.mark.parametrize("value", ["0", "-1", "x", ""])
def test_a_gateway_count_below_one_or_not_a_number_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["up", "--gateways", value])
    assert exited.value.code == 2
    assert "--gateways: must be auto or a positive integer" in capsys.readouterr().err
