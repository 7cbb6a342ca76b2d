"""`cleave.rpc.auth.MetadataAuth`: which calls it opens, which it refuses, and what it says."""

from __future__ import annotations

import pytest

from cleave.errors import Unauthenticated
from cleave.rpc.auth import api_key_auth, bearer_matches, call_metadata, internal_auth

TOKEN = "s3cret-token"


def test_no_secret_configured_means_no_check():
    assert internal_auth(None) is None and api_key_auth(None) is None
    assert call_metadata() == ()


@pytest.mark.parametrize("method", ["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"])
def test_health_and_reflection_stay_open(method):
    internal_auth(TOKEN).check(method, ())


def test_the_internal_token_is_checked_on_every_other_method():
    auth = internal_auth(TOKEN)
    auth.check("/cleave.v1.Decode/Attach", call_metadata(internal_token=TOKEN))
    with pytest.raises(Unauthenticated, match="Decode/Attach needs the internal token in the 'x-cleave-internal-token'"):
        auth.check("/cleave.v1.Decode/Attach", ())
    for wrong in ("s3cret", TOKEN + "x", "", b"s3cret-token"):
        with pytest.raises(Unauthenticated, match="is wrong; start every service"):
            auth.check("/cleave.v1.KVStore/Put", (("x-cleave-internal-token", wrong),))
    assert TOKEN not in repr(auth)


def test_the_api_key_is_a_bearer_authorization():
    auth = api_key_auth("sk-1")
    auth.check("/cleave.v1.Gateway/Generate", call_metadata(api_key="sk-1"))
    with pytest.raises(Unauthenticated, match="authorization: Bearer <key>"):
        auth.check("/cleave.v1.Gateway/Generate", (("authorization", "sk-1"),))
    assert bearer_matches("Bearer sk-1", "sk-1")
    assert not bearer_matches(None, "sk-1") and not bearer_matches("Bearer sk-2", "sk-1")
