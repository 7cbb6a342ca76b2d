"""`cleave.rpc.auth` and `cleave.rpc.connection_limits` at their edges: a method that only
looks like health, a token sent twice, an unlimited open-file limit, a sandbox that refuses to
raise it."""

from __future__ import annotations

import resource

import pytest

from cleave.errors import Unauthenticated
from cleave.rpc.auth import INTERNAL_TOKEN_KEY, internal_auth
from cleave.rpc.connection_limits import FD_RESERVE, OPEN_FILE_TARGET, connection_cap, raise_open_file_limit

TOKEN = "s3cret-token"


@pytest.mark.parametrize("method", ["/grpc.healthz.Probe/Check", "/grpc.health_v2.Health/Check",
                                    "/grpc.reflectionx.Reflect/List"])
def test_a_service_whose_name_only_starts_like_health_or_reflection_needs_the_token(method):
    with pytest.raises(Unauthenticated, match="needs the internal token"):
        internal_auth(TOKEN).check(method, ())


def test_the_first_token_entry_decides_and_a_right_one_after_a_wrong_one_does_not_help():
    auth = internal_auth(TOKEN)
    with pytest.raises(Unauthenticated, match="is wrong"):
        auth.check("/cleave.v1.KVStore/Put", ((INTERNAL_TOKEN_KEY, "guess"), (INTERNAL_TOKEN_KEY, TOKEN)))
    auth.check("/cleave.v1.KVStore/Put", (("authorization", "Bearer x"), (INTERNAL_TOKEN_KEY, TOKEN)))


def _fake_limits(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, refuse: type[Exception] | None = None) -> list:
    """Replace getrlimit/setrlimit with a recorded pair; `refuse` makes setrlimit raise it."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))

    def setrlimit(which, values):  # type: ignore[no-untyped-def]
        calls.append(values)
        if refuse is not None:
            raise refuse("not permitted here")

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    return calls


def test_an_unlimited_open_file_limit_is_left_unlimited(monkeypatch):
    calls = _fake_limits(monkeypatch, resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert raise_open_file_limit() == resource.RLIM_INFINITY
    assert calls == []  # never lowered to the target


@pytest.mark.parametrize("refusal", [ValueError, OSError])
def test_a_refused_raise_keeps_the_limit_as_it_was(monkeypatch, refusal):
    calls = _fake_limits(monkeypatch, 1024, 4096, refuse=refusal)
    assert raise_open_file_limit(target=65536) == 1024
    assert calls == [(4096, 4096)]


def test_the_default_cap_under_an_unlimited_open_file_limit_follows_the_target(monkeypatch):
    _fake_limits(monkeypatch, resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert connection_cap(None) == (OPEN_FILE_TARGET - FD_RESERVE) // 2 == 32640
