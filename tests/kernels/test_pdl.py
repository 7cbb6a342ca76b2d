"""Programmatic dependent launch: off on CPU, and on the GPU chains of PDL kernels (eager and
CUDA-graph replayed) give bit-identical results to plain launches."""

import pytest
import torch

from cleave.kernels.pdl import pdl_enabled
from cleave.kernels.small_linear import small_linear


def test_pdl_is_off_for_cpu_tensors():
    assert not pdl_enabled(torch.zeros(1))
    assert not pdl_enabled(torch.zeros(1), enabled=False)


def _decode_block(residual, weights, pdl):
    norm, qkv, o, gate_up, down = weights
    for _ in range(3):
        act = small_linear(residual, qkv, norm_weight=norm, pdl=pdl)
        small_linear(act[:, : o.shape[1]], o, add_to=residual, pdl=pdl)
        act = small_linear(residual, gate_up, gated=True, norm_weight=norm, pdl=pdl)
        small_linear(act, down, add_to=residual, pdl=pdl)
    return residual


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_pdl_chain_matches_plain_launches_bitwise(rows):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    hidden, inter = 1024, 2816
    # input norm, qkv, o, gate_up, down
    weights = (1 + randn(hidden), randn(3 * hidden, hidden), randn(hidden, hidden),
               randn(2 * inter, hidden), randn(hidden, inter))
    start = randn(rows, hidden, scale=1.0)

    expected = _decode_block(start.clone(), weights, pdl=False)
    eager = _decode_block(start.clone(), weights, pdl=True)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)

    static = start.clone()
    _decode_block(static.clone(), weights, pdl=True)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_block(static, weights, pdl=True)
    for _ in range(2):  # each replay continues from the last one's residual
        static.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, expected, rtol=0, atol=0)
