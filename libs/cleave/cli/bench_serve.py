"""`cleave bench serve`: load an OpenAI-compatible server (cleave, vLLM, SGLang) and report
TTFT, TPOT, ITL, latency, throughput and SLO goodput.

Imports only argparse at start-up; aiohttp, the tokenizer and matplotlib load when it runs.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from cleave.cli._arg_types import positive_float, positive_int

EXIT_BAD_ENDPOINT = 2
EXIT_INTERRUPTED = 130


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(positive_float(part.strip()) for part in text.split(",") if part.strip())
    if not rates:
        raise argparse.ArgumentTypeError("needs at least one rate, e.g. 1,2,4,8")
    return rates


def command_line(argv: list[str]) -> str:
    """The command as typed, from `bench serve` on (however `cleave` itself was started),
    with the API key masked."""
    masked = []
    for index, word in enumerate(argv):
        if index and argv[index - 1] == "--api-key":
            word = "***"
        elif word.startswith("--api-key="):
            word = "--api-key=***"
        masked.append(word)
    for index in range(len(masked) - 1):
        if masked[index:index + 2] == ["bench", "serve"]:
            return shlex.join(["cleave", *masked[index:]])
    return shlex.join(masked)


def recorded_settings(args: argparse.Namespace) -> dict[str, object]:
    """Every option's value (defaults included) for the result file; the API key is masked."""
    settings = {key: value for key, value in vars(args).items() if key not in ("handler", "command", "benchmark")}
    if settings.get("api_key"):
        settings["api_key"] = "***"
    if isinstance(settings.get("request_rate"), float) and math.isinf(settings["request_rate"]):
        settings["request_rate"] = "inf"
    return settings


def run(args: argparse.Namespace) -> int:
    import asyncio

    from cleave.benchmark.client import EndpointError, EndpointSpec
    from cleave.benchmark.serve import JsonlWorkload, RandomWorkload, ServeBenchConfig, run_serve_bench
    from cleave.benchmark.stats import SLO
    from cleave.benchmark.workload import WorkloadError

    endpoint = EndpointSpec(base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                            ignore_eos=args.ignore_eos, temperature=args.temperature,
                            request_timeout_s=args.request_timeout, ca_file=args.ca_file)
    workload = (JsonlWorkload(Path(args.dataset_path), args.random_output_len) if args.dataset_path
                else RandomWorkload(args.random_input_len, args.random_output_len, args.random_range_ratio))
    config = ServeBenchConfig(
        endpoint=endpoint, workload=workload, num_prompts=args.num_prompts,
        request_rates=args.request_rates or (args.request_rate,), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        tokenizer=args.tokenizer, result_dir=Path(args.result_dir), plot=args.plot,
        command=command_line(sys.argv), settings=recorded_settings(args),
    )
    try:
        return asyncio.run(run_serve_bench(config))
    except (EndpointError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_ENDPOINT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser("serve", help="benchmark an OpenAI-compatible server",
                                   description=__doc__.split("\n\n")[0].replace("\n", " "))
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's scheme://host:port (default http://127.0.0.1:8000)")
    server.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions (default) or /v1/chat/completions")
    server.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--ca-file", default=None,
                        help="CA an https --base-url is checked against (a `cleave up --tls` stack's ca.pem; "
                             "default: the system's roots)")
    server.add_argument("--request-timeout", type=positive_float, default=600.0,
                        help="seconds one request may take before it counts as failed (default 600)")

    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--num-prompts", type=positive_int, default=100, help="requests per run (default 100)")
    prompts.add_argument("--dataset-path", default=None,
                         help="JSONL file of {\"prompt\": ..., \"output_len\": N (optional)}, repeated in order when "
                              "shorter than --num-prompts; default: random prompts")
    prompts.add_argument("--random-input-len", type=positive_int, default=1024, help="prompt tokens (default 1024)")
    prompts.add_argument("--random-output-len", type=positive_int, default=128,
                         help="output tokens per request, also for JSONL lines without output_len (default 128)")
    prompts.add_argument("--random-range-ratio", type=float, default=0.0,
                         help="draw lengths from [len*(1-r), len*(1+r)], r in [0, 1) (default 0)")
    prompts.add_argument("--tokenizer", default=None,
                         help="checkpoint directory (or tokenizer.json) to build exact-length prompts with "
                              "(default: the served model's, when /v1/models names a local directory; else words)")
    prompts.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                         help="do not send ignore_eos/min_tokens (outputs may then end before their length)")
    prompts.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    prompts.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")

    load = parser.add_argument_group("load")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=positive_float, default=math.inf,
                      help="requests per second (default inf: all at once)")
    rate.add_argument("--request-rates", type=_rates, default=None, metavar="R1,R2,...",
                      help="sweep: one run per rate, then a goodput-vs-load table and plot")
    load.add_argument("--burstiness", type=positive_float, default=1.0,
                      help="gamma shape of the gaps between arrivals: 1 Poisson, <1 burstier (default 1)")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="most requests in flight at once (default: no limit)")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="TTFT SLO for goodput (ms)")
    report.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="TPOT SLO for goodput (ms)")
    report.add_argument("--result-dir", default=".",
                        help="where the result JSON and PNG go, named bench-serve-<UTC time> (default .)")
    report.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plots")
    parser.set_defaults(handler=run)
