"""The PDL option flows from the configuration through the model into every kernel call."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from cleave.config import worker_config
from cleave.engine.llm import build_engine_config
from cleave.kernels import rotary_attention
from cleave.kv.metadata import AttentionMetadata
from cleave.model import fused_decode, llama
from cleave.model.llama import CausalLM, allocate_kv_cache
from cleave.worker import engine_config_from_worker
from tests.graphs.test_runner import tiny_config

BLOCK_SIZE = 16

# (module, function name) of every kernel the model, its decode layouts and the attention op call
KERNEL_CALLS = (
    (llama, "embedding"), (llama, "rms_norm"), (llama, "fused_add_rms_norm"), (llama, "silu_and_mul"),
    (llama, "rotary_paged_attention"),
    (fused_decode, "small_linear"), (fused_decode, "paged_attention"), (fused_decode, "paged_decode_attention"),
    (fused_decode, "silu_and_mul"),
    (rotary_attention, "paged_attention"), (rotary_attention, "paged_decode_attention"),
    (rotary_attention, "rotary_write_kv"),
)


@pytest.fixture
def kernel_pdl(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """(function, its `pdl` argument or "missing") for every kernel call, in call order."""
    calls: list[tuple[str, object]] = []
    for module, name in KERNEL_CALLS:
        original = getattr(module, name)

        @functools.wraps(original)
        def recording(*args, _original=original, _name=f"{module.__name__}.{name}", **kwargs):
            calls.append((_name, kwargs.get("pdl", "missing")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return calls


def _step(model: CausalLM, kv_cache: torch.Tensor, start: int, num_tokens: int) -> None:
    end = start + num_tokens
    metadata = AttentionMetadata.build([num_tokens], [end], [[1]], BLOCK_SIZE)
    model(torch.arange(start, end) % model.config.vocab_size, torch.arange(start, end), kv_cache, metadata)


@torch.no_grad()
def test_model_built_without_pdl_passes_pdl_false_to_every_kernel(kernel_pdl):
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(), num_hidden_layers=1)
    model = CausalLM(config, impl="triton", pdl=False).eval()
    kv_cache = allocate_kv_cache(config, 2, BLOCK_SIZE)
    _step(model, kv_cache, 0, 3)  # prefill: the model's own layers
    _step(model, kv_cache, 3, 1)  # GEMV layout
    model.decode_gemv_max_tokens = 0
    _step(model, kv_cache, 4, 1)  # unfused layers, rotary inside the decode attention kernel
    model.fold_norm_weights()
    _step(model, kv_cache, 5, 1)  # deferred-norm layout

    called = {name for name, _ in kernel_pdl}
    assert called == {f"{module.__name__}.{name}" for module, name in KERNEL_CALLS}
    assert {name for name, pdl in kernel_pdl if pdl is not False} == set()


def test_pdl_flag_reaches_the_engine_config(tiny_checkpoints):
    assert engine_config_from_worker(worker_config("decode", ["--no-pdl"], {"CLEAVE_DEVICE": "cpu"})).pdl is False
    assert engine_config_from_worker(worker_config("decode", [], {"CLEAVE_DEVICE": "cpu"})).pdl is True
    assert build_engine_config(tiny_checkpoints["llama"], pdl=False, device="cpu").pdl is False
    assert build_engine_config(tiny_checkpoints["llama"], device="cpu").pdl is True


def test_packed_experts_flag_reaches_the_engine_config(tiny_checkpoints):
    def packed(*flags: str) -> bool:
        return engine_config_from_worker(worker_config("prefill", list(flags), {"CLEAVE_DEVICE": "cpu"})).packed_experts

    assert packed("--packed-experts") is True and packed() is False and packed("--no-packed-experts") is False
    assert build_engine_config(tiny_checkpoints["llama"], packed_experts=True, device="cpu").packed_experts is True
    from cleave.cli.main import build_parser

    assert build_parser().parse_args(["generate", "hi", "--packed-experts"]).packed_experts is True
    assert build_parser().parse_args(["generate", "hi"]).packed_experts is False



def test_packed_experts_on_a_checkpoint_without_mxfp4_say_so(tiny_checkpoints):
    import structlog

    from cleave.engine.llm import LLM

    with structlog.testing.capture_logs() as logs:
        llm = LLM(tiny_checkpoints["llama"], device="cpu", dtype="float32", max_model_len=64, packed_experts=True)
    assert not llm.engine.model.config.packed_experts
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == ["packed_experts_unused"]


def prefill_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of every prefill-kernel launch `paged_attention` makes from now on."""
    from cleave.kernels import attention as attention_ops

    calls: list[dict] = []
    original = attention_ops.paged_prefill_attention

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_ops, "paged_prefill_attention", recording)
    return calls


def triton_model() -> tuple:
    """The tiny config and a model of it on the Triton kernels (the interpreter here)."""
    torch.manual_seed(0)
    config = tiny_config()
    return config, CausalLM(config, impl="triton").eval()


