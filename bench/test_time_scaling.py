"""Test-time scaling on the shipped reasoner: accuracy against the number of samples.

For each held-out arithmetic problem, 32 samples are drawn once (one request with n=32, so
they share the prompt's KV); every sample count k in (1, 2, 4, 8, 16, 32) is then evaluated
on several random k-subsets of them:
- majority vote over normalized final answers (`cleave.scaling.majority_vote`);
- best-of-N by mean token logprob (verifier-free);
- best-of-N by scratchpad step consistency (a verifier that does not know the answer);
- oracle best-of-N with the MathVerifier against the true answer, i.e. pass@k (the exact
  unbiased estimator over all 32 samples, an upper bound for any selector).
Tokens spent per problem = prompt tokens once (shared KV) + completion tokens of the k samples.
The k=32 majority vote also goes through `run_scaling`, the gateway's code path.

    python bench/test_time_scaling.py --problems 100 --device cpu   # results/test_time_scaling-<UTC time>.*
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SAMPLE_COUNTS = (1, 2, 4, 8, 16, 32)
METHODS = ("majority_vote", "best_of_n_logprob", "best_of_n_step_consistency", "oracle_pass_at_k")


@dataclass(frozen=True)
class Sample:
    """One generated sample, reduced to what the evaluation needs."""

    answer: str | None
    correct: bool
    num_tokens: int
    mean_logprob: float
    step_consistency: float
    finished: bool


@dataclass(frozen=True)
class ProblemSamples:
    """All samples of one problem."""

    question: str
    answer: str
    prompt_tokens: int
    samples: list[Sample]


def full_text(output) -> str:
    """The completion with its think block restored (the engine splits reasoning out)."""
    from cleave.tasks.arithmetic import THINK_END, THINK_START

    if output.reasoning_text:
        closed = THINK_END if output.text or output.finish_reason.value == "stop" else ""
        return f"{THINK_START}{output.reasoning_text}{closed}{output.text}"
    return output.text


def draw_samples(args: argparse.Namespace) -> tuple[list[ProblemSamples], dict]:
    from cleave.engine.llm import LLM, default_model_path
    from cleave.generation.sampling_params import SamplingParams
    from cleave.scaling import MathVerifier, extract_final_answer, normalize_answer
    from cleave.tasks.arithmetic import format_prompt, heldout_problems, step_consistency

    model = args.model or default_model_path()
    if model is None:
        raise SystemExit("no model: pass --model or ship cleave/assets/reasoner")
    llm = LLM(model, device=args.device, dtype=args.dtype, seed=args.seed)
    problems = heldout_problems(args.problems, seed=args.seed)
    params = SamplingParams(
        n=args.samples,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        logprobs=0,
        skip_special_tokens=False,
        seed=args.seed,
    )
    results: list[ProblemSamples] = []
    started = time.perf_counter()
    completion_tokens = 0
    for first in range(0, len(problems), args.batch):
        batch = problems[first : first + args.batch]
        prompts = [[{"role": "user", "content": format_prompt(problem)}] for problem in batch]
        for problem, request_output in zip(batch, llm.generate(prompts, params)):
            verifier = MathVerifier(problem.answer, use_sympy=False)
            samples = []
            for output in sorted(request_output.outputs, key=lambda o: o.index):
                text = full_text(output)
                answer = normalize_answer(extract_final_answer(text))
                num_tokens = max(1, output.num_tokens)
                samples.append(
                    Sample(
                        answer=answer,
                        correct=verifier.answers_equal(answer),
                        num_tokens=output.num_tokens,
                        mean_logprob=(output.cumulative_logprob or 0.0) / num_tokens,
                        step_consistency=step_consistency(text),
                        finished=output.finish_reason is not None and output.finish_reason.value == "stop",
                    )
                )
            completion_tokens += request_output.usage.completion_tokens
            results.append(ProblemSamples(problem.question, problem.answer, len(request_output.prompt_token_ids), samples))
        elapsed = time.perf_counter() - started
        print(f"{len(results)}/{len(problems)} problems, {elapsed:.0f}s, {completion_tokens / elapsed:.0f} tok/s", file=sys.stderr)
    timing = {"generation_s": time.perf_counter() - started, "completion_tokens": completion_tokens}
    timing["completion_tokens_per_s"] = completion_tokens / timing["generation_s"]
    return results, timing


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k: the chance that k of the n samples include a correct one."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(problems: list[ProblemSamples], num_subsets: int, seed: int) -> list[dict]:
    """One row per k: mean accuracy of each method and the tokens it spends per problem."""
    from cleave.scaling import best_of_n, majority_vote

    rng = random.Random(seed)
    rows = []
    for k in SAMPLE_COUNTS:
        totals = {method: 0.0 for method in METHODS}
        tokens = 0.0
        for problem in problems:
            samples = problem.samples
            if k > len(samples):
                raise SystemExit(f"k={k} needs at least {k} samples per problem")
            for _ in range(num_subsets):
                subset = [samples[i] for i in rng.sample(range(len(samples)), k)]
                winner, _ = majority_vote([sample.answer for sample in subset])
                totals["majority_vote"] += winner is not None and winner == problem.answer
                by_logprob = best_of_n(subset, [sample.mean_logprob for sample in subset])
                totals["best_of_n_logprob"] += subset[by_logprob].correct
                by_steps = best_of_n(subset, [sample.step_consistency for sample in subset])
                totals["best_of_n_step_consistency"] += subset[by_steps].correct
                tokens += problem.prompt_tokens + sum(sample.num_tokens for sample in subset)
            num_correct = sum(sample.correct for sample in samples)
            totals["oracle_pass_at_k"] += pass_at_k(len(samples), num_correct, k) * num_subsets
        count = len(problems) * num_subsets
        rows.append({"k": k, **{method: totals[method] / count for method in METHODS}, "tokens_per_problem": tokens / count})
    return rows


def runner_majority_at_full_group(problems: list[ProblemSamples]) -> float:
    """Accuracy of `run_scaling` majority vote over each problem's full sample group."""
    from cleave.scaling import Candidate, ScalingRequest, Strategy, run_scaling

    async def one(problem: ProblemSamples) -> bool:
        # Answers are already extracted; hand them over as "The answer is X." texts.
        candidates = [Candidate(f"The answer is {s.answer}." if s.answer else "", i) for i, s in enumerate(problem.samples)]
        result = await run_scaling(lambda n: candidates, ScalingRequest(), Strategy.MAJORITY_VOTE, len(candidates))
        return result.answer == problem.answer

    async def run_all() -> list[bool]:
        return [await one(problem) for problem in problems]

    return statistics.mean(asyncio.run(run_all()))


