"""L2 prefetch regions (cleave.kernels.l2_prefetch) and the register GEMV that issues them."""

import pytest
import torch

from cleave.kernels.l2_prefetch import NO_PREFETCH, L2Prefetch
from cleave.kernels.small_linear import small_linear, small_linear_reference
from cleave.model.config import ModelConfig
from cleave.model.fused_decode import DecodeL2Prefetch
from cleave.model.llama import DecoderLayer


def test_regions_must_be_contiguous_and_at_most_two():
    weight = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        L2Prefetch((weight[:, :4],))
    with pytest.raises(ValueError, match="at most 3 regions"):
        L2Prefetch((weight[:1], weight[1:2], weight[2:3], weight[3:4]))


def test_launch_args_count_lines_and_pad_the_unused_slot():
    like = torch.zeros(1, device="meta")
    region = torch.zeros(3, 100, dtype=torch.bfloat16)  # 600 bytes: five 128-byte lines
    prefetch = L2Prefetch((region,), evict_last=True)
    assert prefetch.num_bytes == 600
    # off the GPU no region is passed: the kernel compiles without the prefetch
    tensors, lines, regions, evict_last = prefetch.launch_args(region)
    assert (lines, regions, evict_last) == ((0, 0, 0), 0, True)
    assert all(tensor is region for tensor in tensors)
    assert NO_PREFETCH.launch_args(like)[1:3] == ((0, 0, 0), 0)


def test_parse_names_every_setting():
    assert DecodeL2Prefetch.parse("off") == DecodeL2Prefetch()
    assert DecodeL2Prefetch.parse("16") == DecodeL2Prefetch(16 << 20)
    assert DecodeL2Prefetch.parse("0.5:qkv:last") == DecodeL2Prefetch(1 << 19, next_qkv=True, evict_last=True)
    with pytest.raises(ValueError, match="'off' or"):
        DecodeL2Prefetch.parse("16:down")


def test_regions_are_gate_up_leading_rows_of_each_half_and_the_next_qkv():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layer, next_layer = DecoderLayer(config, layer=0), DecoderLayer(config, layer=1)
    weight = layer.mlp.gate_up_proj.weight  # [192, 64] fp32: 256 bytes a row
    assert DecodeL2Prefetch().regions(layer, next_layer) is NO_PREFETCH  # off by default
    first, second = DecodeL2Prefetch(gate_up_bytes=10 * 512).regions(layer, next_layer).regions  # ten rows a half
    assert first.data_ptr() == weight.data_ptr() and first.shape == (10, 64)
    assert second.data_ptr() == weight[96].data_ptr() and second.shape == (10, 64)
    whole = DecodeL2Prefetch(gate_up_bytes=1 << 30, next_qkv=True, evict_last=True).regions(layer, next_layer)
    assert [region.shape[0] for region in whole.regions] == [96, 96, 128]  # each half whole, then q, k and v rows
    assert whole.regions[2] is next_layer.self_attn.qkv_proj.weight and whole.evict_last
    assert DecodeL2Prefetch(next_qkv=True).regions(next_layer, None) is NO_PREFETCH  # the last layer


def test_only_the_register_gemv_takes_a_prefetch():
    x, weight = torch.zeros(2, 8), torch.zeros(8, 8)
    with pytest.raises(ValueError, match="l2_prefetch"):
        small_linear(x, weight, impl="triton", kernel="dot", l2_prefetch=L2Prefetch((weight,)))


@pytest.mark.gpu
@pytest.mark.parametrize("evict_last", [False, True])
def test_gpu_prefetching_changes_no_bit_of_the_projection(evict_last):
    # Llama-3.2-1B's o projection at batch 1, pulling 8 MB of its gate_up weight into L2
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    weight = torch.randn(2048, 2048, device="cuda", generator=generator).to(torch.bfloat16) * 0.02
    residual = torch.randn(1, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    gate_up = torch.randn(16384, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    prefetch = L2Prefetch((gate_up[:1024], gate_up[8192:9216]), evict_last=evict_last)
    plain, prefetched = residual.clone(), residual.clone()
    small_linear(x, weight, add_to=plain)
    small_linear(x, weight, add_to=prefetched, l2_prefetch=prefetch)
    torch.cuda.synchronize()
    assert torch.equal(plain, prefetched)
    expected = residual.clone()
    small_linear_reference(x, weight, add_to=expected)
    torch.testing.assert_close(prefetched.float(), expected.float(), rtol=2e-2, atol=2e-2)
