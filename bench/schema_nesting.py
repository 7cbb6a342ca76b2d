"""What a JSON schema's nesting costs the grammar compiler: the time and peak memory of
compiling schemas of arrays (or objects) nested N deep, and of chains of N `$ref`s (each
definition only a reference to the next, the last a string), each in a process of its own,
beside the size bound's worst flat case. The gateway refuses schemas nested past
`MAX_SCHEMA_DEPTH` (`cleave.generation.structured_output`) and chains past `MAX_REF_CHAIN`
(`cleave.generation.schema_refs`) before they are compiled; this compiles them directly,
past the bounds, to show why they are there.

    python bench/schema_nesting.py --out bench/results/grammar
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402

COLUMNS = ["shape", "levels", "schema_chars", "compile_s", "peak_rss_mb", "result"]
REASONER = Path(__file__).resolve().parent.parent / "libs" / "cleave" / "assets" / "reasoner"


def schema(shape: str, levels: int) -> str:
    """`levels` arrays (or objects of one required property) around a string; `ref_chain`:
    that many `$ref`s in a row, d0 -> d1 -> ... -> a string; `flat`: that many properties side
    by side, one level deep."""
    if shape == "arrays":
        return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels
    if shape == "objects":
        return '{"type":"object","required":["a"],"properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels
    if shape == "ref_chain":
        defs = {f"d{index}": {"$ref": f"#/$defs/d{index + 1}"} for index in range(levels)}
        defs[f"d{levels}"] = {"type": "string"}
        return json.dumps({"$ref": "#/$defs/d0", "$defs": defs}, separators=(",", ":"))
    properties = {f"p{index}": {"type": "string"} for index in range(levels)}
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


def child(shape: str, levels: int) -> None:
    """Compile one schema (the process's only work) and print its row's measurements."""
    from cleave.engine.grammar import GrammarCompiler
    from cleave.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(REASONER)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    compiler.build_tables()
    text = schema(shape, levels)
    start = time.perf_counter()
    compiler._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)  # past the bound's check
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"schema_chars": len(text), "compile_s": round(seconds, 3), "peak_rss_mb": round(peak_mb)}))


def measure(shape: str, levels: int, timeout_s: float) -> dict:
    row = {"shape": shape, "levels": levels, "schema_chars": len(schema(shape, levels))}
    try:
        done = subprocess.run([sys.executable, __file__, "--child", shape, str(levels)], capture_output=True,
                              text=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        return {**row, "compile_s": None, "peak_rss_mb": None, "result": f"over {timeout_s:g} s"}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "result": "compiled"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arrays", default="16,64,250,500,1000", help="nesting depths of arrays")
    parser.add_argument("--objects", default="16,64,250,500", help="nesting depths of objects")
    parser.add_argument("--ref-chain", default="64,250,500,1000,2000", help="$refs in a row")
    parser.add_argument("--flat", default="2000", help="properties of one flat object (the size bound's worst)")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per compile")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "LEVELS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    rows = []
    for shape in ("arrays", "objects", "ref_chain", "flat"):
        for levels in (int(value) for value in getattr(args, shape).split(",") if value):
            rows.append(measure(shape, levels, args.timeout_s))
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("schema-nesting"), rows, COLUMNS,
                      {"tokenizer": "the shipped reasoner's", "compile_threads": 1})
    return 0


if __name__ == "__main__":
    sys.exit(main())
