"""Greedy accuracy of the shipped reasoner under a thinking budget, through the cleave engine.

The model card's budget table (`libs/cleave/assets/reasoner/MODEL_CARD.md`). For each
`max_thinking_tokens` the engine cuts the think block after that many thinking tokens and
forces `</think>` and the answer prefix; the row counts the held-out problems
(`heldout_problems(N, seed=0)`) answered correctly and the answers that are exactly
` The answer is N.`. Greedy on one CPU thread, so the numbers repeat exactly.

    python bench/thinking_budget.py --out bench/results/reasoner   # the card's table, ~5 min
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent

COLUMNS = ["max_thinking_tokens", "accuracy_3dp", "well_formed", "problems", "mean_reasoning_tokens"]
ANSWER_RE = re.compile(r" The answer is \d+\.")


def budget(text: str) -> int | None:
    return None if text == "none" else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the shipped reasoner)")
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--budgets", type=budget, nargs="+", default=[0, 20, 40, 60, 80, 100, None],
                        help="max_thinking_tokens values; `none` for no budget")
    parser.add_argument("--max-tokens", type=int, default=160, help="room for the longest full scratchpad")
    parser.add_argument("--out", default=None, help="directory for thinking_budget-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from cleave.engine.llm import LLM, default_model_path
    from cleave.generation.sampling_params import SamplingParams
    from cleave.tasks import arithmetic

    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    from common import format_table, run_name, write_results

    model_dir = args.model or default_model_path()
    if model_dir is None:
        raise SystemExit("no model: pass --model or ship cleave/assets/reasoner")
    torch.set_num_threads(1)
    llm = LLM(model_dir, device="cpu", dtype="float32")
    problems = arithmetic.heldout_problems(args.problems, seed=0)
    prompts = [[{"role": "user", "content": arithmetic.format_prompt(problem)}] for problem in problems]
    rows = []
    started = time.perf_counter()
    for max_thinking_tokens in args.budgets:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, max_thinking_tokens=max_thinking_tokens)
        outputs = [request_output.outputs[0] for request_output in llm.generate(prompts, params)]
        correct = sum(arithmetic.is_correct(output.text, p.answer) for output, p in zip(outputs, problems))
        rows.append({
            "max_thinking_tokens": "none" if max_thinking_tokens is None else max_thinking_tokens,
            "accuracy": correct / len(problems),
            "accuracy_3dp": f"{correct / len(problems):.3f}",
            "well_formed": sum(ANSWER_RE.fullmatch(output.text) is not None for output in outputs),
            "problems": len(problems),
            "mean_reasoning_tokens": statistics.mean(output.num_reasoning_tokens for output in outputs),
        })
        print(format_table(rows[-1:], COLUMNS), flush=True)
    summary = {
        "model": str(args.model) if args.model else "shipped reasoner (cleave/assets/reasoner)",
        "max_tokens": args.max_tokens, "threads": 1, "seconds": round(time.perf_counter() - started, 1),
    }
    print(format_table(rows, COLUMNS))
    if args.out:
        for path in write_results(args.out, run_name("thinking_budget"), rows, COLUMNS, summary):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
