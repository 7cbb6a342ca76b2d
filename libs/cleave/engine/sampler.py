"""Batched on-device sampling: logits [B, V] -> next token ids [B].

One call runs the whole batch with torch ops; the only host work is the per-row logits
processors (rows that have any) and building `SamplingTensors` beforehand. Stages:

    raw logits -> logprobs (log_softmax of the raw logits, if requested)
               -> logits processors (per row, e.g. thinking budgets)
               -> allowed-token bitmasks (structured outputs; one kernel for the batch)
               -> logit biases (logit_bias; -inf on eos / stop ids before min_tokens)
               -> repetition / frequency / presence penalties
               -> greedy rows: argmax
               -> other rows: / temperature -> top-k -> top-p -> min-p -> softmax
                  -> exponential race argmax(probs / q), q ~ Exp(1)

The exponential race is an exact sampler of `probs`; its noise q comes from the Sampler's
own generator for unseeded rows and from a counter-based hash of (seed, sample index, step,
token id) for seeded rows, so a seeded row's tokens do not depend on the rest of the batch.

On the Triton kernels (`impl`) a batch whose rows keep their whole distribution (no
top-k, top-p or min-p) races in one kernel from the processed logits instead
(`cleave.kernels.race_sample`: temperature, noise and argmax in one pass): every row then
hashes its noise from a key, the seeded rows' own and, for the others, 64 random bits a
row drawn from the Sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cleave.engine.counter_rng import exponential_noise
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.kernels.dispatch import Impl, use_triton
from cleave.kernels.race_sample import race_sample
from cleave.kernels.token_bitmask import apply_token_bitmask

# Exp(1) draws of exactly 0 would turn a zero-probability token into 0/0 = NaN, which
# argmax treats as the maximum.
_MIN_NOISE = 1e-20


@dataclass
class SampledLogprobs:
    """Logprobs of a step, from log_softmax of the *raw* model logits (before processors,
    penalties, temperature and truncation), as OpenAI reports them.

    Attributes:
        top_token_ids: [B, K] int64 most likely token ids, K = max requested over rows
            (a row uses its own first k columns).
        top_logprobs: [B, K] float32 their logprobs.
        sampled_logprobs: [B] float32 logprob of the token each row sampled.
    """

    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor


@dataclass
class SamplerOutput:
    """Result of one sampling step; tensors stay on the logits' device.

    Attributes:
        token_ids: [B] int64 sampled token per row.
        logprobs: present when any row asked for logprobs.
    """

    token_ids: torch.Tensor
    logprobs: SampledLogprobs | None = None


class Sampler:
    """Samples a batch of next tokens on the logits' device.

    Args:
        seed: seeds the generator of unseeded rows (None: nondeterministic).
        impl: "auto" races in one Triton kernel on CUDA (see the module docstring),
            "triton" wherever triton runs (the interpreter on CPU), "torch" never.
    """

    def __init__(self, seed: int | None = None, impl: Impl = "auto") -> None:
        self._seed = seed
        self._impl = impl
        self._generators: dict[torch.device, torch.Generator] = {}
        self._race_counters: dict[torch.device, torch.Tensor] = {}  # zeroed between race launches

    def sample(self, logits: torch.Tensor, state: SamplingTensors) -> SamplerOutput:
        """logits: [B, V] float32 (not modified). Returns the batch's next tokens."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if state.num_logprobs is not None else None
        logits = apply_logits_processors(logits, state)
        if state.token_bitmask is not None:  # structured outputs (a new tensor: `logits` may be the caller's)
            logits = apply_token_bitmask(logits, state.token_bitmask, state.bitmask_rows)
        if state.bias_index is not None:  # logit_bias, min_tokens (a new tensor: `logits` may be the caller's)
            logits = logits.index_put((state.bias_index[0], state.bias_index[1]), state.bias_values, accumulate=True)
        if state.needs_penalties:
            logits = apply_penalties(logits, state)
        if state.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [B]
        elif self._races_in_one_kernel(logits, state):
            token_ids = race_sample(logits, state.temperatures, state.is_greedy, self._race_keys(logits, state),
                                    self._race_counter_buffer(logits.device, logits.shape[0]))
        else:
            token_ids = self._race(self.probabilities(logits, state), state)
            if state.any_greedy:
                token_ids = torch.where(state.is_greedy, logits.argmax(dim=-1), token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(raw_logprobs, token_ids, state))

    @staticmethod
    def probabilities(logits: torch.Tensor, state: SamplingTensors) -> torch.Tensor:
        """The distribution non-greedy rows sample from: [B, V] -> [B, V] float32."""
        if state.needs_temperature:  # x / 1.0 is x: rows at temperature 1 need no division
            logits = logits / state.temperatures[:, None]
        logits = apply_top_k_top_p(
            logits,
            state.top_k if state.needs_top_k else None,
            state.top_p if state.needs_top_p else None,
        )
        probs = torch.softmax(logits, dim=-1)
        if state.needs_min_p:
            probs = apply_min_p(probs, state.min_p)
        return probs

    def warm(self, vocab_size: int, device: torch.device) -> None:
        """Compile the one-kernel race now (one variant serves every batch), not in the first
        step that samples; draws nothing from this sampler's generator."""
        logits = torch.zeros(2, vocab_size, dtype=torch.float32, device=device)
        if not use_triton(logits, self._impl):
            return
        keys = torch.zeros(2, 2, dtype=torch.int64, device=device)
        race_sample(logits, torch.ones(2, device=device), torch.zeros(2, dtype=torch.bool, device=device), keys,
                    self._race_counter_buffer(device, 2))

    def _races_in_one_kernel(self, logits: torch.Tensor, state: SamplingTensors) -> bool:
        return (use_triton(logits, self._impl) and not state.needs_top_k and not state.needs_top_p
                and not state.needs_min_p)

    def _race_keys(self, logits: torch.Tensor, state: SamplingTensors) -> torch.Tensor:
        """[B, 2] int64 noise keys: the seeded rows' own, random words for the others."""
        keys = torch.randint(0, 1 << 32, (logits.shape[0], 2), dtype=torch.int64, device=logits.device,
                             generator=self._generator(logits.device))
        if state.seeded_rows is not None:
            keys[state.seeded_rows] = state.seeded_keys
        return keys

    def _race_counter_buffer(self, device: torch.device, num_rows: int) -> torch.Tensor:
        counters = self._race_counters.get(device)
        if counters is None or counters.numel() < num_rows:
            counters = torch.zeros(max(num_rows, 256), dtype=torch.int32, device=device)
            self._race_counters[device] = counters
        return counters

    def _race(self, probs: torch.Tensor, state: SamplingTensors) -> torch.Tensor:
        # probs: [B, V]; q: [B, V] Exp(1) noise; argmax(probs / q) ~ Categorical(probs).
        num_seeded = 0 if state.seeded_rows is None else state.seeded_rows.numel()
        if num_seeded == probs.shape[0]:
            noise = exponential_noise(state.seeded_keys, probs.shape[1])
        else:
            noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
            if num_seeded:
                noise[state.seeded_rows] = exponential_noise(state.seeded_keys, probs.shape[1])
        return (probs / noise.clamp_min_(_MIN_NOISE)).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def apply_logits_processors(logits: torch.Tensor, state: SamplingTensors) -> torch.Tensor:
    """Run each row's processors on its logits row; copies `logits` first if any run."""
    if not state.row_processors:
        return logits
    logits = logits.clone()
    for entry in state.row_processors:
        for processor in entry.processors:
            row = processor(entry.output_token_ids, logits[entry.row])
            if row is not None:
                logits[entry.row] = row
    return logits


