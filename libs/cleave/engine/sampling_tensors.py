"""Batch sampling state: per-request `SamplingParams` gathered into device tensors.

Built once per step on the host (one pass over the batch's rows), then consumed by
`Sampler.sample` without further host work. Rows whose options are "off" get neutral
values (top_k = vocab, top_p = 1, penalty 1 / 0), and host-side flags let the sampler skip
whole stages (sort, penalties, noise hashing) that no row in the batch needs. The per-row
options travel in two host -> device copies that do not wait for the device.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cleave.device_copy import tensor_on, to_device
from cleave.engine.counter_rng import keys_to_tensor
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.seed_keys import row_key
from cleave.kernels.token_bitmask import bitmask_words

# processor(output_token_ids, logits_row [V]) -> new logits row [V], or None after editing
# the row in place.
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], "torch.Tensor | None"]


class TokenMask(Protocol):
    """A processor that restricts a row's next token to a set (a grammar): it writes the
    allowed tokens into row `index` of a host [R, ceil(V / 32)] int32 bitmask (bit v % 32 of
    word v // 32 set: token v allowed) and returns True, or returns False when the next
    token is free. The sampler applies every row's bitmask in one kernel."""

    def fill_bitmask(self, output_token_ids: Sequence[int], bitmask: torch.Tensor, index: int) -> bool: ...


@dataclass
class RowProcessors:
    """Logits processors of one batch row and the output tokens they condition on."""

    row: int
    processors: Sequence[LogitsProcessor]
    output_token_ids: Sequence[int]


@dataclass
class SamplingTensors:
    """Sampling options of a batch of B rows over a vocabulary of V tokens.

    Attributes:
        temperatures: [B] float32, 1.0 on greedy rows (they take the argmax instead).
        is_greedy: [B] bool.
        top_k: [B] int64, V where disabled.
        top_p: [B] float32, 1.0 where disabled.
        min_p: [B] float32, 0.0 where disabled.
        repetition_penalties: [B] float32; frequency_penalties / presence_penalties: [B].
        prompt_mask: [B, V] bool, token occurs in the prompt (None: no repetition penalty).
        output_counts: [B, V] int32 occurrences in the output (None: no penalties).
        seeded_rows: [S] int64 rows sampled from counter-based noise (None: no seeded row).
        seeded_keys: [S, 2] int64 (low, high) words of each seeded row's key.
        row_processors: rows that carry logits processors.
        token_bitmask: [R, ceil(V / 32)] int32 allowed tokens of the rows `bitmask_rows` [R]
            int64 constrains this step (structured outputs; None: no row is constrained).
        bias_index: [2, N] int64 (row, token id) of each logit to shift (None: none), and
        bias_values: [N] float32 the shifts: requests' logit_bias, and -inf on the eos and
            stop token ids of rows short of their min_tokens.
        bias_depends_on_outputs: some shift ends with the row's output length (min_tokens).
        num_logprobs: top-k logprobs to return (max over rows), None when no row asks.
        all_greedy / needs_top_k / needs_top_p / needs_min_p / needs_penalties: host flags.
        any_greedy / needs_temperature: whether any row takes the argmax, and whether any
            sampled row's temperature is not 1 (the sampler skips what no row needs).
    """

    vocab_size: int
    temperatures: torch.Tensor
    is_greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    seeded_rows: torch.Tensor | None = None
    seeded_keys: torch.Tensor | None = None
    row_processors: list[RowProcessors] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
    bias_index: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    bias_depends_on_outputs: bool = False
    num_logprobs: int | None = None
    all_greedy: bool = False
    needs_top_k: bool = False
    needs_top_p: bool = False
    needs_min_p: bool = False
    needs_penalties: bool = False
    any_greedy: bool = True
    needs_temperature: bool = True

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        sample_indices: Sequence[int] | None = None,
        logits_processors: Sequence[Sequence[LogitsProcessor]] | None = None,
        eos_token_ids: Collection[int] = (),
        penalty_counts: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> SamplingTensors:
        """Gather one step's rows.

        Args:
            params: options of each row's request.
            vocab_size: V, the logits' last dimension.
            device: where the logits live.
            output_token_ids: tokens each row has generated so far; its length is the step
                index that seeded sampling hashes.
            prompt_token_ids: each row's prompt, read only when a row has a repetition
                penalty.
            sample_indices: which of the request's `n` samples each row is (default 0), so
                seeded samples of one request differ from each other.
            logits_processors: per-row processors (empty sequence for none).
            eos_token_ids: the model's, kept from rows short of their min_tokens.
            penalty_counts: the rows' output counts and prompt masks where the caller keeps
                them (`cleave.engine.penalty_counts`); None: counted here from
                `output_token_ids` and `prompt_token_ids`.
        """
        device = torch.device(device)
        num_rows = len(params)
        greedy = [p.is_greedy for p in params]
        top_k = [_top_k(p, vocab_size) for p in params]
        floats = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        floats += [p.top_p for p in params]
        floats += [p.min_p for p in params]
        floats += [p.repetition_penalty for p in params]
        floats += [p.frequency_penalty for p in params]
        floats += [p.presence_penalty for p in params]
        state = cls._of_columns(floats, top_k + greedy, num_rows, vocab_size, device)
        sampled = [i for i in range(num_rows) if not greedy[i]]
        state.all_greedy = not sampled
        state.any_greedy = len(sampled) < num_rows
        state.needs_temperature = any(floats[i] != 1.0 for i in sampled)
        state.needs_top_k = any(top_k[i] < vocab_size for i in sampled)
        state.needs_top_p = any(params[i].top_p < 1.0 for i in sampled)
        state.needs_min_p = any(params[i].min_p > 0.0 for i in sampled)
        state._init_penalties(params, vocab_size, device, output_token_ids, prompt_token_ids, penalty_counts)
        state._init_seeds(params, sampled, device, output_token_ids, sample_indices)
        state._init_bias(params, device, output_token_ids, eos_token_ids)
        if logits_processors is not None:
            state._init_processors(logits_processors, output_token_ids, device)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        state.num_logprobs = max(requested) if requested else None
        return state

    @classmethod
    def uniform(cls, p: SamplingParams, num_rows: int, vocab_size: int, device: torch.device | str) -> SamplingTensors:
        """What `from_params` builds for `num_rows` rows that all share `p`'s options and need
        no per-row state (`uniform_plain`), without a pass over the rows."""
        greedy = p.is_greedy
        top_k = _top_k(p, vocab_size)
        temperature = 1.0 if greedy else p.temperature
        floats: list[float] = []
        for value in (temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty):
            floats += [value] * num_rows
        state = cls._of_columns(floats, [top_k] * num_rows + [int(greedy)] * num_rows, num_rows, vocab_size,
                                torch.device(device))
        sampled = not greedy
        state.all_greedy = state.any_greedy = greedy
        state.needs_temperature = sampled and temperature != 1.0
        state.needs_top_k = sampled and top_k < vocab_size
        state.needs_top_p = sampled and p.top_p < 1.0
        state.needs_min_p = sampled and p.min_p > 0.0
        return state

    @classmethod
    def _of_columns(cls, floats: list, ints: list, num_rows: int, vocab_size: int,
                    device: torch.device) -> SamplingTensors:
        """A state from its options laid out column after column: `floats` the six float
        options (temperature, top_p, min_p, repetition, frequency, presence), `ints` top_k and
        greediness, each [num_rows]; one copy each."""
        rows = tensor_on(floats, torch.float32, device).view(6, num_rows)
        ints_on = tensor_on(ints, torch.int64, device).view(2, num_rows)
        return cls(
            vocab_size=vocab_size, temperatures=rows[0], is_greedy=ints_on[1] != 0, top_k=ints_on[0], top_p=rows[1],
            min_p=rows[2], repetition_penalties=rows[3], frequency_penalties=rows[4], presence_penalties=rows[5],
        )

    def _init_processors(self, logits_processors, output_token_ids, device):
        masks: list[tuple[int, TokenMask]] = []  # at most one a row
        for row, procs in enumerate(logits_processors):
            plain = [proc for proc in procs if not hasattr(proc, "fill_bitmask")]
            if len(plain) < len(procs) - 1:
                raise ValueError(f"row {row} has more than one token mask")
            masks += [(row, proc) for proc in procs if hasattr(proc, "fill_bitmask")]
            if plain:
                self.row_processors.append(RowProcessors(row, plain, output_token_ids[row]))
        if not masks:
            return
        bitmask = torch.full((len(masks), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        kept = [index for index, (row, mask) in enumerate(masks)
                if mask.fill_bitmask(output_token_ids[row], bitmask, index)]
        if kept:
            self.token_bitmask = to_device(bitmask if len(kept) == len(masks) else bitmask[kept], device)
            self.bitmask_rows = tensor_on([masks[index][0] for index in kept], torch.int64, device)

    def _init_penalties(self, params, vocab_size, device, output_token_ids, prompt_token_ids, penalty_counts):
        self.needs_penalties = any(p.has_penalties for p in params)
        if not self.needs_penalties:
            return
        if penalty_counts is not None:
            self.output_counts, self.prompt_mask = penalty_counts
            return
        self.output_counts = token_counts(output_token_ids, vocab_size, device)
        if prompt_token_ids is not None and any(p.has_repetition_penalty for p in params):
            self.prompt_mask = token_counts(prompt_token_ids, vocab_size, device) > 0

    def _init_bias(self, params, device, output_token_ids, eos_token_ids):
        rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row, p in enumerate(params):
            if p.logit_bias:
                rows += [row] * len(p.logit_bias)
                token_ids += p.logit_bias.keys()
                values += p.logit_bias.values()
            if p.min_tokens and len(output_token_ids[row]) < p.min_tokens:
                kept_out = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
                kept_out = {token_id for token_id in kept_out if token_id < self.vocab_size}  # others never come
                if kept_out:
                    rows += [row] * len(kept_out)
                    token_ids += kept_out
                    values += [float("-inf")] * len(kept_out)
                    self.bias_depends_on_outputs = True
        if rows:
            self.bias_index = tensor_on(rows + token_ids, torch.int64, device).view(2, len(rows))
            self.bias_values = tensor_on(values, torch.float32, device)

    def _init_seeds(self, params, sampled, device, output_token_ids, sample_indices):
        rows = [i for i in sampled if params[i].seed is not None]
        if not rows:
            return
        keys = [
            row_key(
                params[i].seed,
                0 if sample_indices is None else sample_indices[i],
                len(output_token_ids[i]),
            )
            for i in rows
        ]
        self.seeded_rows = tensor_on(rows, torch.int64, device)
        self.seeded_keys = keys_to_tensor(keys, device)


# The options `from_params` reads, a tuple per row (C-level, for `uniform_plain`).
_SAMPLING_OPTIONS = operator.attrgetter(
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed",
    "logprobs", "min_tokens", "logit_bias",
)


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    """A row's top_k, the vocabulary where it is off."""
    return vocab_size if p.top_k <= 0 or p.top_k >= vocab_size else p.top_k


def uniform_plain(params: Sequence[SamplingParams]) -> bool:
    """Whether every row has the first row's sampling options and those need nothing per row:
    no seed, penalty, logit bias, min_tokens or logprobs (a serving batch of one setting; its
    membership changes most steps, so `from_params` runs most steps)."""
    first = params[0] if params else None
    if (first is None or first.seed is not None or first.logprobs is not None or first.min_tokens or first.logit_bias
            or first.has_penalties):
        return False
    options = _SAMPLING_OPTIONS(first)
    return all(map(options.__eq__, map(_SAMPLING_OPTIONS, params)))


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Occurrences of every token id per row: B lists -> [B, V] int32 (one scatter-add)."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    device = torch.device(device)
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.int32, device=device)
    ones = torch.ones(flat.numel(), dtype=torch.int32, device=device)
    counts.index_put_((to_device(rows, device), to_device(flat, device)), ones, accumulate=True)
    return counts
