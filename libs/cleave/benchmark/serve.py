"""`cleave bench serve` end to end: one run at a rate, or a sweep of rates.

    served_models -> tokenizer (--tokenizer, else the served checkpoint's when it is a local
    directory, else words) -> requests -> check_endpoint (one short request) ->
    per rate: arrival offsets -> run_load -> summarize -> text, JSON, PNG
    sweep: a goodput-vs-load table (markdown + JSON) and plot

The summary goes to stdout, notes and progress to stderr. A run's JSON holds `command`
(as typed), `settings` (every option), `date` (UTC), `endpoint`, `config`, `probe_requests`
(sent by the endpoint check before the run: a server counts them, the records do not),
`request_rate`, `summary` and one entry per request in `records`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from cleave.benchmark.arrivals import arrival_offsets
from cleave.benchmark.client import EndpointSpec, OpenAIClient, check_endpoint
from cleave.benchmark.load import LoadSpec, RunResult, run_load
from cleave.benchmark.plot import plot_run, plot_sweep, plotting_available
from cleave.benchmark.progress import Progress
from cleave.benchmark.report import format_summary, markdown_table, sweep_rows, write_new_json
from cleave.benchmark.stats import SLO, Summary, summarize
from cleave.benchmark.workload import BenchRequest, jsonl_requests, load_tokenizer, random_requests

RESULT_PREFIX = "bench-serve"
EXIT_OK = 0
EXIT_NOTHING_COMPLETED = 1


@dataclass(frozen=True)
class RandomWorkload:
    """Random prompts of about `input_len` tokens asking `output_len` tokens (+-range_ratio)."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0


@dataclass(frozen=True)
class JsonlWorkload:
    """Prompts from a JSONL file; lines without `output_len` ask `default_output_len`."""

    path: Path
    default_output_len: int = 128


@dataclass(frozen=True)
class ServeBenchConfig:
    """One invocation of `cleave bench serve`.

    request_rates holds one rate for a single run, several for a sweep (math.inf: all at once).
    """

    endpoint: EndpointSpec
    workload: RandomWorkload | JsonlWorkload
    num_prompts: int = 100
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slo: SLO = SLO()
    tokenizer: str | None = None
    result_dir: Path = Path(".")
    plot: bool = True
    command: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # every CLI option, for the result file

    @property
    def is_sweep(self) -> bool:
        return len(self.request_rates) > 1


@dataclass
class Output:
    """Where the summary (out) and notes and progress (err) go."""

    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)

    def note(self, text: str) -> None:
        print(f"note: {text}", file=self.err, flush=True)


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _tokenizer_source(config: ServeBenchConfig, models: list[tuple[str, str | None]], model: str | None) -> str | None:
    if config.tokenizer is not None:
        return config.tokenizer
    for model_id, root in models:
        if (model is None or model_id == model) and root and (Path(root) / "tokenizer.json").is_file():
            return root
    return None


def build_requests(config: ServeBenchConfig, tokenizer_path: str | None) -> list[BenchRequest]:
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    workload = config.workload
    if isinstance(workload, JsonlWorkload):
        return jsonl_requests(workload.path, config.num_prompts, workload.default_output_len, tokenizer)
    return random_requests(config.num_prompts, workload.input_len, workload.output_len, workload.range_ratio,
                           config.seed, tokenizer)


async def run_serve_bench(config: ServeBenchConfig, output: Output | None = None) -> int:
    """Run the benchmark; returns the exit code (1 when a run completed no request).

    Raises:
        EndpointError: the server cannot be benchmarked (unreachable, wrong route, not
            OpenAI-compatible, credentials refused).
        WorkloadError: the dataset or tokenizer cannot be used.
    """
    output = output or Output()
    max_connections = config.max_concurrency or 0
    async with OpenAIClient(config.endpoint, max_connections) as client:
        models = await client.served_models()
        if client.spec.model is None and models:
            client.spec = replace(client.spec, model=models[0][0])
        tokenizer_path = _tokenizer_source(config, models, client.spec.model)
        requests = build_requests(config, tokenizer_path)
        output.note(f"prompts from the tokenizer in {tokenizer_path}" if tokenizer_path else
                    "prompts from words (about one token each; pass --tokenizer for exact lengths)")
        check = await check_endpoint(client, requests[0])
        if check.note:
            output.note(check.note)
        if config.plot and not plotting_available():
            output.note("matplotlib is not installed, so no plot is drawn (pip install matplotlib)")
        context = {**_context(config, client.spec, tokenizer_path), "probe_requests": check.requests_sent}
        summaries = []
        for rate in config.request_rates:
            summary = await _one_rate(client, requests, rate, config, context, output)
            summaries.append(summary)
    if config.is_sweep:
        _write_sweep(config, summaries, context, output)
    return EXIT_OK if all(summary.completed for summary in summaries) else EXIT_NOTHING_COMPLETED


