"""A Prefill call read to its end as one `PrefillResponse`.

With a decode worker to start, a prefill worker streams the first tokens ahead of the KV
transfer, then the transfer's statistics (see `protos/cleave/v1/prefill.proto`). Callers
that want the whole result at once (a custom router, tests) read it with `prefill_response`.
"""

from __future__ import annotations

import grpc

from cleave.proto.cleave.v1 import prefill_pb2


async def prefill_response(call: grpc.aio.UnaryStreamCall) -> prefill_pb2.PrefillResponse:
    """The stream's first message, with the `transfer` of a later one; raises the call's
    error (grpc.aio.AioRpcError), also one that comes after the first tokens."""
    response: prefill_pb2.PrefillResponse | None = None
    async for message in call:
        if response is None:
            response = message
        elif message.HasField("transfer"):
            response.transfer.CopyFrom(message.transfer)
    if response is None:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="the Prefill stream ended without a response")
    return response
