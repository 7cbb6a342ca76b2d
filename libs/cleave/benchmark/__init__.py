"""cleave.benchmark: `cleave bench serve`, a serving benchmark for any OpenAI-compatible server.

How one run flows, module by module:

    workload.py   prompts -> `BenchRequest`s (random token-length prompts from the served
                  model's tokenizer or from words, or a JSONL file)
    arrivals.py   when each request is sent (Poisson or gamma-bursty offsets, or all at once)
    sse.py        server-sent-event bytes -> event payloads (any chunk boundary)
    client.py     one aiohttp session: a `BenchRequest` -> a timed `RequestRecord`; the
                  probe that turns a bad endpoint into one `EndpointError` line
    load.py       sends the requests on their offsets under a concurrency cap -> `RunResult`
    stats.py      records -> `Summary` (TTFT/TPOT/ITL/e2e percentiles, throughput, goodput)
    progress.py   a bar on a terminal, periodic lines elsewhere (stderr)
    report.py     the summary as text, the result JSON (never overwritten), sweep tables
    plot.py       latency CDFs, tokens/s over time, goodput vs load (matplotlib, optional)
    serve.py      one run or a sweep of rates, end to end

Nothing here imports cleave's engine or services: the benchmark measures cleave, vLLM and
SGLang from the outside, through the same HTTP API.
"""