@torch.no_grad()
def test_each_layers_prefill_launch_reaches_the_prefill_kernel_and_keeps_the_answer(monkeypatch):
    """`Attention.prefill_launch` (set per layer, as benchmarks A/B it) is what the prefill
    kernel is launched with; packed heads, heavy blocks first and the unmasked walk below the
    diagonal give the default launch's hidden states, over a cached prefix too."""
    from cleave.kernels.attention_prefill import PrefillLaunch

    calls = prefill_kernel_calls(monkeypatch)
    config, model = triton_model()
    tokens = torch.arange(40) % config.vocab_size

    def prefill_hidden() -> torch.Tensor:
        kv_cache = allocate_kv_cache(config, 4, BLOCK_SIZE)
        first = AttentionMetadata.build([24], [24], [[1, 2, 3]], BLOCK_SIZE)
        model(tokens[:24], torch.arange(24), kv_cache, first)
        rest = AttentionMetadata.build([16], [40], [[1, 2, 3]], BLOCK_SIZE)  # over the cached 24
        return model(tokens[24:], torch.arange(24, 40), kv_cache, rest)

    def launches() -> list[dict]:
        return [{key: call[key] for key in ("block_m", "pack_gqa", "heavy_first", "causal_split")} for call in calls]

    default = prefill_hidden()
    # the tiny model's 16-wide heads take the launch tuned for heads of up to 64
    assert launches()[-1] == {"block_m": 128, "pack_gqa": False, "heavy_first": True, "causal_split": True}
    options = PrefillLaunch(block_m=16, block_n=16, pack_gqa=True, heavy_first=True, causal_split=True)
    for layer in model.layers:
        layer.self_attn.prefill_launch = options
    calls.clear()
    torch.testing.assert_close(prefill_hidden(), default, atol=2e-5, rtol=1e-5)
    assert launches() == [{"block_m": 16, "pack_gqa": True, "heavy_first": True, "causal_split": True}] * 4


@torch.no_grad()
def test_q_k_norms_and_rotary_outside_the_decode_kernel_keep_the_answer():
    """`Attention.rotary_in_decode_attention` off (as `bench/moe.py --rotary-in-attention off`
    times it): a q/k-normed model's decode step runs the head norms, the rotary embedding and
    the KV write as kernels of their own before the decode kernel, with the hidden states and
    the written KV of the kernel that does them all itself."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(), qk_norm=True)
    model = CausalLM(config, impl="triton").eval()
    for layer in model.layers:  # norm weights away from one, so a skipped norm shows
        layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
        layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    tokens = torch.arange(21) % config.vocab_size

    def decode_step(rotary_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in model.layers:
            layer.self_attn.rotary_in_decode_attention = rotary_in_kernel
        kv_cache = allocate_kv_cache(config, 3, BLOCK_SIZE)
        model(tokens[:20], torch.arange(20), kv_cache, AttentionMetadata.build([20], [20], [[1, 2]], BLOCK_SIZE))
        decode = AttentionMetadata.build([1], [21], [[1, 2]], BLOCK_SIZE)
        return model(tokens[20:], torch.tensor([20]), kv_cache, decode), kv_cache

    fused_hidden, fused_cache = decode_step(True)
    separate_hidden, separate_cache = decode_step(False)
    torch.testing.assert_close(separate_hidden, fused_hidden, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(separate_cache, fused_cache, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_decode_rows_of_a_mixed_step_on_the_decode_kernel_keep_the_answer(monkeypatch):
    """`PrefillLaunch(decode_rows=True)` (the default): in a step that decodes one sequence and
    prefills another, the decode goes to the decode kernel and the prompt to the prefill
    kernel (from the second sequence on), with the hidden states of the whole batch on the
    prefill kernel."""
    from cleave.kernels.attention_prefill import PrefillLaunch

    calls = prefill_kernel_calls(monkeypatch)
    config, model = triton_model()
    tokens = torch.arange(37) % config.vocab_size

    def mixed_step_hidden() -> torch.Tensor:
        kv_cache = allocate_kv_cache(config, 4, BLOCK_SIZE)
        model(tokens[:20], torch.arange(20), kv_cache, AttentionMetadata.build([20], [20], [[1, 2]], BLOCK_SIZE))
        mixed = AttentionMetadata.build([1, 16], [21, 16], [[1, 2], [3]], BLOCK_SIZE)  # decode, then a prompt
        return model(tokens[20:], torch.cat([torch.tensor([20]), torch.arange(16)]), kv_cache, mixed)

    for layer in model.layers:
        layer.self_attn.prefill_launch = PrefillLaunch(decode_rows=False)
    whole = mixed_step_hidden()
    for layer in model.layers:
        layer.self_attn.prefill_launch = PrefillLaunch()
    calls.clear()
    torch.testing.assert_close(mixed_step_hidden(), whole, atol=2e-5, rtol=1e-5)
    num_layers = len(model.layers)
    assert [call["first_seq"] for call in calls] == [0] * num_layers + [1] * num_layers  # lone prompt, mixed step


@torch.no_grad()
def test_start_up_warms_a_layers_mixed_decode_variants_and_leaves_the_cache(monkeypatch):
    """`Attention.warm_mixed_decodes`: one decode-kernel launch per variant a mixed step of up
    to max_num_seqs decodes can take, on the layer's own query layout; none with `decode_rows`
    off."""
    from cleave.kernels import attention as attention_module
    from cleave.kernels.attention_prefill import PrefillLaunch

    config, model = triton_model()
    layer = model.layers[0].self_attn
    kv_cache = allocate_kv_cache(config, 4, BLOCK_SIZE)[0]
    before = kv_cache.clone()
    launched = []
    original = attention_module.paged_decode_attention

    def counting(query, cache, metadata, scale, **kwargs):  # noqa: ANN001, ANN003, ANN202
        launched.append((query.stride(0), metadata.num_seqs, kwargs["num_splits"]))
        return original(query, cache, metadata, scale, **kwargs)

    monkeypatch.setattr(attention_module, "paged_decode_attention", counting)
    assert layer.warm_mixed_decodes(kv_cache, 3) == 2
    qkv_width = layer.q_size + 2 * layer.kv_size
    assert [(stride, seqs) for stride, seqs, _ in launched] == [(qkv_width, 1), (qkv_width, 2)]
    assert torch.equal(kv_cache, before)
    layer.prefill_launch = PrefillLaunch(decode_rows=False)
    assert layer.warm_mixed_decodes(kv_cache, 3) == 0
