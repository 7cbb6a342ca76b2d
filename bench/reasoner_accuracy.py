"""Accuracy of a reasoner checkpoint on held-out addition problems, by decoding method.

The model card's sampling table (`libs/cleave/assets/reasoner/MODEL_CARD.md`): for each
temperature, greedy accuracy, one sample's accuracy (the mean over `--votes` samples), the
majority vote of the samples and the best sample by `step_consistency(text, question)` (a
verifier that never sees the answer). Generation runs in transformers on one CPU thread with
`scripts/train_reasoner.py`'s `evaluate` (torch reseeded per temperature), so the numbers
repeat exactly on the same library versions.

    python bench/reasoner_accuracy.py --out bench/results/reasoner   # the card's table, ~2 min
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = BENCH.parent / "scripts"
COLUMNS = ["decoding", "temperature", "accuracy_3dp"]  # the tables print floats to 1 decimal


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the shipped reasoner)")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems, `heldout_problems(N, seed=0)`")
    parser.add_argument("--votes", type=int, default=8, help="samples per problem and temperature")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.8, 1.0])
    parser.add_argument("--out", default=None, help="directory for reasoner_accuracy-<UTC time>.json / .md")
    return parser.parse_args(argv)


def table_rows(evaluations: list[dict], votes: int) -> list[dict]:
    """One row per (decoding method, temperature); greedy once, it ignores the temperature."""
    rows = [{"decoding": "greedy", "temperature": None, "accuracy": evaluations[0]["greedy_accuracy"]}]
    for evaluation in evaluations:
        for decoding, key in (("one sample", "sampled_accuracy"),
                              (f"majority vote of {votes}", f"majority_at_{votes}_accuracy"),
                              (f"best of {votes} by step_consistency", f"best_of_{votes}_step_consistency_accuracy")):
            rows.append({"decoding": decoding, "temperature": evaluation["temperature"], "accuracy": evaluation[key]})
    return [{**row, "accuracy_3dp": f"{row['accuracy']:.3f}"} for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.extend(str(path) for path in (SCRIPTS, BENCH) if str(path) not in sys.path)
    import torch
    from common import format_table, run_name, write_results
    from train_reasoner import evaluate, versions
    from transformers import AutoTokenizer, LlamaForCausalLM

    from cleave.engine.llm import default_model_path

    model_dir = args.model or default_model_path()
    if model_dir is None:
        raise SystemExit("no model: pass --model or ship cleave/assets/reasoner")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    started = time.perf_counter()
    evaluations = [evaluate(model, tokenizer, args.problems, temperature, args.votes)
                   for temperature in args.temperatures]
    for evaluation in evaluations:
        if evaluation["greedy_accuracy"] != evaluations[0]["greedy_accuracy"]:
            raise RuntimeError("greedy decoding changed between temperatures: generation is not deterministic")
    rows = table_rows(evaluations, args.votes)
    summary = {
        "model": str(args.model) if args.model else "shipped reasoner (cleave/assets/reasoner)",
        "problems": args.problems, "votes": args.votes, "threads": 1,
        "seconds": round(time.perf_counter() - started, 1), **versions(),
    }
    print(format_table(rows, COLUMNS), flush=True)
    if args.out:
        for path in write_results(args.out, run_name("reasoner_accuracy"), rows, COLUMNS, summary):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
