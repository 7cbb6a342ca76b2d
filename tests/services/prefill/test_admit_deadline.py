"""A prefill worker's Admit on the decode worker waits as long as the request's caller lets it
(the Prefill call's deadline): in a full decode worker's admissions queue a request with a
120 s deadline waited only the hop's own 30 s, then was moved. Without a deadline the hop's
own timeout holds. And the Prefill servicer hands the call's deadline on."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest

from cleave.errors import Unavailable
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import prefill_pb2
from services.prefill import servicer as prefill_servicer
from services.prefill.backend import DecodeTarget, PrefillSpec
from services.prefill.decode_handoff import CONTROL_TIMEOUT_S, DecodeHandoff

SPEC = PrefillSpec("r", (1, 2, 3), SamplingParams(max_tokens=1), None,
                   decode=DecodeTarget(address="127.0.0.1:1", gateway_id="gateway-0"))


class RecordingStub:
    """A decode worker that refuses every Admit, noting the timeout it came with."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    async def Admit(self, request, timeout=None):  # type: ignore[no-untyped-def]
        self.timeouts.append(timeout)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")


async def test_an_admit_waits_until_the_callers_deadline_or_the_hops_own_timeout():
    stub = RecordingStub()
    links = SimpleNamespace(stub=lambda address: stub)
    now = asyncio.get_running_loop().time()
    for spec in (SPEC, replace(SPEC, deadline=now + 120.0)):
        handoff = DecodeHandoff(links, spec, "prefill-0", spawn=lambda awaitable: None)  # type: ignore[arg-type]
        handoff.admit()
        with pytest.raises(Unavailable):
            await handoff.reserved()
    assert stub.timeouts[0] == CONTROL_TIMEOUT_S
    assert 110.0 < stub.timeouts[1] <= 120.0


async def test_the_prefill_servicer_hands_the_calls_deadline_on(monkeypatch):
    seen: list[PrefillSpec] = []

    class Backend:
        async def prefill(self, spec, early):  # type: ignore[no-untyped-def]
            seen.append(spec)
            raise Unavailable("enough")

    monkeypatch.setattr(prefill_servicer, "prefill_spec_from_proto", lambda request, model_id: SPEC)
    servicer = prefill_servicer.PrefillServicer(Backend(), "m")  # type: ignore[arg-type]
    now = asyncio.get_running_loop().time()
    for remaining in (None, 60.0):
        context = SimpleNamespace(time_remaining=lambda remaining=remaining: remaining)
        with pytest.raises(Unavailable):
            await servicer.Prefill(prefill_pb2.PrefillRequest(), context)  # type: ignore[arg-type]
    assert seen[0].deadline is None
    assert now + 55.0 < seen[1].deadline <= asyncio.get_running_loop().time() + 60.0
