"""`cleave generate [--model DIR] PROMPT`: generate in-process and print the samples.

Without `--model` it uses the reasoning model shipped in `cleave/assets/reasoner`. With
`--json` every sample is one JSON line: text, token_ids (generated only), reasoning,
finish_reason.
"""

from __future__ import annotations

import argparse
import json
import sys

from cleave.engine.config import KV_CACHE_DTYPES

# Measured with bench/cli_generate.py on a 2-core machine (bench/results/cli/): with one
# thread the whole command took 4.1 s (median), with torch's default of one per core 10.0 s,
# and 2.5x the CPU time: the shipped reasoner's ops are too small to split, and two threads
# that wait on each other every op lose most when other processes share the cores.
DEFAULT_CPU_THREADS = 1


def run(args: argparse.Namespace) -> int:
    # torch and the engine load here, not at import: every `cleave` command imports this module
    from cleave.cli._device import DeviceUnavailable, check_device
    from cleave.cli._model import ModelNotFound, model_dir

    try:
        model = model_dir(args.model)
        if args.device is not None:
            check_device(args.device)
    except (ModelNotFound, DeviceUnavailable) as error:  # before the engine loads: one line, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    from cleave.model.config import ModelConfig

    try:  # a config.json its architecture cannot read (a field missing): one line too
        ModelConfig.from_pretrained(model)
    except ValueError as error:
        print(f"error: --model {args.model or model}: {error}", file=sys.stderr)
        return 2
    import torch

    from cleave.engine.llm import LLM
    from cleave.generation.sampling_params import SamplingParams
    from cleave.errors import CleaveError
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    engine_kwargs = {"seed": args.seed, "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                     "packed_experts": args.packed_experts, "kv_cache_dtype": args.kv_cache_dtype}
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, n=args.n
    )
    try:
        llm = LLM(model, **engine_kwargs)
        (output,) = llm.generate(args.prompt, params, raw=args.raw)
    except CleaveError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for sample in output.outputs:
        finish_reason = sample.finish_reason.value if sample.finish_reason is not None else None
        if args.json:
            record = {
                "index": sample.index,
                "text": sample.text,
                "token_ids": sample.token_ids,
                "reasoning": sample.reasoning_text,
                "finish_reason": finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
            continue
        if len(output.outputs) > 1:
            print(f"--- sample {sample.index} ({finish_reason})")
        if sample.reasoning_text:
            print(f"[reasoning] {sample.reasoning_text.strip()}")
        print(sample.text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text in-process with the engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument("prompt", help="prompt text (the chat template is applied unless --raw)")
    parser.add_argument("--model", default=None, help="checkpoint directory or Hugging Face Hub id ORG/NAME[@REVISION] "
                        "(default: the shipped reasoner)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per sample (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--n", type=int, default=1, help="samples of the prompt (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON object per sample")
    parser.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16 (default auto)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache element type: auto (the model's dtype) or fp8 (float8 e4m3, scale 1.0)")
    parser.add_argument("--packed-experts", action="store_true",
                        help="keep a checkpoint's MXFP4 experts (gpt-oss) packed in memory (default: dequantised)")
    parser.add_argument("--threads", type=int, default=DEFAULT_CPU_THREADS,
                        help=f"torch intra-op threads for CPU work (default {DEFAULT_CPU_THREADS}: a small model's "
                             "decode step is too short to split across cores; 0: torch's default, one per core)")
    parser.set_defaults(handler=run)