def _context(config: ServeBenchConfig, spec: EndpointSpec, tokenizer_path: str | None) -> dict[str, Any]:
    workload = asdict(config.workload)
    workload["kind"] = "jsonl" if isinstance(config.workload, JsonlWorkload) else "random"
    return {
        "command": config.command,
        "settings": config.settings,
        "endpoint": {"base_url": spec.base_url, "endpoint": spec.endpoint, "url": spec.url, "model": spec.model,
                     "ignore_eos": spec.ignore_eos, "temperature": spec.temperature},
        "config": {"num_prompts": config.num_prompts, "burstiness": config.burstiness,
                   "max_concurrency": config.max_concurrency, "seed": config.seed, "workload": workload,
                   "tokenizer": tokenizer_path, "slo": asdict(config.slo)},
    }


async def _one_rate(client: OpenAIClient, requests: list[BenchRequest], rate: float, config: ServeBenchConfig,
                    context: dict[str, Any], output: Output) -> Summary:
    offsets = arrival_offsets(len(requests), rate, config.burstiness, config.seed)
    label = f"rate {rate:g}:" if config.is_sweep else ""
    progress = Progress(len(requests), label, output.err)
    try:
        result: RunResult = await run_load(client, requests, LoadSpec(offsets, config.max_concurrency), progress.done)
    finally:
        progress.close()
    summary = summarize(result.records, result.duration_s, config.slo)
    title = f"{client.spec.model or client.spec.base_url} {client.spec.endpoint}, rate {rate:g} req/s"
    print(format_summary(summary, title=f"Serving benchmark, rate {rate:g} req/s"), file=output.out)
    when = datetime.now(timezone.utc)
    payload = {**context, "date": when.isoformat(timespec="seconds"), "request_rate": _rate_json(rate),
               "summary": summary.to_json(), "records": [record.to_json() for record in result.records]}
    path = write_new_json(config.result_dir, RESULT_PREFIX, when, payload)
    written = [path]
    if config.plot and plotting_available():
        written.append(plot_run(result.records, summary, path.with_suffix(".png"), title))
    print("results: " + ", ".join(str(p) for p in written), file=output.out, flush=True)
    return summary


def _write_sweep(config: ServeBenchConfig, summaries: list[Summary], context: dict[str, Any], output: Output) -> None:
    rates = list(config.request_rates)
    table = markdown_table(sweep_rows(rates, summaries))
    print(f"\nGoodput vs load ({config.num_prompts} requests per rate)\n{table}", file=output.out)
    when = datetime.now(timezone.utc)
    payload = {**context, "date": when.isoformat(timespec="seconds"), "request_rates": [_rate_json(r) for r in rates],
               "runs": [{"request_rate": _rate_json(r), "summary": s.to_json()} for r, s in zip(rates, summaries)]}
    path = write_new_json(config.result_dir, f"{RESULT_PREFIX}-sweep", when, payload)
    markdown = path.with_suffix(".md")
    markdown.write_text(f"`{config.command}`\n\n{table}\n", encoding="utf-8")
    written = [path, markdown]
    if config.plot and plotting_available():
        finite = [(r, s) for r, s in zip(rates, summaries) if not math.isinf(r)]
        if finite:
            written.append(plot_sweep([r for r, _ in finite], [s for _, s in finite], path.with_suffix(".png"),
                                      f"{context['endpoint']['model'] or context['endpoint']['base_url']}: goodput vs load"))
    print("sweep results: " + ", ".join(str(p) for p in written), file=output.out, flush=True)
