"""Structured-output host costs on a serving-size vocabulary: compiling a grammar, and one
step's mask of one constrained row.

A worker compiles each request's grammar (`cleave.engine.grammar.GrammarCompiler`, xgrammar
underneath) before the request runs, and fills every constrained row's bitmask on the engine
thread each step. Both scale with the vocabulary, which the tiny test models keep at 512
tokens, so this builds a byte-level BPE vocabulary of `--vocab` random tokens (the
tokenizer kind of Llama 3 and Qwen: 128k / 152k) and times, per structured-output kind, the
first compile of a spec, a compile of the same spec again (xgrammar's cache), and
`fill_bitmask` over a walk of `--steps` tokens the grammar allows.

    python bench/grammar_compile.py --out bench/results/grammar
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402

COLUMNS = ["kind", "vocab", "first_compile_ms", "cached_compile_ms", "mask_us_median", "mask_us_max", "steps"]
EOS = "<|eos|>"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items":
        {"type": "string"}, "maxItems": 5}, "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}}, "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def byte_level_tokenizer(vocab_size: int, seed: int):  # noqa: ANN201
    """A cleave `Tokenizer` over a byte-level BPE vocabulary: every byte, then random 2-10
    byte tokens of printable ASCII (spaces as the byte-level alphabet writes them)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from cleave.model.tokenizer import Tokenizer

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    printable = ["\u0120" if code == 32 else chr(code) for code in range(32, 127)]  # byte-level space: U+0120
    rng = random.Random(seed)
    vocab = {EOS: 0}
    for char in byte_chars:
        vocab.setdefault(char, len(vocab))
    while len(vocab) < vocab_size:
        vocab.setdefault("".join(rng.choice(printable) for _ in range(rng.randint(2, 10))), len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS])
    return Tokenizer(backend, {"eos_token": EOS})


def specs():  # noqa: ANN201
    from cleave.generation.structured_output import StructuredKind, StructuredOutput

    return {
        "json_schema": StructuredOutput.json_schema(SCHEMA),
        "json_object": StructuredOutput(StructuredKind.JSON_OBJECT),
        "regex": StructuredOutput(StructuredKind.REGEX, spec=r"[a-z]{3,20}@[a-z]{2,10}\.(com|org|net)"),
        "choice": StructuredOutput(StructuredKind.CHOICE, choices=("positive", "negative", "neutral")),
        "grammar": StructuredOutput(StructuredKind.GRAMMAR, spec='root ::= "(" num (" + " num)* ")"\nnum ::= [0-9]+'),
    }


def mask_walk_us(compiler, compiled, steps: int, seed: int) -> list[float]:  # noqa: ANN001
    """Microseconds of each `fill_bitmask` call along a walk of allowed tokens."""
    from cleave.kernels.token_bitmask import bitmask_words

    constraint = compiler.constraint(compiled)
    bitmask = torch.full((1, bitmask_words(compiler.vocab_size)), -1, dtype=torch.int32)
    rng = random.Random(seed)
    tokens: list[int] = []
    times = []
    for _ in range(steps):
        bitmask.fill_(-1)
        start = time.perf_counter()
        constrained = constraint.fill_bitmask(tokens, bitmask, 0)
        times.append((time.perf_counter() - start) * 1e6)
        if constraint.is_terminated:
            break
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: compiler.vocab_size].nonzero().flatten().tolist() if constrained else [0]
        tokens.append(rng.choice(allowed))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=64, help="tokens walked per kind for the mask timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from cleave.engine.grammar import GrammarCompiler
    from cleave.generation.structured_output import StructuredKind, StructuredOutput

    tokenizer = byte_level_tokenizer(args.vocab, args.seed)
    compiler = GrammarCompiler(tokenizer, args.vocab, [0])
    start = time.perf_counter()
    # the first compile builds the vocabulary's tables once (start-up, not per request)
    compiler.compile(StructuredOutput(StructuredKind.GRAMMAR, spec='root ::= "x"'))
    summary = {"tokenizer_info_ms": round((time.perf_counter() - start) * 1e3, 1), "threads": 1}
    rows = []
    for kind, spec in specs().items():
        start = time.perf_counter()
        compiled = compiler.compile(spec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec)
        again = time.perf_counter() - start
        times = mask_walk_us(compiler, compiled, args.steps, args.seed)
        rows.append({"kind": kind, "vocab": args.vocab, "first_compile_ms": round(first * 1e3, 2),
                     "cached_compile_ms": round(again * 1e3, 2), "mask_us_median": round(statistics.median(times), 1),
                     "mask_us_max": round(max(times), 1), "steps": len(times)})
        print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(json.dumps(summary))
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("grammar-compile"), rows, COLUMNS, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
