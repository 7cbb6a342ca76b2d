"""bench/decode_profile.py: kernels split by their place in the step, and the critical path."""

from __future__ import annotations

import argparse

import pytest

from tests.bench.bench_modules import bench_fixture

profile = bench_fixture("decode_profile")


def _two_steps() -> list[tuple[float, float, str]]:
    # per step: gemv (qkv), attention, gemv (o), gemv (lm_head, past the whole rounds)
    spans = []
    for step in range(2):
        t = 100.0 * step
        spans += [(t, t + 3, "gemv"), (t + 3, t + 10, "attn"), (t + 10, t + 12, "gemv"), (t + 12, t + 20, "gemv")]
    return spans[::-1]  # order does not matter: spans are sorted by start


def test_launches_are_named_by_their_place_in_each_step(profile):
    labelled = profile.label_roles(_two_steps(), {"gemv": ["qkv", "o"]}, steps=2)
    names = [name for _, _, name in labelled]
    assert names == ["gemv[qkv]", "attn", "gemv[o]", "gemv[rest]"] * 2
    assert [(start, end) for start, end, _ in labelled] == sorted((s, e) for s, e, _ in _two_steps())


def test_uneven_launches_are_refused(profile):
    with pytest.raises(ValueError, match="5 launches in 2 calls"):
        profile.label_roles(_two_steps()[1:], {"gemv": ["qkv"]}, steps=2)


def test_roles_parse_and_critical_path_charges_overlap_once(profile):
    assert profile.parse_roles("_gemv_kernel=qkv,o;_x=a") == {"_gemv_kernel": ["qkv", "o"], "_x": ["a"]}
    with pytest.raises(argparse.ArgumentTypeError):
        profile.parse_roles("_gemv_kernel")
    charged = profile.critical_path([(0.0, 4.0, "a"), (2.0, 6.0, "b"), (8.0, 9.0, "a")])
    assert charged["a"] == 5.0 and charged["b"] == 2.0 and charged[profile.IDLE] == 2.0