def problem_columns(problem: ProblemSamples) -> dict:
    """A problem with its samples stored column by column (one list per Sample field)."""
    columns = {name: [getattr(sample, name) for sample in problem.samples] for name in Sample.__dataclass_fields__}
    return {**{key: value for key, value in asdict(problem).items() if key != "samples"}, "samples": columns}


def write_outputs(out: Path, rows: list[dict], summary: dict, problems: list[ProblemSamples]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {**summary, "rows": rows, "problems": [problem_columns(problem) for problem in problems]}
    out.with_suffix(".json").write_text(json.dumps(payload, separators=(",", ":")) + "\n")

    header = "| k | majority vote | best-of-N (logprob) | best-of-N (step consistency) | oracle pass@k | tokens / problem |"
    lines = [header, "|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['k']} | {row['majority_vote']:.3f} | {row['best_of_n_logprob']:.3f} | "
            f"{row['best_of_n_step_consistency']:.3f} | {row['oracle_pass_at_k']:.3f} | {row['tokens_per_problem']:.0f} |"
        )
    notes = [
        f"# Test-time scaling: shipped reasoner, {summary['num_problems']} held-out arithmetic problems",
        "",
        f"Command: `{summary['command']}`  ",
        f"Machine: {summary['device']}; {summary['timing']['completion_tokens']} completion tokens in "
        f"{summary['timing']['generation_s']:.0f}s ({summary['timing']['completion_tokens_per_s']:.0f} tok/s).  ",
        f"Samples: n={summary['samples']} per problem, temperature {summary['temperature']}, max_tokens "
        f"{summary['max_tokens']}; each k is scored on {summary['subsets']} random k-subsets per problem.  ",
        f"Single-sample accuracy (mean over all samples): {summary['single_sample_accuracy']:.3f}; "
        f"samples that finished: {summary['finished_fraction']:.3f}.  ",
        f"Majority vote over all {summary['samples']} samples through `run_scaling`: "
        f"{summary['runner_majority_full_group']:.3f}.  ",
        "Oracle pass@k picks a correct sample whenever one exists (MathVerifier against the true answer); "
        "it is an upper bound, not a deployable selector.",
        "",
        *lines,
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(notes))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    labels = {
        "majority_vote": "majority vote",
        "best_of_n_logprob": "best-of-N, mean logprob",
        "best_of_n_step_consistency": "best-of-N, step consistency",
        "oracle_pass_at_k": "oracle pass@k (upper bound)",
    }
    ks = [row["k"] for row in rows]
    for method, label in labels.items():
        axis.plot(ks, [row[method] for row in rows], marker="o", label=label, linestyle="--" if "oracle" in method else "-")
    axis.set_xscale("log", base=2)
    axis.set_xticks(ks, [str(k) for k in ks])
    axis.set_xlabel("samples per problem (k)")
    axis.set_ylabel("accuracy")
    axis.set_title(f"Shipped reasoner, {summary['num_problems']} held-out problems, T={summary['temperature']}")
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--samples", type=int, default=32, help="samples drawn per problem (the largest k)")
    parser.add_argument("--subsets", type=int, default=16, help="random k-subsets scored per problem and k")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=2, help="problems per generate call")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped reasoner)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "test_time_scaling",
                        help="path stem; the run writes STEM-<UTC time>.json / .md / .png")
    args = parser.parse_args()

    problems, timing = draw_samples(args)
    rows = evaluate(problems, args.subsets, args.seed)
    all_samples = [sample for problem in problems for sample in problem.samples]
    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    summary = {
        "command": "python " + " ".join(shlex.quote(arg) for arg in sys.argv),
        "device": device,
        "num_problems": len(problems),
        "samples": args.samples,
        "subsets": args.subsets,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "single_sample_accuracy": statistics.mean(sample.correct for sample in all_samples),
        "finished_fraction": statistics.mean(sample.finished for sample in all_samples),
        "runner_majority_full_group": runner_majority_at_full_group(problems),
        "timing": timing,
    }
    from common import run_path

    out = run_path(args.out.with_suffix(""))
    write_outputs(out, rows, summary, problems)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
