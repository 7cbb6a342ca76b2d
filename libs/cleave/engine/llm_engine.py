"""`LLMEngine`: requests in, delta outputs out; one `step()` = schedule -> run -> record.

    step():
        output  = scheduler.schedule()                  # which sequences, how many tokens
        sampled = runner.execute(output, processors)    # forward + sampling on the device
        scheduler.advance(output)                       # the step's tokens count as computed
        scheduler.resolve(output, sampled, on_sampled)  # on_sampled: detokenize, stop checks
        -> one RequestOutput (delta) per request that produced something

Overlapped steps (`EngineConfig.overlap_steps`, on for CUDA) reorder this so the device
never waits for output processing:

    step():
        output = scheduler.schedule()        # plans from stand-ins for step N-1's tokens
        launched = runner.launch(output, processors, previous=in_flight)  # N, not awaited
        scheduler.advance(output)            # N's tokens become stand-ins
        resolve(in_flight)                   # N-1: wait for its ids only, stop checks, text
        in_flight = launched
        -> the outputs of step N-1

Sampled ids stay on the device; step N reads step N-1's from there. The host learns them
one call later, so a sequence that step N-1's token ends by a stop (a stop string, eos) was
launched once more: that extra token is dropped (`Scheduler.resolve`). An end known in
advance (max_tokens, the context, a prefill-only request's first token) is not launched
again: the scheduler sits the sequence out until its last token resolves
(`Sequence.max_num_tokens`).

A sequence whose sampling reads its earlier tokens on the host (logits processors: thinking
budgets, grammars; penalties) needs step N-1's tokens before step N samples, not before
step N's forward. A step holding one resolves N-1 between the two:

        launched = runner.launch(output, processors, previous=in_flight,
                                 while_device_runs=resolve(in_flight))  # N's forward runs meanwhile
        scheduler.advance(output)

so the host's grammar and penalty work overlaps the forward, and only the sampling waits
for it. (min_tokens reads only the number of tokens, which the stand-ins keep exact.) A
step is resolved at once, as in the plain loop, only when it has forks (n > 1 prefills).
A prefill worker's steps overlap too: a prompt's first token (its hand-off) is resolved
once the next prompt's step is launched, so the device runs prompt after prompt while the
host hands each one off.

`watch_layers` (None: off) is called on the step thread with each step's plan before its
launch; a `LayerProgress` it returns hears each layer of that step's forward (see
`cleave.engine.layer_progress`; the prefill worker streams KV with it).

The engine is single-threaded; `AsyncEngine` runs it on a thread of its own. Besides
colocated generation it offers the two halves of disaggregated serving:

- prefill worker: `add_request(..., prefill_only=True)` computes the prompt once, samples
  the first token of each of the `n` samples (the same draws a colocated engine makes) and
  finishes the request while keeping its prompt KV blocks; read them with
  `handoff.export(request_id)` / `kv_cache`, then `handoff.release_export(request_id)`.
- decode worker: `handoff.reserve(request_id, num_prompt_tokens)` returns the block ids
  the transport fills (once for all samples); `handoff.receive(..., first_tokens)` then
  decodes the `n` samples from their first tokens, sharing the prompt's blocks.

`handoff` (a `cleave.engine.handoff.KVHandoff`) is the one way workers reach the KV blocks
that cross the engine's boundary, the kvstore's prefix holds included; it states who owns
(and frees) which blocks.

With `EngineConfig.detokenize` off (the workers: the gateway makes the text) samples carry
token ids only; see `cleave.engine.request`. Requests are built by `cleave.engine.request_builder`;
the hand-off between workers lives in `cleave.engine.handoff`.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from functools import partial
from pathlib import Path

import structlog
import torch

from cleave.engine.config import EngineConfig
from cleave.engine.handoff import KVHandoff, end_sample
from cleave.engine.layer_progress import LayerProgress
from cleave.engine.model_runner import LaunchedStep, ModelRunner, RunnerOutput, StepStats
from cleave.engine.request import RequestState, SampleState
from cleave.engine.request_builder import Message, Prompt, RequestBuilder
from cleave.engine.sampling_tensors import LogitsProcessor
from cleave.engine.scheduler import Scheduler, SchedulerOutput
from cleave.engine.sequence import FINISHED_STATUSES, RUNNING, Sequence, SequenceStatus
from cleave.errors import InvalidArgument
from cleave.generation.outputs import RequestOutput, TokenLogprob
from cleave.generation.reasoning_formats import select_reasoning_config
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.manager import KVCacheManager
from cleave.kv.prefix_hash import kv_namespace
from cleave.model.config import ModelConfig
from cleave.model.loader import load_model
from cleave.parallel.group import tensor_parallel_group
from cleave.model.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

__all__ = ["LLMEngine", "Message", "Prompt"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    """A model, its KV cache, scheduler and runner, driven one `step()` at a time.

    Args:
        config: what to load and how to run it; `scheduler.max_model_len` is capped at the
            model's `max_position_embeddings`; dtype "auto" takes the checkpoint's dtype
            (float32 on CPU).
        sync_timing: synchronize the device inside steps so `last_stats` splits device time
            into forward and sampling (benchmarks).
        device_timing: record each step's device time with CUDA events (`StepStats.device_s`)
            without synchronizing (benchmarks of overlapped steps).
    """

    def __init__(self, config: EngineConfig, sync_timing: bool = False, device_timing: bool = False) -> None:
        self._init_model(config)
        self._init_runner(sync_timing, device_timing)
        self._init_scheduler()
        self._overlap = self.config.overlaps_steps
        self._in_flight: LaunchedStep | None = None  # launched and advanced, not yet resolved
        # Sequences whose sampling reads their earlier tokens on the host (see the module docstring).
        self._reads_outputs: set[str] = set()
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[str, SampleState] = {}  # seq_id -> sample
        self._processors: dict[str, list[LogitsProcessor]] = {}  # seq_id -> logits processors
        self._pending: dict[str, RequestState] = {}  # requests with news outside a step
        self._step_logprobs: dict[str, TokenLogprob] = {}
        self._deferred: dict[str, SampleState] = {}  # seq_id -> sample with ids awaiting text
        self._touched: dict[str, RequestState] = {}  # requests that got a token this step
        self._stream_interval = self.config.stream_interval
        self._collects = 0  # `_collect` calls: every `stream_interval`-th reports every request
        self._stagger = self.config.stagger_reports and self._stream_interval > 1
        self._next_phase = 0  # the next request's report phase, with staggered reports
        self.last_stats = StepStats()
        # step plan -> the LayerProgress of its forward, or None (step thread; see the docstring)
        self.watch_layers: Callable[[SchedulerOutput], LayerProgress | None] | None = None
        # called on the step thread with each step's `last_stats` (metrics: O(1) per step); None: off
        self.step_observer: Callable[[StepStats], None] | None = None

    # ---- start-up -------------------------------------------------------------------------

    def _init_model(self, config: EngineConfig) -> None:
        path = Path(config.model)
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.reasoning = select_reasoning_config(path, self.tokenizer, config.reasoning_parser)
        device = torch.device(config.device)
        if config.dtype == "auto":
            dtype = self.model_config.dtype if device.type == "cuda" else torch.float32
        elif config.dtype in _DTYPES:
            dtype = _DTYPES[config.dtype]
        else:
            raise ValueError(f"unsupported dtype {config.dtype!r}; use auto, {', '.join(_DTYPES)}")
        max_model_len = min(config.scheduler.max_model_len, self.model_config.max_position_embeddings)
        # expert-parallel MoE layers read their token counts back to the host: no CUDA graphs
        eager = config.enforce_eager or (config.tensor_parallel_size > 1 and self.model_config.is_moe)
        self.config = replace(
            config, enforce_eager=eager, scheduler=replace(config.scheduler, max_model_len=max_model_len)
        )
        self.dtype = dtype
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self._builder = RequestBuilder(
            self.tokenizer,
            self.model_config.vocab_size,
            self.reasoning,
            self.eos_token_ids,
            max_model_len,
            self.config.scheduler.max_num_seqs,
            self.config.detokenize,
        )
        if device.type == "cuda":
            # the structured-output tables (~1 s at 128k tokens, plus xgrammar's import) build
            # beside the weights load and graph capture, not on the first constrained request;
            # a CPU engine (the demo, the tests: few cores, busy starting) builds them on first use
            self._builder.grammars.build_tables_in_background()
        # norm weights folded into the projections after them: decode batches on GEMMs then
        # run without norm kernels (CausalLM.fold_norm_weights)
        if config.packed_experts and self.model_config.quantization != "mxfp4":
            log.warning("packed_experts_unused", model=str(path),
                        reason="the checkpoint has no MXFP4 experts; its weights load as stored")
        self.model = load_model(path, dtype=dtype, device=device, pdl=config.pdl,
                                tensor_parallel=tensor_parallel_group(config.tensor_parallel_size),
                                packed_experts=config.packed_experts).fold_norm_weights()

    def _init_runner(self, sync_timing: bool, device_timing: bool) -> None:
        torch.manual_seed(self.config.seed)
        self.runner = ModelRunner(self.config, self.model, sync_timing=sync_timing, device_timing=device_timing,
                                  eos_token_ids=self.eos_token_ids)

    def _init_scheduler(self) -> None:
        cache = self.config.cache
        config_file = Path(self.config.model) / "config.json"
        weights_id = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]
        namespace = kv_namespace(
            model=f"{Path(self.config.model).resolve().name}@{weights_id}",
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=cache.block_size,
            # an fp8 cache's blocks hold other bytes than the model dtype's: never the same hashes
            # ("auto" adds nothing, so the hashes of existing caches and kvstores stay as they were)
            extra={"kv_cache_dtype": cache.kv_cache_dtype} if cache.kv_cache_dtype != "auto" else None,
        )
        groups = self.runner.kv_groups
        self.kv = KVCacheManager(
            self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching, namespace,
            sliding_window=groups.sliding_window, window_group=groups.is_paired,
        )
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        # A weak reference back: no cycle, so a dropped engine frees its KV cache at once.
        self.handoff = KVHandoff(self.kv, self.scheduler, self.max_model_len, requests=weakref.proxy(self))

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV cache tensor [num_slots, 2, num_blocks, block_size, Hkv, D] (cleave.kv.groups)."""
        return self.runner.kv_cache

    # ---- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of a prompt: text (chat template for chat models unless `raw`), a
        message list (always templated) or token ids (checked against the vocabulary)."""
        return self._builder.encode_prompt(prompt, raw)

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
        *,
        raw: bool = False,
        prefill_only: bool = False,
    ) -> RequestState:
        """Tokenize and validate a request and build its state, touching no engine state
        (safe on another thread). Raises InvalidArgument naming the bad field."""
        return self._builder.build(
            request_id, prompt, params, priority, arrival_time, raw=raw, prefill_only=prefill_only
        )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
        *,
        raw: bool = False,
        prefill_only: bool = False,
    ) -> RequestState:
        """Validate and queue a request (n samples share one prefill of the prompt)."""
        state = self.prepare_request(
            request_id, prompt, params, priority, arrival_time, raw=raw, prefill_only=prefill_only
        )
        self.enqueue(state)
        return state

    def enqueue(self, state: RequestState) -> None:
        """Queue a request built by `prepare_request`."""
        if state.request_id in self._requests:
            raise InvalidArgument(f"{state.request_id!r} is already running; use a unique id", field="request_id")
        seqs = [sample.seq for sample in state.samples]
        if len(seqs) > 1:
            self.scheduler.add_group(seqs)
        else:
            self.scheduler.add(seqs[0])
        self._register(state)

    def _register(self, state: RequestState) -> None:
        self._requests[state.request_id] = state
        if self._stagger:
            state.report_phase = self._next_phase
            self._next_phase = (self._next_phase + 1) % self._stream_interval
        params = state.params
        for sample in state.samples:
            seq_id = sample.seq.seq_id
            self._samples[seq_id] = sample
            if sample.logits_processors:
                self._processors[seq_id] = sample.logits_processors
            if params.has_penalties or sample.logits_processors:
                self._reads_outputs.add(seq_id)

    def abort(self, request_id: str) -> bool:
        """End every sample of a request and free its KV; its final output (finish reason
        ABORT) comes with the next step. Returns False for an unknown request."""
        state = self._requests.get(request_id)
        self.handoff.release_export(request_id)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        for sample in state.samples:
            sample.end(SequenceStatus.FINISHED_ABORTED)
        self._pending[request_id] = state
        return True

    def abort_sample(self, request_id: str, index: int) -> bool:
        """End one sample of a request (finish reason ABORT) and free its KV, e.g. when a
        stop string matched downstream; the other samples go on. Its final output comes with
        the next step. Returns False for an unknown request or sample, or one that ended."""
        state = self._requests.get(request_id)
        if not end_sample(state, index, self.scheduler):
            return False
        self._pending[request_id] = state
        return True

    def close(self) -> None:
        """Release what the engine holds beyond its memory (a tensor-parallel worker's rank
        processes: `cleave.engine.lockstep`); nothing for a single-rank engine. The engine
        is not stepped after this."""

    def has_unfinished(self) -> bool:
        """Whether any request still runs or has an output to report."""
        return self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return a delta output per request with news (overlapped:
        the news of the step launched by the previous call)."""
        start = time.perf_counter()
        outputs = self._step_overlapped() if self._overlap else self._step_synchronous()
        self.last_stats.wall_s = time.perf_counter() - start
        if self.step_observer is not None:
            self.step_observer(self.last_stats)
        return outputs

    def _step_synchronous(self) -> list[RequestOutput]:
        start = time.perf_counter()
        output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        if output.is_empty:
            self._flush_text()
            self.last_stats = StepStats(schedule_s=scheduled - start)
            return self._collect()
        progress = self.watch_layers(output) if self.watch_layers is not None else None
        result = self.runner.execute(
            output, self._processors, while_device_runs=self._flush_text, layer_progress=progress
        )
        stats = result.stats
        stats.schedule_s = scheduled - start
        ran = time.perf_counter()
        self._touched = {}
        self.scheduler.advance(output)
        self._record(output, result)
        outputs = self._collect(self._touched)
        stats.postprocess_s = time.perf_counter() - ran
        self.last_stats = stats
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        start = time.perf_counter()
        previous, self._in_flight = self._in_flight, None
        output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = None
        stats = StepStats()
        self._touched = {}
        resolve_first = previous is not None and self._reads_outputs_in(output)
        if not output.is_empty:
            progress = self.watch_layers(output) if self.watch_layers is not None else None
            launched = self.runner.launch(
                output, self._processors, previous, layer_progress=progress,
                while_device_runs=partial(self._resolve, previous) if resolve_first else None,
            )
            stats = launched.stats
            self.scheduler.advance(output)
            if self._can_overlap(output):
                self._in_flight = launched
        stats.schedule_s = scheduled - start
        resolving = time.perf_counter()
        if previous is not None:
            stats.device_s = previous.stats.device_s if resolve_first else self._resolve(previous)
        if launched is not None and self._in_flight is None:
            self._resolve(launched)  # its tokens are needed before the next launch
        self._flush_text()
        outputs = self._collect(self._touched)
        stats.postprocess_s = time.perf_counter() - resolving
        self.last_stats = stats
        return outputs

    def _can_overlap(self, output: SchedulerOutput) -> bool:
        """Whether the next step may launch before this one's tokens reach the host."""
        return not output.has_forks

    def _reads_outputs_in(self, output: SchedulerOutput) -> bool:
        """Whether a sequence of this step samples from its earlier tokens on the host."""
        return _any_sampled_in(output, self._reads_outputs)

    def _resolve(self, launched: LaunchedStep) -> float:
        """Wait for a launched, advanced step's tokens and record them; returns its device seconds."""
        result = self.runner.collect(launched)
        self._record(launched.output, result)
        return result.stats.device_s

    def _record(self, output: SchedulerOutput, result: RunnerOutput) -> None:
        """Tokens of an advanced step into the scheduler (stop checks, frees) and the samples' states."""
        for chunk in result.prompt_logprobs:  # before the tokens: a finished request is forgotten
            state = self._requests.get(chunk.seq.request_id)
            if state is not None and state.add_prompt_logprobs(chunk.first_position, chunk.entries):
                self._touched[state.request_id] = state
        if result.logprobs is not None:
            self._step_logprobs = {
                seq.seq_id: logprob for seq, logprob in zip(output.sampled_seqs, result.logprobs) if logprob is not None
            }
        updated = self.scheduler.resolve(output, result.token_ids, self._on_sampled)
        self._step_logprobs = {}
        touched, samples = self._touched, self._samples
        for seq in updated:
            status = seq.status
            if status is not RUNNING and status in FINISHED_STATUSES:
                sample = samples.get(seq.seq_id)
                state = touched.get(seq.request_id)
                if sample is not None and state is not None and not state.prefill_done:
                    sample.end(status)  # no-op unless the scheduler ended it (context full)

    def _on_sampled(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Scheduler callback per sampled token: text, stop conditions, prefill-only hand-off."""
        seq_id = seq.seq_id
        sample = self._samples.get(seq_id)
        if sample is None:
            return None
        logprobs = self._step_logprobs
        status = sample.process_token(token_id, logprobs.get(seq_id) if logprobs else None)
        if sample.deferred:
            self._deferred[seq_id] = sample
        request_id = seq.request_id
        state = self._touched[request_id] = self._requests[request_id]
        if state.prefill_only:
            return self.handoff.on_first_token(state, seq, sample, status)
        return status

    def _flush_text(self) -> None:
        """Detokenize the previous step's deferred tokens (runs while the device computes).
        With a stream interval the text is made when a request is reported instead
        (`_collect`), a run of tokens at once."""
        deferred = self._deferred
        if not deferred or self._stream_interval > 1:
            return
        requests, pending = self._requests, self._pending
        for sample in deferred.values():
            sample.flush_text()
            request_id = sample.seq.request_id
            state = requests.get(request_id)
            if state is not None:
                pending[request_id] = state
        deferred.clear()

    def _collect(self, touched: dict[str, RequestState] | None = None) -> list[RequestOutput]:
        if touched is None:
            states = self._pending
        elif self._pending:
            states = touched
            states.update(self._pending)
        else:
            states = touched
        self._pending = held = {}
        # With a stream interval, a running request that reported before keeps its news
        # (its samples accumulate them) until every `stream_interval`-th call (staggered:
        # the calls where its phase comes round).
        self._collects += 1
        interval, stagger = self._stream_interval, self._stagger
        hold = interval > 1 and (stagger or self._collects % interval != 0)
        collects = self._collects
        outputs: list[RequestOutput] = []
        for state in states.values():
            samples = state.samples
            if len(samples) == 1:  # the common case, without the loops of `finished` and `has_news`
                sample = samples[0]
                done = sample.finish_reason is not None or state.prefill_done
                if not done and not sample.has_news:
                    continue
                ending = done
            else:
                done = state.finished or state.prefill_done
                if not done and not state.has_news:
                    continue
                ending = done or any(s.finish_reason is not None and s.has_news for s in samples)
            if hold and not ending and state.reported_prompt and (
                    not stagger or (collects + state.report_phase) % interval):
                held[state.request_id] = state
                continue
            if self._stream_interval > 1:
                self._flush_samples(samples)
            output = state.take_output()
            output.finished = done
            outputs.append(output)
            if done:
                self._forget(state)
        return outputs

    def _flush_samples(self, samples: list[SampleState]) -> None:
        """Detokenize the deferred tokens of a request about to be reported."""
        deferred = self._deferred
        for sample in samples:
            if sample.deferred:
                sample.flush_text()
                deferred.pop(sample.seq.seq_id, None)

    def _forget(self, state: RequestState) -> None:
        if self._requests.get(state.request_id) is state:
            del self._requests[state.request_id]
        for sample in state.samples:
            seq_id = sample.seq.seq_id
            self._samples.pop(seq_id, None)
            self._processors.pop(seq_id, None)
            self._deferred.pop(seq_id, None)
            self._reads_outputs.discard(seq_id)

    # ---- disaggregation hooks: `handoff` (see cleave.engine.handoff) ---------------------

    def check_new_request(self, request_id: str) -> None:
        """`handoff.receive`: raise InvalidArgument when `request_id` is already running."""
        if request_id in self._requests:
            raise InvalidArgument(f"{request_id!r} is already running; use a unique id", field="request_id")

    def track_received(self, state: RequestState, running: bool) -> None:
        """`handoff.receive`: track a received request (when a sample runs on) and report it
        (first tokens, or its end) with the next step."""
        if running:
            self._register(state)
        self._pending[state.request_id] = state


def _any_sampled_in(output: SchedulerOutput, seq_ids: set[str]) -> bool:
    """Whether a sequence that samples in `output` is one of `seq_ids`."""
    return bool(seq_ids) and any(seq.seq_id in seq_ids for seq in output.sampled_seqs)