def apply_penalties(logits: torch.Tensor, state: SamplingTensors) -> torch.Tensor:
    """Repetition (HF: positive logits / p, negative * p, over prompt + output tokens), then
    frequency and presence (OpenAI: - f * count - p * [count > 0], output tokens only).

    logits: [B, V] -> [B, V].
    """
    counts = state.output_counts  # [B, V] int32
    seen_in_output = counts > 0  # [B, V]
    seen = seen_in_output if state.prompt_mask is None else seen_in_output | state.prompt_mask
    penalty = torch.where(seen, state.repetition_penalties[:, None], 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - state.frequency_penalties[:, None] * counts
    return logits - state.presence_penalties[:, None] * seen_in_output


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its nucleus, to -inf.

    logits: [B, V]; top_k: [B] int64 (V = off); top_p: [B] float32 (1 = off). The nucleus
    is the smallest prefix of the top-k tokens (sorted by probability, renormalized over
    the top-k) whose mass reaches top_p; the most likely token is always kept.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device)  # [V]
        sorted_logits = sorted_logits.masked_fill(positions[None, :] >= top_k[:, None], -torch.inf)
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [B, V]
        outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(outside, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero probabilities below min_p * the row's max and renormalize: [B, V] -> [B, V]."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _logprobs(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, state: SamplingTensors
) -> SampledLogprobs | None:
    if raw_logprobs is None:
        return None
    sampled = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [B]
    top_logprobs, top_ids = raw_logprobs.topk(state.num_logprobs, dim=-1)  # [B, K]
    return SampledLogprobs(top_token_ids=top_ids, top_logprobs=top_logprobs, sampled_logprobs=sampled)
