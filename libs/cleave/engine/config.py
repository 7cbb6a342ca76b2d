"""Typed engine configuration, read once at start-up and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.generation.reasoning_formats import REASONING_PARSERS

# CacheConfig.kv_cache_dtype's values (`cleave.kernels.kv_cache_dtype` maps them to torch dtypes)
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    Attributes:
        max_num_batched_tokens: tokens (prefill chunks plus decode tokens) in one step.
        max_num_seqs: sequences in one step, and running at once.
        max_model_len: longest sequence (prompt plus output); longer prompts are rejected and
            a sequence reaching it finishes with FINISHED_LENGTH.
        enable_chunked_prefill: split prompts longer than the step's token budget across steps.
            Without it a prompt runs in one step, so max_num_batched_tokens must cover
            max_model_len.
        long_prefill_token_threshold: a prompt with more tokens than this left to compute
            gets at most this many per step before shorter prompts are admitted, so a chat
            that arrives behind a 32k-token prompt starts in the next step instead of after
            it; the budget the shorter prompts leave goes back to it in the same step, so
            alone it runs at full speed. 0: off (prompts take the budget in arrival order).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 32768
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold must be >= 0 (0: off), got {self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}); enable chunked prefill or raise the budget"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Shape and policy of the paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the cache tensor including the reserved null block 0; None
            means "size from free device memory" (the model runner decides).
        enable_prefix_caching: reuse full blocks whose chained hash matches.
        gpu_memory_utilization: fraction of device memory the runner may fill with weights,
            activations and KV when num_blocks is None.
        pair_window_layers: a model mixing full-attention layers with as many sliding-window
            layers (gpt-oss) pairs them in the cache, the sliding ones over window tables
            that drop pages behind the window (cleave.kv.groups); False keeps every block.
        kv_cache_dtype: the cache's element type: "auto" is the model's dtype; "fp8" stores
            float8 e4m3 with a scale of 1.0, clamped to +-448 (`cleave.kernels.kv_cache_dtype`):
            half the bytes of bf16, so twice the tokens fit, at some cost in precision.
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    pair_window_layers: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"CacheConfig.block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"CacheConfig.num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"CacheConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (colocated, prefill-only or decode-only) is started with.

    Attributes:
        model: a local directory or hub id of the weights.
        dtype: weight dtype name ("bfloat16", "float16", "float32"), the KV cache's too unless
            `cache.kv_cache_dtype` says otherwise.
        device: torch device string.
        seed: base seed for sampling.
        enforce_eager: run the decode forward eagerly instead of replaying CUDA graphs.
        detokenize: make text per token (detokenizer, stop strings, reasoning split). Off,
            outputs carry token ids only; eos, stop token ids and max_tokens still end a
            sample, stop strings do not (the caller matches them on its own text), and
            thinking tokens are counted by the think tags' token ids.
        overlap_steps: launch step N+1 on the device before processing step N's tokens on
            the host (outputs then lag one `step()` call behind the device). None: on for
            CUDA, off elsewhere (on CPU nothing runs while the host works). False is the
            plain synchronous loop, for debugging.
        pdl: launch the decode kernels with programmatic dependent launch where the device
            has it (Hopper and later; `cleave.kernels.pdl`). False for A/B runs and debugging.
        tensor_parallel_size: ranks the model is split over (`cleave.parallel`), one process
            and device each, all running this engine in step; 1 builds the plain model.
        reasoning_parser: the thinking tags (`cleave.generation.reasoning_formats`): auto
            (cleave_config.json, else recognised from the checkpoint), none or a named format;
            the gateway must be given the same.
        stream_interval: steps between reports of a running request's new tokens: 1 reports
            every step's tokens; N > 1 gathers a running request's tokens into one report
            every N steps, which saves the host work of N - 1 outputs (and, in a worker, of
            their stream deltas and messages) per request at the cost of burstier streams.
            A request's first report, and a sample's end, are never held back.
        stagger_reports: with a stream interval N, request k (in arrival order) reports on
            the steps where (step + k) % N == 0 instead of every request on the same step, so
            the text and outputs of a reporting step spread over N steps (a host that keeps
            each step's work under the device's leaves no bubble once every N steps); the
            same tokens and text, reported at other steps.
        prefill_graph_max_tokens: a step that prefills one sequence's at most this many new
            tokens replays a CUDA graph captured for its token-count bucket
            (`cleave.graphs.prefill`) instead of launching every kernel from Python; 0 (the
            default) prefills eagerly. Off CUDA the padded forward runs eagerly (for tests).
        packed_experts: keep a checkpoint's MXFP4 experts (gpt-oss) packed in device memory,
            read and decoded by the expert kernels (`cleave.kernels.mxfp4`): a quarter of the
            bf16 bytes. False dequantises them to the model's dtype at load. Other
            checkpoints load the same either way.
    """

    model: str
    dtype: str = "bfloat16"
    device: str = "cuda"
    seed: int = 0
    enforce_eager: bool = False
    detokenize: bool = True
    overlap_steps: bool | None = None
    pdl: bool = True
    tensor_parallel_size: int = 1
    reasoning_parser: str = "auto"
    stream_interval: int = 1
    stagger_reports: bool = False
    prefill_graph_max_tokens: int = 0
    packed_experts: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"EngineConfig.stream_interval must be >= 1, got {self.stream_interval}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"EngineConfig.prefill_graph_max_tokens must be >= 0, got {self.prefill_graph_max_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"EngineConfig.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    @property
    def overlaps_steps(self) -> bool:
        """Whether the engine overlaps steps (`overlap_steps` resolved for the device)."""
        if self.overlap_steps is None:
            return self.device.startswith("cuda")
        return self.overlap_steps
