"""`ModelRunner`: the device side of a step — KV cache, forward (or graph replay), sampling.

    runner.launch(scheduler_output, logits_processors, previous) -> LaunchedStep
        1. apply block copies (copy-on-write of shared blocks, all layers, K and V)
        2. InputBatch: ids, positions, attention metadata (one host->device copy); stand-in
           ids are replaced on the device by the tokens `previous` sampled
        3. forward: a decode-only batch replays a captured CUDA graph (logits of every row);
           anything else runs eagerly and computes logits only for sampling rows
        4. SamplingTensors of each sampled sequence, built while the forward runs on the GPU
           (after the caller's host work for this step: `while_device_runs`)
        5. sample; expand logits rows for forks; queue the device->host copy of the token
           ids and an event after it. Nothing here waits for the device.
    runner.collect(launched) -> RunnerOutput      # waits for that event only
    runner.execute(...) == collect(launch(...))   # the synchronous step

A step may carry a `LayerProgress` (`cleave.engine.layer_progress`): the eager forward then
reports each decoder layer once it queued its KV write (a forward hook on each layer for the
duration of that forward; the model file stays the maths), e.g. so a prefill worker ships a
layer's KV while the next layers compute. Without one nothing is registered or recorded.

The sampled ids stay on the device (`LaunchedStep.token_ids`) so the next step can be
launched before they reach the host: that is what lets the engine overlap its host work
(output processing, scheduling, input preparation) with the device's forward.

The KV cache is one tensor [num_slots, 2, num_blocks, block_size, Hkv, D]: a slot per layer,
or half as many for a model whose sliding-window layers pair with its full-attention ones
(`cleave.kv.groups`; steps then carry window tables, `AttentionMetadata.window`). On CUDA its
size is what is left of this process's share of the device (`gpu_memory_utilization` of
its total memory, `memory_budget`) after the weights and a profiling forward at the step's
token budget; on CPU from `CacheConfig.num_blocks` or DEFAULT_CPU_KV_TOKENS.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import structlog
import torch

from cleave.device_copy import to_device, to_host
from cleave.engine.config import EngineConfig
from cleave.engine.input_batch import InputBatch, InputBatchBuilder, OutputTokens
from cleave.engine.layer_progress import LayerProgress
from cleave.engine.memory_budget import DeviceMemory, kv_blocks_for_share
from cleave.engine.penalty_counts import PenaltyCounts
from cleave.engine.prompt_logprobs import PromptLogprobChunk, PromptRows, prompt_logprob_rows, score_prompt_rows
from cleave.engine.sampler import Sampler
from cleave.engine.sampling_tensors import LogitsProcessor, SamplingTensors, uniform_plain
from cleave.engine.scheduler import SchedulerOutput
from cleave.generation.outputs import TokenLogprob
from cleave.generation.sampling_params import SamplingParams
from cleave.graphs.prefill import PrefillGraphConfig, PrefillGraphRunner
from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig
from cleave.kernels.kv_cache_dtype import as_words, resolve_kv_cache_dtype
from cleave.kv.groups import kv_groups
from cleave.kv.metadata import AttentionMetadata
from cleave.model.llama import CausalLM, allocate_kv_cache
from cleave.model.moe import SparseMoeBlock
from cleave.parallel.model import TensorParallelCausalLM

DEFAULT_CPU_KV_TOKENS = 8192
# Prompt lengths whose kernels compile at start-up beside the full step budget: the prefill
# attention's query block follows the longest prompt of a step up to 64 rows (16 and 32
# below that) and the elementwise kernels take 1024-column blocks under 1024 rows (4096 at
# the budget). An engine run that met them only in a serving step compiled them there
# (H100, 256 x (512 + 1024): the step with the last prompt chunk waited 0.3 s).
WARM_PREFILL_TOKENS = (16, 32)
# Those prompts run alone and fresh, so their attention is dense SDPA (`attention_fresh`); a
# step of several prompts, or of a chunk after a cached one, runs the paged prefill kernel,
# whose query block follows the step's longest prompt: 16, 32, 64 or 128 rows (the tuned
# launches' most). Two prompts of each of these lengths compile its variants at start-up (an
# H100 engine run, 256 x (512 + 1024), compiled the 128- and 32-row ones in serving steps:
# 1.2 s).
PAGED_WARM_TOKENS = (16, 32, 64, 128)
log = structlog.get_logger(__name__)


@dataclass
class StepStats:
    """Wall-clock seconds of each phase of one engine step (host clock).

    With `sync_timing` on the runner, `forward_s` waits for the device, so it is the
    longer of the forward's device time and the overlapped host work (`overlap_s`), and
    `sample_s` covers sampling; otherwise device time lands in whichever phase first reads
    a result back (sampling; in overlapped steps, `postprocess_s` when the host is ahead).

    `device_s` is the device's own time for the forward and sampling of one step (CUDA
    events, with `device_timing` on the runner; else 0), and `wall_s` the whole `step()`
    call: over many steps, 1 - sum(device_s) / sum(wall_s) is the share of time the device
    waited for the host. In an overlapped step the schedule/prepare/forward/sample phases
    belong to the step launched and `postprocess_s` and `device_s` to the one resolved.
    """

    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    sampling_prep_s: float = 0.0  # host part of sample_s: building SamplingTensors
    postprocess_s: float = 0.0  # stop checks, detokenization that cannot wait, outputs
    overlap_s: float = 0.0  # host work done while the forward ran (inside forward_s)
    device_s: float = 0.0
    wall_s: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    used_graph: bool = False

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.postprocess_s

    @property
    def host_s(self) -> float:
        """Host-only work of the step: scheduling, input and sampling preparation, postprocess."""
        return self.schedule_s + self.prepare_s + self.sampling_prep_s + self.postprocess_s


@dataclass
class RunnerOutput:
    """Sampled tokens of a step, aligned with `SchedulerOutput.sampled_seqs`.

    Attributes:
        token_ids: one token per sampled sequence.
        logprobs: per sampled sequence, its TokenLogprob when its request asked for
            logprobs, else None; None as a whole when no row asked.
        prompt_logprobs: scores of the prompt tokens this step's prefill chunks ran, for the
            requests that asked (`cleave.engine.prompt_logprobs`).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    stats: StepStats = field(default_factory=StepStats)
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device.

    Attributes:
        output: the scheduler's plan it runs.
        sampled_seqs: the S sequences that sample, aligned with `output.sampled_seqs`.
        token_ids: [S] int64 sampled ids on the device (the next step's stand-ins read
            them), None when nothing samples.
        host_token_ids: [S] int64 their host copy (pinned, filled once `ready` passed).
        host_logprobs: host copies of (top ids [S, K], top logprobs [S, K], sampled [S]),
            None when no row asked for logprobs.
        ready: CUDA event after the host copies (None off CUDA: they are done).
        timing: CUDA events (forward start, sampling end) with device timing on.
        stats: the host phases of the launch.
    """

    output: SchedulerOutput
    sampled_seqs: list
    token_ids: torch.Tensor | None
    host_token_ids: torch.Tensor | None
    host_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ready: torch.cuda.Event | None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    stats: StepStats
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)  # on the host already


def _check_device_usable(device: torch.device, doing: str, instead: str, error: BaseException) -> None:
    """After a failure in `doing`, raise RuntimeError unless `device` still runs work: a
    device-side assert or a fault leaves the CUDA context unusable, so falling back to eager
    work would only fail later, further from the cause. The message names `instead`."""
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as lost:
        raise RuntimeError(f"{doing} left the CUDA context unusable ({lost}); the first error was: {error}. "
                           f"Start without it ({instead}) and report the failure") from error


def _check_tensor_parallel(config: EngineConfig, model: CausalLM) -> None:
    """Refuse a model split over a different number of ranks than the config asks for."""
    model_ranks = model.group.world_size if isinstance(model, TensorParallelCausalLM) else 1
    if model_ranks != config.tensor_parallel_size:
        raise ValueError(
            f"EngineConfig.tensor_parallel_size is {config.tensor_parallel_size} but the model was loaded for "
            f"{model_ranks} rank(s); load it in every rank with load_model(..., "
            f"tensor_parallel=tensor_parallel_group({config.tensor_parallel_size}))"
        )


class ModelRunner:
    """Owns the model, its KV cache, the sampler and (on CUDA) the decode graphs.

    Args:
        config: the engine configuration (scheduler limits already resolved against the model).
        model: the loaded model, on `config.device`.
        sync_timing: synchronize after the forward so StepStats separate device phases.
        device_timing: time each step's forward and sampling with CUDA events
            (`StepStats.device_s`), without synchronizing.
    """

    def __init__(
        self, config: EngineConfig, model: CausalLM, sync_timing: bool = False, device_timing: bool = False,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        _check_tensor_parallel(config, model)
        self.config = config
        self.eos_token_ids = eos_token_ids  # kept from samples short of their min_tokens
        self.model = model
        self.model_config = model.config  # a tensor-parallel rank's view: its KV heads (cleave.parallel)
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.sync_timing = sync_timing
        self.device_timing = device_timing and self.device.type == "cuda"
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, next(model.parameters()).dtype)
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(config.seed)
        # penalised sequences' token counts, kept between steps
        self.penalty_counts = PenaltyCounts(self.vocab_size, self.device, config.scheduler.max_num_seqs)
        self.inputs = InputBatchBuilder(self.block_size, self.device)
        # the cache's layer slots: paired window layers (cleave.kv.groups) or one per layer
        self.kv_groups = kv_groups(self.model_config, config.cache.pair_window_layers)
        self.num_blocks = self._init_num_blocks()
        self.kv_cache = allocate_kv_cache(self.model_config, self.num_blocks, self.block_size, self.kv_dtype, self.device,
                                          num_slots=self.kv_groups.num_slots)
        self.graph_runner = self._init_graphs()
        self.prefill_graphs = self._init_prefill_graphs()
        self._warm_kernels()
        # (rows, state) of the last step's SamplingTensors while they stay valid; holding the
        # sequences keeps their ids from being reused by new objects.
        self._cached_sampling: tuple[list, SamplingTensors] | None = None

    # ---- start-up -------------------------------------------------------------------------

    def _init_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type != "cuda":
            tokens = max(DEFAULT_CPU_KV_TOKENS, self.config.scheduler.max_model_len)
            tables = 2 if self.kv_groups.is_paired else 1  # a paired cache's pages serve two tables
            return tables * -(-tokens // self.block_size) + 1
        # gpu_memory_utilization is this process's share of the device's total memory (see
        # memory_budget): workers sharing a GPU never count each other's memory as theirs.
        # the penalty tables grow as penalised samples come: set their full size aside
        peak = self._profile_peak_bytes() + PenaltyCounts.table_bytes(self.vocab_size, self.config.scheduler.max_num_seqs)
        free, total = torch.cuda.mem_get_info(self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        memory = DeviceMemory(f"cuda:{index}", free, total, torch.cuda.memory_reserved(self.device))
        return kv_blocks_for_share(memory, cache.gpu_memory_utilization, peak, self._bytes_per_block())

    def _bytes_per_block(self) -> int:
        """Bytes of one block in every layer slot, K and V, at the cache's own element size
        (half the model's for an fp8 cache of a bf16 model)."""
        cfg = self.model_config
        return self.kv_groups.num_slots * 2 * self.block_size * cfg.num_key_value_heads * cfg.head_dim * self.kv_dtype.itemsize

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak activation bytes of a full-budget prefill plus sampling max_num_seqs rows."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        num_rows = min(sched.max_num_seqs, num_tokens)
        prompts = self._budget_prompts(num_tokens)
        blocks = sum(-(-length // self.block_size) for length in prompts)
        kv = allocate_kv_cache(self.model_config, blocks + 1, self.block_size, self.kv_dtype, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        # a scratch cache: the real one is sized from this run
        hidden = self._dummy_prefill(prompts, kv)
        logits = self.model.compute_logits(hidden[-num_rows:].contiguous())
        del hidden
        params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50)] * num_rows
        state = SamplingTensors.from_params(
            params, vocab_size=self.vocab_size, device=self.device, output_token_ids=[[]] * num_rows
        )
        self.sampler.sample(logits, state)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv, logits
        torch.cuda.empty_cache()
        return peak

    def _budget_prompts(self, num_tokens: int) -> list[int]:
        """Prompt lengths that fill a step of `num_tokens`: as long as a prompt may be
        (`max_model_len`; a model's rotary table ends there), the last one shorter."""
        longest = self.config.scheduler.max_model_len
        return [min(longest, num_tokens - start) for start in range(0, num_tokens, longest)]

    def _dummy_prefill(self, lengths: Seq[int], kv: torch.Tensor, paired: bool = False) -> torch.Tensor:
        """The model over prompts of `lengths` zeros each (none longer than `max_model_len`)
        in blocks 1.. of `kv` (and, `paired`, window tables on the blocks after them, as a
        paired cache's steps have): their hidden states."""
        if max(lengths) > self.config.scheduler.max_model_len:
            raise ValueError(f"a warm-up prompt of {max(lengths)} tokens is longer than max_model_len "
                             f"{self.config.scheduler.max_model_len}")
        pages = [-(-length // self.block_size) for length in lengths]

        def tables(first: int) -> list[list[int]]:
            starts = [first + sum(pages[:index]) for index in range(len(pages))]
            return [list(range(start, start + count)) for start, count in zip(starts, pages)]

        window_tables = tables(1 + sum(pages)) if paired else None
        metadata = AttentionMetadata.build(list(lengths), list(lengths), tables(1), self.block_size, self.device,
                                           window_tables=window_tables)
        input_ids = torch.zeros(sum(lengths), dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(length, device=self.device) for length in lengths])
        return self.model(input_ids, positions, kv, metadata)

    @torch.inference_mode()
    def _warm_prefill_shapes(self) -> int:
        """Run the eager model over prompts of `WARM_PREFILL_TOKENS` and of the full step
        budget, and over pairs of prompts of `PAGED_WARM_TOKENS`, in the real cache, so that
        their kernel variants compile now and not in a serving step. The real cache, not one
        of the profile run's size: a kernel's integer arguments are typed 32 or 64 bits by
        their value, and a big cache's strides pass 2^31 (an fp8 cache of 496k blocks did on
        an H200, and its first serving step compiled the prefill and KV-write kernels again).
        Nothing is cached yet, so the blocks written are free. Returns the forwards run."""
        budget = self.config.scheduler.max_num_batched_tokens
        longest = self.config.scheduler.max_model_len  # no prompt is longer (a model's rotary table ends there)
        paired = self.kv_groups.is_paired
        usable = (self.num_blocks - 1) // (2 if paired else 1)

        def fits(length: int, num_prompts: int) -> bool:
            return (length <= longest and length * num_prompts <= budget
                    and num_prompts * -(-length // self.block_size) <= usable)

        full_step = min(budget, longest)
        lengths = list(dict.fromkeys(length for length in (*WARM_PREFILL_TOKENS, full_step) if fits(length, 1)))
        pairs = [length for length in PAGED_WARM_TOKENS if fits(length, 2)]
        for length in lengths:
            self._dummy_prefill([length], self.kv_cache, paired)
        for length in pairs:
            self._dummy_prefill([length, length], self.kv_cache, paired)
        return len(lengths) + len(pairs)

    @torch.inference_mode()
    def _warm_kernels(self) -> None:
        """Compile at start-up the kernel variants that the profile run and the graph
        captures do not reach and a serving step would: the one-kernel sampler, each
        attention layout's decode kernel for a mixed step's decodes, and the launches of
        short prompts. A step that meets a new variant waits 0.3-1.3 s for its compile."""
        if self.device.type != "cuda":
            return
        seen: set[tuple] = set()
        for layer in getattr(self.model, "layers", ()):
            attention = getattr(layer, "self_attn", None)
            if attention is None or not hasattr(attention, "warm_mixed_decodes"):
                continue
            key = (attention.sliding_window, attention.sinks is None, attention.prefill_launch)
            if key not in seen:
                seen.add(key)
                attention.warm_mixed_decodes(self.kv_cache[0], self.config.scheduler.max_num_seqs)
        self._warm_prefill_shapes()
        self._warm_experts()
        self.sampler.warm(self.vocab_size, self.device)
        torch.cuda.synchronize(self.device)

    def _warm_experts(self) -> int:
        """Compile the expert kernels of every token count a step can hold (`max_num_batched_tokens`):
        a tuned table picks grouped-GEMM tiles by token count, so the start-up prompts reach only
        some of them. One block of each expert shape runs; the others share its variants.
        Returns the blocks run."""
        shapes: set[tuple] = set()
        for module in self.model.modules():
            if isinstance(module, SparseMoeBlock):
                shape = (type(module), tuple(module.experts.gate_up.shape), module.top_k)
                if shape not in shapes:
                    shapes.add(shape)
                    module.warm_variants(self.config.scheduler.max_num_batched_tokens)
        return len(shapes)

    def _init_graphs(self) -> CUDAGraphRunner | None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        sched = self.config.scheduler
        graph_config = GraphRunnerConfig(
            max_batch_size=sched.max_num_seqs,
            max_blocks_per_seq=-(-sched.max_model_len // self.block_size),
            block_size=self.block_size,
            pdl=self.config.pdl,
            window_tables=self.kv_groups.is_paired,
        )
        runner = CUDAGraphRunner(self._decode_step, graph_config, self.device)
        runner.capture()
        return runner

    def _init_prefill_graphs(self) -> PrefillGraphRunner | None:
        """Graphs of one short prompt's prefill (`EngineConfig.prefill_graph_max_tokens`; off
        CUDA the padded forward runs eagerly, for tests). A capture that fails leaves prefill
        eager, and says why."""
        max_tokens = self.config.prefill_graph_max_tokens
        if max_tokens == 0 or self.config.enforce_eager or self.config.tensor_parallel_size > 1:
            return None  # tensor-parallel ranks prefill eagerly (their collectives are not captured)
        sched = self.config.scheduler
        max_tokens = min(max_tokens, sched.max_num_batched_tokens, sched.max_model_len - 1)  # room for a new token
        if max_tokens < 2:
            return None  # a one-token prefill runs eagerly either way (`PrefillGraphRunner.bucket_for`)
        config = PrefillGraphConfig(
            max_tokens=max_tokens,
            max_blocks_per_seq=-(-sched.max_model_len // self.block_size),
            block_size=self.block_size,
            window_tables=self.kv_groups.is_paired,
        )
        runner = PrefillGraphRunner(self._prefill_forward, config, self.device)
        try:
            runner.capture()
        except (RuntimeError, torch.OutOfMemoryError) as error:
            _check_device_usable(self.device, "capturing the prefill graphs",
                                 "--prefill-graph-max-tokens 0, EngineConfig.prefill_graph_max_tokens=0",
                                 error)
            log.warning("prefill graphs not captured: prompts prefill eagerly", error=str(error),
                        max_tokens=config.max_tokens)
            return None
        return runner

    def _prefill_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, metadata)  # [T] -> hidden [T, H]

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # [B] -> logits [B, V]: every row of a decode batch is a sampling row
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, metadata))

    # ---- one step -------------------------------------------------------------------------

    def execute(
        self,
        output: SchedulerOutput,
        logits_processors: Mapping[str, Seq[LogitsProcessor]] | None = None,
        while_device_runs: Callable[[], None] | None = None,
        layer_progress: LayerProgress | None = None,
    ) -> RunnerOutput:
        """Run one scheduled step; returns one token per `output.sampled_seqs` entry.

        `logits_processors` maps seq_id to that sequence's processors (absent: none).
        `while_device_runs` is host work (e.g. detokenizing the previous step) called once
        the forward is launched, so it overlaps the device's work; its time is `overlap_s`.
        `layer_progress` hears each layer of the forward (see `launch`).
        """
        launched = self.launch(output, logits_processors, None, while_device_runs, layer_progress)
        waited = time.perf_counter()
        result = self.collect(launched)
        result.stats.sample_s += time.perf_counter() - waited
        return result

    @torch.inference_mode()
    def launch(
        self,
        output: SchedulerOutput,
        logits_processors: Mapping[str, Seq[LogitsProcessor]] | None = None,
        previous: LaunchedStep | None = None,
        while_device_runs: Callable[[], None] | None = None,
        layer_progress: LayerProgress | None = None,
    ) -> LaunchedStep:
        """Queue one scheduled step on the device without waiting for it.

        Stand-in ids in `output` (see `Scheduler.advance`) take the tokens `previous`
        sampled. `while_device_runs` runs once the forward is queued and before the sampling
        tensors are built, so what it tells the logits processors (e.g. `previous`'s tokens)
        holds for this step's sampling (time: `overlap_s`).
        `layer_progress` hears every layer once, in order, before this returns: per layer
        in an eager forward, all at once after a graph replay.
        """
        stats = StepStats(num_seqs=len(output.scheduled))
        start = time.perf_counter()
        if output.block_copies:
            self.copy_blocks(output.block_copies)
        batch = self.inputs.build(output)
        if batch.has_stand_ins:
            self._feed_stand_ins(batch, previous)
        stats.num_tokens, stats.num_sampled = batch.num_tokens, len(batch.sampled_seqs)
        prepared = time.perf_counter()
        stats.prepare_s = prepared - start

        timing = None
        if self.device_timing:
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        prompt_rows = prompt_logprob_rows(output, batch.num_tokens)
        logits, stats.used_graph, prompt_logprobs = self._forward(batch, layer_progress, prompt_rows)
        if layer_progress is not None:
            layer_progress.finish()  # layers that ran without the hook (graph, fused decode path)
        if while_device_runs is not None:
            overlap_start = time.perf_counter()
            while_device_runs()
            stats.overlap_s = time.perf_counter() - overlap_start
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        forwarded = time.perf_counter()
        stats.forward_s = forwarded - prepared

        if not batch.sampled_seqs:
            if timing is not None:
                timing[1].record()
            return LaunchedStep(output, [], None, None, None, self._ready_event(), timing, stats, prompt_logprobs)
        if batch.sample_rows is not None:
            logits = logits.index_select(0, batch.sample_rows)  # [R, V] -> [S, V]
        state = self._sampling_tensors(batch, logits_processors)
        stats.sampling_prep_s = time.perf_counter() - forwarded
        sampled = self.sampler.sample(logits, state)
        token_ids = sampled.token_ids  # [S] int64
        host_token_ids = to_host(token_ids)
        host_logprobs = None
        if sampled.logprobs is not None:
            lp = sampled.logprobs
            host_logprobs = (
                to_host(lp.top_token_ids), to_host(lp.top_logprobs), to_host(lp.sampled_logprobs)
            )
        if timing is not None:
            timing[1].record()
        stats.sample_s = time.perf_counter() - forwarded
        return LaunchedStep(
            output, batch.sampled_seqs, token_ids, host_token_ids, host_logprobs, self._ready_event(), timing, stats,
            prompt_logprobs,
        )

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's sampled ids (only them) and read them on the host."""
        if launched.ready is not None:
            launched.ready.synchronize()
        stats = launched.stats
        if launched.timing is not None:
            stats.device_s = launched.timing[0].elapsed_time(launched.timing[1]) * 1e-3
        if launched.host_token_ids is None:
            return RunnerOutput([], None, stats, launched.prompt_logprobs)
        token_ids = launched.host_token_ids.tolist()
        logprobs = self._logprobs(launched.sampled_seqs, launched.host_logprobs, token_ids)
        return RunnerOutput(token_ids, logprobs, stats, launched.prompt_logprobs)

    def _feed_stand_ins(self, batch: InputBatch, previous: LaunchedStep | None) -> None:
        """Replace stand-in input ids by the tokens the previous step sampled (on the device)."""
        if previous is None or previous.token_ids is None:
            raise RuntimeError("the step feeds stand-in tokens but no launched step sampled them; advance() the "
                               "scheduler only for steps launched with the runner and pass that step as `previous`")
        source = previous.token_ids  # [S_prev]
        if batch.all_stand_ins:
            batch.input_ids.copy_(source[: batch.num_tokens])
        else:
            batch.input_ids.index_copy_(0, batch.stand_in_rows, source.index_select(0, batch.stand_in_sources))

    def _ready_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst across every layer, K and V (one gather/scatter)."""
        pairs = to_device(torch.tensor(copies, dtype=torch.int64).view(-1, 2), self.device)  # [C, 2]
        src, dst = pairs[:, 0], pairs[:, 1]
        # kv_cache: [slots, 2, NB, BS, Hkv, D]; dsts are fresh blocks, never a src of the same step
        words = as_words(self.kv_cache)  # a copy of bits: no float8 indexing kernel needed
        words[:, :, dst] = words[:, :, src]

    def _forward(
        self, batch: InputBatch, layer_progress: LayerProgress | None = None, prompt_rows: Seq[PromptRows] = ()
    ) -> tuple[torch.Tensor, bool, list[PromptLogprobChunk]]:
        """Logits [R, V] float32 of the sampling rows (R = entries that sample), whether a
        graph ran, and the scores of `prompt_rows` (eager: they need every hidden row)."""
        if self.graph_runner is not None and batch.is_decode_only and not prompt_rows:
            bucket = self.graph_runner.bucket_for(batch.num_entries, batch.metadata)
            if bucket is not None:
                logits = self.graph_runner.run(batch.input_ids, batch.positions, batch.metadata)  # [E, V]
                if batch.logits_indices is not None:
                    logits = logits.index_select(0, batch.logits_indices)
                return logits, True, []
        if self.prefill_graphs is not None and not prompt_rows:
            bucket = self.prefill_graphs.bucket_for(batch.input_ids, batch.metadata)
            if bucket is not None:
                hidden = self.prefill_graphs.run(batch.input_ids, batch.positions, batch.metadata, bucket)
                if batch.logits_indices is not None:
                    hidden = hidden.index_select(0, batch.logits_indices)  # [R, H]
                return self.model.compute_logits(hidden), self.prefill_graphs.is_captured, []
        if layer_progress is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)  # [T, H]
        else:
            hidden = self._forward_reporting_layers(batch, layer_progress)
        prompt_logprobs = score_prompt_rows(hidden, list(prompt_rows), self.model.compute_logits) if prompt_rows else []
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)  # [R, H]
        return self.model.compute_logits(hidden), False, prompt_logprobs

    def _forward_reporting_layers(self, batch: InputBatch, layer_progress: LayerProgress) -> torch.Tensor:
        """The eager forward with `layer_progress.on_layer_done(s)` for each cache slot s right
        after its last decoder layer returns (its KV write is queued then; a slot per layer
        unless the cache pairs them): a forward hook per layer, for this call only."""
        groups = self.kv_groups

        def hook_for(index: int) -> Callable[..., None]:
            num_done = groups.slots_done_after(index + 1)

            def report(module, args, output) -> None:
                while layer_progress.num_reported < num_done:
                    layer_progress.on_layer_done(layer_progress.num_reported)

            return report

        handles = [layer.register_forward_hook(hook_for(index)) for index, layer in enumerate(self.model.layers)]
        try:
            return self.model(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)  # [T, H]
        finally:
            for handle in handles:
                handle.remove()

    def _sampling_tensors(
        self, batch: InputBatch, logits_processors: Mapping[str, Seq[LogitsProcessor]] | None
    ) -> SamplingTensors:
        seqs = batch.sampled_seqs
        cached = self._cached_sampling
        if (
            cached is not None
            and not logits_processors
            and len(cached[0]) == len(seqs)
            and all(map(operator.is_, cached[0], seqs))
        ):
            return cached[1]  # same rows as last step, and nothing in them depends on outputs
        params = [seq.sampling_params for seq in seqs]
        if not logits_processors and uniform_plain(params):  # one setting, nothing per row: no pass over them
            state = SamplingTensors.uniform(params[0], len(seqs), self.vocab_size, self.device)
            self._cached_sampling = (list(seqs), state)
            return state
        processors = None
        if logits_processors:
            processors = [logits_processors.get(seq.seq_id, ()) for seq in seqs]
        penalty_counts = None
        if any(p.has_penalties for p in params):  # counts kept from step to step, not recounted
            penalty_counts = self.penalty_counts.gather(seqs, any(p.has_repetition_penalty for p in params))
        state = SamplingTensors.from_params(
            params,
            vocab_size=self.vocab_size,
            device=self.device,
            output_token_ids=[OutputTokens(seq) for seq in seqs],
            sample_indices=[seq.sample_index for seq in seqs],
            logits_processors=processors,
            eos_token_ids=self.eos_token_ids,
            penalty_counts=penalty_counts,
        )
        # Seeded noise, penalties and min_tokens change with every token; plain rows do not.
        reusable = (state.seeded_rows is None and not state.needs_penalties and not state.row_processors
                    and not state.bias_depends_on_outputs)
        self._cached_sampling = (list(seqs), state) if reusable else None
        return state

    @staticmethod
    def _logprobs(
        seqs: list, host_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, token_ids: list[int]
    ) -> list[TokenLogprob | None] | None:
        if host_logprobs is None:
            return None
        top_ids, top_values, chosen = (tensor.tolist() for tensor in host_logprobs)
        result: list[TokenLogprob | None] = []
        for row, seq in enumerate(seqs):
            k = seq.sampling_params.logprobs
            if k is None:
                result.append(None)
                continue
            result.append(TokenLogprob(token_ids[row], chosen[row], top_ids[row][:k], top_values[row][:k]))
        return result
