"""`cleave.rpc.auth.MetadataAuth`: which calls it opens, which it refuses, and what it says."""

from __future__ import annotations

import pytest

from cleave.errors import Unauthenticated
from cleave.api_keys import ApiKeys, key_tag
from cleave.rpc.auth import api_key_auth, call_metadata, internal_auth

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
    keys = ApiKeys(("sk-1",))
    assert keys.tenant("Bearer sk-1") == key_tag("sk-1")
    assert keys.tenant(None) is None and keys.tenant("Bearer sk-2") is None and keys.tenant("sk-1") is None


def test_any_of_several_api_keys_is_taken_and_names_its_tenant():
    keys = ApiKeys(("sk-a", "sk-b"))
    auth = api_key_auth(keys)
    for key in keys.keys:
        auth.check("/cleave.v1.Gateway/Generate", call_metadata(api_key=key))
    with pytest.raises(Unauthenticated, match="is wrong"):
        auth.check("/cleave.v1.Gateway/Generate", call_metadata(api_key="sk-c"))
    assert keys.isolates and not ApiKeys(("sk-a",)).isolates
    tenants = {keys.tenant(f"Bearer {key}") for key in keys.keys}
    assert tenants == {key_tag("sk-a"), key_tag("sk-b")} and len(tenants) == 2
    assert keys.tenant("Bearer sk-c") is None and keys.tenant(None) is None
    assert all(len(tag) == 16 and "sk-" not in tag for tag in tenants)
    assert "sk-a" not in repr(keys) and "sk-a" not in repr(auth)


@pytest.mark.parametrize("keys", [(), ("",), ("sk-a\n",), ("sk-a", "sk-a")])
def test_api_keys_that_could_not_be_sent_or_tell_tenants_apart_are_refused(keys):
    with pytest.raises(ValueError):
        ApiKeys(keys)
