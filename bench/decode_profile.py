"""Where a graph-replayed decode step spends its time, kernel by kernel.

Builds the same Llama-3.2-1B-shaped model and paged cache as `bench/decode.py`, captures the
decode step for each (batch, context), profiles `--steps` replays with the CUDA profiler and
reports, per kernel name: launches per step, device microseconds per step, the share of
the step, and the kernel's share of the critical path: with programmatic dependent launch
kernels overlap, so each kernel is also charged only the time it extends the step (from
the later of its start and the previous kernels' end to its own end). What no kernel
covers is reported as `(idle)`, and split by the kernel that ends each gap.

    python bench/decode_profile.py --cases 1x1024,64x1024,32x32768 --out bench/results/decode
    python bench/decode_profile.py --model qwen3-30b-a3b --cases 1x1024,64x1024 --max-model-len 2048
    python bench/decode_profile.py --model gpt-oss-20b --cases 1x1024,64x1024 --max-model-len 2048

`--model qwen3-30b-a3b` profiles bench/moe.py's Qwen3-30B-A3B-shaped MoE model instead
(random weights built in device memory). `--model gpt-oss-20b` profiles its gpt-oss-20b
shape as `bench/moe.py --part decode` times it: on the paired KV cache gpt-oss is served
with (its sliding layers over window tables holding only the pages in view), each case's
sequences holding CONTEXT tokens and decoding one more, each case's whole step captured
into a CUDA graph of its own. Its `kv_gb` counts a sliding layer's window, not the context.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402
from decode import Case, build_model, decode_batch, llama_3_2_1b_config, step_ms  # noqa: E402

from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig  # noqa: E402
from cleave.model.config import ModelConfig  # noqa: E402
from cleave.model.llama import allocate_kv_cache  # noqa: E402

COLUMNS = ["case", "kernel", "per_step", "us_per_step", "critical_us", "pct_of_step"]
IDLE = "(idle)"
MODELS = {"llama-1b": "Llama-3.2-1B", "qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-20b": "gpt-oss-20b"}

# a case's step as a call that replays its graph, and the KV-cache bytes that step reads
CaseStep = Callable[[Case], tuple[Callable[[], object], int]]


def profiled_model(name: str, max_model_len: int, device: torch.device):  # noqa: ANN201
    """(config, model) of `--model` with random bf16 weights on `device`."""
    if name == "llama-1b":
        config = llama_3_2_1b_config()
        return config, build_model(config, device)
    from moe import MoEShape, decode_model_config, random_model

    config = decode_model_config(MoEShape(), max_model_len)
    return config, random_model(config, torch.bfloat16, device)


def kv_bytes_read(config: ModelConfig, batch: int, seq_len: int) -> int:
    """KV-cache bytes one decode step's attention reads for `batch` sequences of `seq_len`
    positions: each full-attention layer every position, each sliding layer its window at
    most (gpt-oss: 128), as bench/moe.py's roofline counts them. For models without windows
    this is `batch * seq_len * decode.kv_bytes_per_token(config)`, which would charge
    gpt-oss's sliding layers the whole context."""
    per_position = 2 * config.num_key_value_heads * config.head_dim * config.dtype.itemsize
    positions = sum(min(seq_len, config.layer_sliding_window(layer) or seq_len)
                    for layer in range(config.num_hidden_layers))
    return batch * positions * per_position


