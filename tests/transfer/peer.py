"""Receiver process for the GPU transfer tests: prints its TransferHandle, then a digest.

    python tests/transfer/peer.py --transport cuda_ipc --device 0 --blocks 3,9,4
Prints `HANDLE <hex of a serialized cleave.v1.TransferHandle>`, waits for the transfer and
prints `DIGEST <sha256 of the received blocks' bytes>` (or `ERROR <message>`, exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys

import torch

from cleave.rpc.convert import transfer_handle_to_proto
from cleave.rpc.types import TransportKind
from cleave.transfer import KVReceiver

SHAPE = dict(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=8, head_dim=64)


def digest(cache: torch.Tensor, block_ids: list[int]) -> str:
    blocks = cache[:, :, block_ids].contiguous().cpu()
    return hashlib.sha256(blocks.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


async def main(args: argparse.Namespace) -> int:
    device = torch.device(f"cuda:{args.device}")
    cache = torch.zeros(SHAPE["num_layers"], 2, SHAPE["num_blocks"], SHAPE["block_size"],
                        SHAPE["num_kv_heads"], SHAPE["head_dim"], dtype=torch.bfloat16, device=device)
    receiver = KVReceiver(cache)
    await receiver.start()
    comm = None
    if args.transport == "nccl":
        from cleave.transfer.nccl import NcclCommunicator

        comm = await NcclCommunicator.create(bytes.fromhex(args.nccl_id), rank=1, device=device)
    block_ids = [int(b) for b in args.blocks.split(",")]
    pending = receiver.expect("gpu-test", block_ids, timeout_s=60, transport=TransportKind(args.transport), nccl=comm)
    print("HANDLE", transfer_handle_to_proto(pending.handle).SerializeToString().hex(), flush=True)
    try:
        await pending.wait()
    except Exception as exc:  # reported to the parent test through stdout
        print("ERROR", exc, flush=True)
        return 1
    print("DIGEST", digest(cache, block_ids), flush=True)
    await receiver.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["tcp", "cuda_ipc", "nccl"], required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--blocks", required=True)
    parser.add_argument("--nccl-id", default="")
    sys.exit(asyncio.run(main(parser.parse_args())))
