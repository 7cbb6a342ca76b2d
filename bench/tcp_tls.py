"""Bulk KV over loopback TCP, plain text vs TLS (`cleave.tls`): what encryption costs a
prompt's hand-off on the TCP transport.

KV of a Llama-3.2-1B-shaped model (16 layers, 8 KV heads, head_dim 64, bf16, 16-token blocks:
32 KiB a token) in CPU caches; one `KVReceiver` and one `KVTransferClient` in this process, on
one event loop, so a row's time holds the sender's and the receiver's work (with TLS: the
encryption and the decryption) on one core: the worst case for TLS, where a real hand-off
splits the two over two hosts. Each row: `send_all` of shuffled blocks until the receiver's
verdict, median of `--reps` after one warm-up; GB/s is KV bytes / ms. A certificate pair is
made for the run with `cleave tls-certs`'s writer.

    python bench/tcp_tls.py --tokens 1024 8192 --out bench/results/transfer
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import format_table, run_name, write_results

from cleave.cli.tls_certs import write_certificates
from cleave.tls import TlsConfig
from cleave.transfer import KVReceiver, KVTransferClient

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 64, 16, torch.bfloat16
COLUMNS = ["tls", "tokens", "blocks", "mb", "ms", "gb_per_s", "vs_plain"]


async def transfer_ms(tls: TlsConfig | None, tokens: int, reps: int) -> list[float]:
    blocks = tokens // BLOCK_SIZE
    pool = 2 * blocks
    shape = (LAYERS, 2, pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    src = torch.randn(shape).to(DTYPE)
    receiver = KVReceiver(torch.zeros(shape, dtype=DTYPE), internal_token="bench", tls=tls)
    client = KVTransferClient("bench", tls=tls)
    generator = torch.Generator().manual_seed(0)
    times = []
    try:
        await receiver.start()
        for rep in range(reps + 1):  # the first opens the connection (and its handshake): not timed
            src_ids = torch.randperm(pool, generator=generator)[:blocks].tolist()
            dst_ids = torch.randperm(pool, generator=generator)[:blocks].tolist()
            start = time.perf_counter()
            pending = receiver.expect(f"t{rep}", dst_ids, timeout_s=120)
            sender = await client.open(pending.handle)
            await sender.send_all(src, src_ids)
            await pending.wait()
            if rep:
                times.append((time.perf_counter() - start) * 1e3)
            assert torch.equal(receiver.kv_cache[:, :, dst_ids[:1]], src[:, :, src_ids[:1]])
    finally:
        await client.close()
        await receiver.close()
    return times


async def run(args: argparse.Namespace, tls: TlsConfig) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        plain_ms = None
        for label, config in (("off", None), ("on", tls)):
            ms = statistics.median(await transfer_ms(config, tokens, args.reps))
            mb = LAYERS * 2 * tokens * KV_HEADS * HEAD_DIM * 2 / 1e6
            plain_ms = ms if config is None else plain_ms
            rows.append({"tls": label, "tokens": tokens, "blocks": tokens // BLOCK_SIZE, "mb": mb, "ms": ms,
                         "gb_per_s": mb / ms, "vs_plain": ms / plain_ms})
            print(format_table(rows[-1:], COLUMNS), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192], help="prompt lengths")
    parser.add_argument("--reps", type=int, default=5, help="timed transfers per row")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer"),
                        help="directory for tcp_tls-<UTC time>.json / .md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        rows = asyncio.run(run(args, write_certificates(Path(directory))))
    print(format_table(rows, COLUMNS))
    write_results(args.out, run_name("tcp_tls"), rows, COLUMNS)


if __name__ == "__main__":
    main()