def runner_case_steps(name: str, cases: list[Case], block_size: int, max_model_len: int,
                      device: torch.device) -> CaseStep:
    """Llama / Qwen3: the model, one cache of random values with a block for every case's
    sequences, and a `CUDAGraphRunner` captured for up to the largest batch; each case's
    sequences hold CONTEXT tokens (the new one at position CONTEXT - 1) on shuffled blocks."""
    config, model = profiled_model(name, max_model_len, device)
    num_blocks = max(case.kv_blocks(block_size) for case in cases) + 1
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, device=device)
    kv_cache.normal_(0.0, 1.0)

    def step(input_ids, positions, metadata):
        return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    runner = CUDAGraphRunner(
        step,
        GraphRunnerConfig(
            max_batch_size=max(case.batch for case in cases),
            max_blocks_per_seq=-(-max_model_len // block_size),
            block_size=block_size,
        ),
        device,
    )
    with torch.inference_mode():
        runner.capture()

    def case_step(case: Case) -> tuple[Callable[[], object], int]:
        batch = decode_batch(case, block_size, num_blocks, device, seed=case.batch)
        return functools.partial(runner.run, *batch), kv_bytes_read(config, case.batch, case.context)

    return case_step


def graph_replay(step: Callable[[], object]) -> Callable[[], None]:
    """The replay of a CUDA graph of `step`, captured after three calls on a side stream
    (Triton compiles, autotunes and allocates there), as bench/common.py's graph helpers do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def gpt_oss_case_steps(cases: list[Case], block_size: int, max_model_len: int, device: torch.device) -> CaseStep:
    """gpt-oss-20b as bench/moe.py's decode part runs it: random bf16 weights, and per case
    `moe.decode_inputs` (each sequence CONTEXT tokens in the paired cache, the new one at
    position CONTEXT) with the whole step captured into a graph of its own."""
    from moe import MODELS as MOE_SHAPES
    from moe import decode_inputs, decode_model_config, random_model

    if max(case.context for case in cases) >= max_model_len:
        raise SystemExit("gpt-oss-20b decodes token CONTEXT + 1: --max-model-len must exceed every case's context")
    config = decode_model_config(MOE_SHAPES["gpt-oss-20b"], max_model_len)
    model = random_model(config, torch.bfloat16, device)
    generator = torch.Generator(device=device).manual_seed(1)

    def case_step(case: Case) -> tuple[Callable[[], object], int]:
        kv_cache, metadata, input_ids, positions = decode_inputs(config, case.batch, case.context, block_size,
                                                                 torch.bfloat16, device, generator)

        def step() -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

        return graph_replay(step), kv_bytes_read(config, case.batch, case.context + 1)

    return case_step


def case_steps(name: str, cases: list[Case], block_size: int, max_model_len: int, device: torch.device) -> CaseStep:
    """`--model`'s case steps: gpt-oss-20b's (`gpt_oss_case_steps`) or a graph runner's."""
    if name == "gpt-oss-20b":
        return gpt_oss_case_steps(cases, block_size, max_model_len, device)
    return runner_case_steps(name, cases, block_size, max_model_len, device)


def critical_path(events) -> dict[str, float]:
    """{kernel name: microseconds it extends the timeline} for device events; gaps under IDLE."""
    charged: collections.Counter[str] = collections.Counter()
    covered_until = None
    for start, end, name in sorted(events):
        if covered_until is not None and start > covered_until:
            charged[IDLE] += start - covered_until
            charged[f"{IDLE} before {name}"] += start - covered_until
        begin = start if covered_until is None else max(start, covered_until)
        charged[name] += max(0.0, end - begin)
        covered_until = end if covered_until is None else max(covered_until, end)
    return charged


def label_roles(spans: list[tuple[float, float, str]], roles: dict[str, list[str]],
                steps: int) -> list[tuple[float, float, str]]:
    """`spans` (start, end, kernel name) of `steps` calls with each kernel named in `roles`
    renamed by its place in its call: its k-th launch of a call becomes `name[role]` for
    role `roles[name][k % len]`, and the launches after the last whole round of roles
    `name[rest]` (the 65 register GEMVs of a 16-layer Llama step: qkv, o, gate_up, down 16
    times, then lm_head). The launches of a kernel must be the same in every call."""
    launches = collections.Counter(name for _, _, name in spans)
    seen: collections.Counter[str] = collections.Counter()
    labelled = []
    for start, end, name in sorted(spans):
        names = roles.get(name)
        if names:
            per_call, remainder = divmod(launches[name], steps)
            if remainder:
                raise ValueError(f"{name}: {launches[name]} launches in {steps} calls")
            place = seen[name] % per_call
            seen[name] += 1
            whole = per_call - per_call % len(names)
            name = f"{name}[{names[place % len(names)] if place < whole else 'rest'}]"
        labelled.append((start, end, name))
    return labelled


def parse_roles(text: str) -> dict[str, list[str]]:
    """`--roles`' "NAME=ROLE,ROLE;NAME=..." as {kernel name: roles}."""
    roles = {}
    for item in filter(None, text.split(";")):
        name, _, listed = item.partition("=")
        if not name or not listed:
            raise argparse.ArgumentTypeError(f"--roles takes NAME=ROLE,ROLE,...; got {item!r}")
        roles[name.strip()] = [role.strip() for role in listed.split(",")]
    return roles


def kernel_table(fn, steps: int, roles: dict[str, list[str]] | None = None) -> tuple[
        dict[str, tuple[float, float, float]], float]:
    """{kernel name: (launches per step, device us per step, critical-path us per step)} over
    `steps` calls, and the summed device time per step; kernels named in `roles` are split
    by their place in the step (`label_roles`)."""
    from step_profile import profiled_calls
    from torch.profiler import ProfilerActivity

    prof = profiled_calls(fn, steps, [ProfilerActivity.CUDA])
    counts: collections.Counter[str] = collections.Counter()
    times: collections.Counter[str] = collections.Counter()
    spans = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name if len(event.name) <= 70 else event.name[:67] + "..."
        spans.append((event.time_range.start, event.time_range.end, name))
    spans = label_roles(spans, roles or {}, steps)
    for start, end, name in spans:
        counts[name] += 1
        times[name] += end - start
    # the host's time between one replay and the next counts as idle too
    critical = critical_path(spans)
    table = {name: (counts[name] / steps, times[name] / steps, critical[name] / steps) for name in times}
    for name, idle_us in critical.items():
        if name.startswith(IDLE):
            table[name] = (0.0, 0.0, idle_us / steps)
    return table, sum(times.values()) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x1024,64x1024,32x32768", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=16, help="kernels listed per case")
    parser.add_argument("--model", choices=MODELS, default="llama-1b")
    parser.add_argument("--roles", type=parse_roles, default={},
                        help='split kernels by their place in the step: "_gemv_kernel=qkv,o,gate_up,down" (Llama at '
                             'batch 1; launches past the last whole round are "rest"), several joined by ";"')
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    cases = [Case(*map(int, item.split("x"))) for item in args.cases.split(",")]
    case_step = case_steps(args.model, cases, args.block_size, args.max_model_len, device)
    rows, summary = [], {"model": f"{MODELS[args.model]} shape, random bf16 weights", "max_model_len": args.max_model_len}
    if args.roles:
        summary["roles"] = {name: ",".join(roles) for name, roles in args.roles.items()}
    with torch.inference_mode():
        for case in cases:
            replay, kv_bytes = case_step(case)
            ms = step_ms(replay, warmup=5, iters=30)
            table, kernel_us = kernel_table(replay, args.steps, args.roles)
            label = f"b{case.batch}/ctx{case.context}"
            summary[label] = {
                "step_us": round(ms * 1e3, 1),
                "kernel_us": round(kernel_us, 1),
                "kernels_per_step": round(sum(n for n, _, _ in table.values()), 1),
                "kv_gb": round(kv_bytes / 1e9, 3),
            }
            print(label, summary[label], flush=True)
            ranked = sorted(table.items(), key=lambda item: -item[1][2])[: args.top]
            for name, (per_step, us, critical_us) in ranked:
                rows.append(
                    {
                        "case": label,
                        "kernel": name,
                        "per_step": round(per_step, 1),
                        "us_per_step": round(us, 1),
                        "critical_us": round(critical_us, 1),
                        "pct_of_step": round(100 * us / (ms * 1e3), 1),
                    }
                )
            print(format_table([r for r in rows if r["case"] == label], COLUMNS), flush=True)
    if args.out:
        write_results(args.out, run_name("decode_profile"), rows, COLUMNS, summary)


if __name__ == "__main__":
    main()
