"""MXFP4 dequantisation against the format's definition, and gpt-oss experts loaded from
MXFP4 blocks and scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cleave.kernels.mxfp4 import dequantize_mxfp4
from cleave.model.loader import CheckpointError, load_model
from cleave.testing.tiny_models import write_mxfp4_twin, write_tiny_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pack(codes: list[int]) -> torch.Tensor:
    """32 nibble codes -> 16 bytes, the even element in the low nibble."""
    return torch.tensor([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)], dtype=torch.uint8)


def test_hand_made_blocks_dequantise_per_the_definition():
    codes_a = list(range(16)) * 2  # every E2M1 code, sign bit included
    codes_b = [7, 15, 1, 9] * 8
    blocks = torch.stack([_pack(codes_a), _pack(codes_b)])[None]  # [1, G=2, 16]
    scales = torch.tensor([[128, 124]], dtype=torch.uint8)  # 2^1 and 2^-3
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (1, 64)

    def value(code: int, exponent: int) -> float:
        return (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * 2.0**exponent

    expected = [value(c, 1) for c in codes_a] + [value(c, -3) for c in codes_b]
    assert out[0].tolist() == expected
    assert out[0, 1].item() == 1.0 and out[0, 15].item() == -12.0 and out[0, 32].item() == 0.75
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), out)  # exact in bf16 too


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))


def _random_mxfp4(rows: tuple[int, ...], columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(123, 129, (*rows, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_matches_transformers_dequantiser():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 8), 64, seed=1)  # [E, out, G, 16]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours.transpose(1, 2), theirs)


@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same gpt-oss weights twice: experts as MXFP4 blocks/scales, and dequantised."""
    root = tmp_path_factory.mktemp("mxfp4")
    dense = write_tiny_checkpoint(root / "dense", "gpt-oss", seed=5)
    return dense, write_mxfp4_twin(dense, root / "quantized", seed=10)


def test_gpt_oss_mxfp4_experts_load_as_their_dequantised_weights(gpt_oss_pair):
    dense_path, quantized_path = gpt_oss_pair
    dense, quantized = load_model(dense_path, impl="torch"), load_model(quantized_path, impl="torch")
    assert quantized.config.quantization == "mxfp4"
    dense_params = dict(dense.named_parameters())
    for name, param in quantized.named_parameters():
        assert torch.equal(param, dense_params[name]), name
    w13 = quantized.layers[0].mlp.experts.w13
    assert w13.abs().max() >= 1.0 and (w13 == 0).float().mean() < 0.5  # real weights, not zeros

    import transformers  # the dense twin in transformers: logits agree

    hf = transformers.AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    from tests.model.test_llama_parity import TOLERANCE, prompt_ids, run_chunks

    input_ids = prompt_ids(hf.config.vocab_size, 16)
    with torch.no_grad():
        expected = hf(input_ids[None]).logits[0].float()
        assert (run_chunks(quantized, input_ids, [16]) - expected).abs().max().item() <= TOLERANCE


def test_a_lone_mxfp4_half_is_reported(gpt_oss_pair, tmp_path):
    _, quantized_path = gpt_oss_pair
    tensors = load_file(quantized_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((quantized_path / name).read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_blocks"):
        load_model(tmp_path, impl="torch")


def test_packed_experts_keep_the_checkpoint_bytes(gpt_oss_pair):
    dense_path, quantized_path = gpt_oss_pair
    dense = load_model(dense_path, impl="torch")
    packed = load_model(quantized_path, impl="torch", packed_experts=True)
    assert packed.config.packed_experts and not dense.config.packed_experts
    for layer, dense_layer in zip(packed.layers, dense.layers):
        experts, dense_experts = layer.mlp.experts, dense_layer.mlp.experts
        assert experts.w13_blocks.dtype == experts.w2_scales.dtype == torch.uint8
        assert "w13" not in dict(experts.named_parameters())
        # gate rows then up rows, as the dequantising load lays them out
        assert torch.equal(experts.gate_up.dequantize(torch.float32), dense_experts.w13)
        assert torch.equal(experts.down.dequantize(torch.float32), dense_experts.w2)
        assert torch.equal(experts.w13_bias, dense_experts.w13_bias)
    packed_bytes = sum(p.numel() for name, p in packed.named_parameters() if "experts.w" in name and "bias" not in name)
    dense_bytes = sum(4 * p.numel() for name, p in dense.named_parameters() if name.endswith(("experts.w13", "experts.w2")))
    assert packed_bytes * 7 < dense_bytes  # 4.25 bits a value against fp32's 32


def test_packed_experts_give_the_dequantised_models_logits(gpt_oss_pair):
    from tests.model.test_llama_parity import TOLERANCE, prompt_ids, run_chunks

    dense_path, quantized_path = gpt_oss_pair
    input_ids = prompt_ids(load_model(dense_path, impl="torch").config.vocab_size, 16)
    with torch.no_grad():
        # the torch path dequantises: the same sums exactly
        dense, packed = load_model(dense_path, impl="torch"), load_model(quantized_path, impl="torch",
                                                                         packed_experts=True)
        assert torch.equal(run_chunks(packed, input_ids, [16]), run_chunks(dense, input_ids, [16]))
        # the kernels: a 12-token chunk through the grouped GEMMs, then 1-, 1- and 2-token
        # decode-sized chunks through the GEMV layout's per-entry expert GEMVs
        dense, packed = load_model(dense_path, impl="triton"), load_model(quantized_path, impl="triton",
                                                                          packed_experts=True)
        expected = run_chunks(dense, input_ids, [12, 1, 1, 2])
        assert (run_chunks(packed, input_ids, [12, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE


def test_packing_is_for_mxfp4_checkpoints_only(gpt_oss_pair):
    dense_path, _ = gpt_oss_pair
    assert not load_model(dense_path, impl="torch", packed_experts=True).config.packed_experts  # nothing to pack
    config = load_model(dense_path, impl="torch").config
    from dataclasses import replace

    with pytest.raises(ValueError, match="packed_experts needs MXFP4 experts"):
        replace(config, packed_experts=True)
