"""Expert parallelism inside the tensor-parallel group, over 2 gloo ranks on CPU: the layout's
expert split, each rank loading only its experts, the all-to-all dispatch and combine against
the whole `SparseMoeBlock`, and Qwen3-MoE / gpt-oss at TP=2 against TP=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.model.config import ModelConfig
from cleave.model.loader import load_model
from cleave.parallel.group import TensorParallelGroup
from cleave.parallel.sharding import TensorParallelLayout
from cleave.testing.tiny_models import write_mxfp4_twin, write_tiny_checkpoint
from tests.parallel.paged_batch import greedy_paged
from tests.parallel.rank_programs import engine_rank, expert_parallel_block_rank, model_rank
from tests.parallel.ranks import run_ranks

WORLD_SIZE = 2
MAX_NEW_TOKENS = 4
TOLERANCE = 1e-4  # fp32
# decode steps carry 3 tokens, 6 (token, expert) pairs over 8 experts: some experts get none,
# and rank 1 routes 1 token to rank 0's 2
PROMPTS = [[5, 17, 260, 33, 99], [i * 7 % 500 + 3 for i in range(19)], [i * 13 % 511 for i in range(11)]]
MOE_CONFIG = dict(
    architecture="GptOssForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, moe_layers=(0,), router_bias=True, expert_bias=True, swiglu_limit=7.0,
)
QWEN_MOE_CONFIG = {
    **MOE_CONFIG, "architecture": "Qwen3MoeForCausalLM", "num_experts_per_tok": 3, "norm_topk_prob": False,
    "router_bias": False, "expert_bias": False, "swiglu_limit": None,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep-tiny")
    archs = ("qwen3-moe", "gpt-oss")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=60 + i) for i, arch in enumerate(archs)}


# ---- the layout -------------------------------------------------------------------------------


def test_experts_the_ranks_do_not_divide_are_refused() -> None:
    config = ModelConfig(**{**MOE_CONFIG, "num_experts": 6})
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        TensorParallelLayout(config, 0, 4)
    # MoE layers leave nothing of intermediate_size to split: only num_experts must divide
    config = ModelConfig(**{**MOE_CONFIG, "intermediate_size": 15})
    layouts = [TensorParallelLayout(config, rank, 2) for rank in range(2)]
    assert [(lay.first_expert, lay.num_local_experts) for lay in layouts] == [(0, 4), (4, 4)]


def test_each_rank_holds_a_contiguous_run_of_experts_and_its_heads_sinks() -> None:
    layout = TensorParallelLayout(ModelConfig(**MOE_CONFIG), 1, 2)
    assert layout.rank_config().num_experts == 8  # the router scores every expert
    for name in ("gate_up_proj", "down_proj_bias", "gate_up_proj_blocks", "down_proj_scales"):
        part = layout.shard_of(f"model.layers.0.mlp.experts.{name}")
        assert (part.dim, part.start, part.end, part.full_size) == (0, 4, 8, 8), name
    sinks = layout.shard_of("model.layers.0.self_attn.sinks")
    assert (sinks.dim, sinks.start, sinks.end) == (0, 2, 4)  # query heads 2, 3
    assert layout.shard_of("model.layers.0.mlp.router.weight") is None
    assert layout.shard_of("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the sum
    assert [layout.holds(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in (0, 3, 4, 7)] == [
        False, False, True, True
    ]
    assert layout.holds("model.layers.0.mlp.gate.weight")


# ---- loading ----------------------------------------------------------------------------------


def test_gpt_oss_mxfp4_ranks_load_their_slice_of_the_experts(tmp_path: Path) -> None:
    dense, quantized = tmp_path / "dense", tmp_path / "quantized"
    write_tiny_checkpoint(dense, "gpt-oss", seed=7, num_hidden_layers=1, layer_types=["full_attention"])
    write_mxfp4_twin(dense, quantized, seed=3)
    whole = dict(load_model(dense, impl="torch").named_parameters())
    for rank in range(WORLD_SIZE):
        group = TensorParallelGroup(rank, WORLD_SIZE)
        shard = dict(load_model(quantized, impl="torch", tensor_parallel=group).named_parameters())
        held = slice(4 * rank, 4 * rank + 4)
        for name in ("w13", "w2", "w13_bias", "w2_bias"):
            assert torch.equal(shard[f"layers.0.mlp.experts.{name}"], whole[f"layers.0.mlp.experts.{name}"][held]), name
        assert torch.equal(shard["layers.0.mlp.router.weight"], whole["layers.0.mlp.router.weight"])
        sinks = whole["layers.0.self_attn.sinks"][2 * rank : 2 * rank + 2]  # the rank's 2 of 4 query heads
        assert torch.equal(shard["layers.0.self_attn.sinks"], sinks)


def test_gpt_oss_packed_mxfp4_ranks_keep_their_slice_packed(tmp_path: Path) -> None:
    dense, quantized = tmp_path / "dense", tmp_path / "quantized"
    write_tiny_checkpoint(dense, "gpt-oss", seed=8, num_hidden_layers=1, layer_types=["full_attention"])
    write_mxfp4_twin(dense, quantized, seed=3)
    whole = dict(load_model(quantized, impl="torch", packed_experts=True).named_parameters())
    for rank in range(WORLD_SIZE):
        group = TensorParallelGroup(rank, WORLD_SIZE)
        shard = dict(load_model(quantized, impl="torch", tensor_parallel=group, packed_experts=True).named_parameters())
        held = slice(4 * rank, 4 * rank + 4)
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias"):
            assert torch.equal(shard[f"layers.0.mlp.experts.{name}"], whole[f"layers.0.mlp.experts.{name}"][held]), name


def test_qwen3_moe_ranks_never_read_the_other_ranks_experts(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 loads from a checkpoint that lacks rank 1's experts altogether."""
    source = checkpoints["qwen3-moe"]
    whole = dict(load_model(source, impl="torch").named_parameters())
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    kept = {name: t for name, t in tensors.items() if not any(f".experts.{e}." in name for e in range(4, 8))}
    assert len(kept) < len(tensors)
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    first_rank = TensorParallelGroup(0, WORLD_SIZE)
    shard = dict(load_model(tmp_path, impl="torch", tensor_parallel=first_rank).named_parameters())
    for layer in (0, 2):  # the sparse layers
        for name in ("w13", "w2"):
            key = f"layers.{layer}.mlp.experts.{name}"
            assert torch.equal(shard[key], whole[key][:4]), key
    with pytest.raises(ValueError, match=r"experts\.4\.(gate|up|down)_proj"):
        load_model(tmp_path, impl="torch", tensor_parallel=TensorParallelGroup(1, WORLD_SIZE))


# ---- dispatch and combine ---------------------------------------------------------------------


def test_dispatch_and_combine_equal_the_whole_block() -> None:
    cases = [
        # gpt-oss-style: biases, clamped SwiGLU, renormalised; 7 tokens: rank 1 has 3 (padded to 4)
        dict(config=MOE_CONFIG, num_tokens=7, seed=1, impl="torch"),
        # Qwen3-MoE-style: 3 of 8, not renormalised; one token: rank 1 routes none
        dict(config=QWEN_MOE_CONFIG, num_tokens=1, seed=2, impl="torch"),
        # every token to rank 0's experts: rank 1's receive nothing
        dict(config=MOE_CONFIG, num_tokens=6, seed=3, impl="torch", favour_first_rank=True),
        # the rank's experts on the Triton kernels (interpreted)
        dict(config=MOE_CONFIG, num_tokens=5, seed=4, impl="triton"),
        dict(config=MOE_CONFIG, num_tokens=0, seed=5, impl="torch"),
    ]
    ranks = run_ranks(expert_parallel_block_rank, WORLD_SIZE, cases)
    for index, case in enumerate(cases):
        first, second = ranks[0][index], ranks[1][index]
        assert first["output"].shape == (case["num_tokens"], MOE_CONFIG["hidden_size"])
        assert torch.equal(first["output"], second["output"]), f"case {index}: the ranks disagree"
        torch.testing.assert_close(first["output"], first["expected"], atol=1e-5, rtol=0, msg=f"case {index}")
        # per layer: counts, rows out, rows back (all-to-all), then one all-gather
        assert first["collectives"] == {"all_reduce": 0, "all_gather": 1, "all_to_all_single": 3}
    assert 0 in ranks[0][0]["expert_loads"]  # ragged: an expert with no token
    assert ranks[0][2]["expert_loads"][4:] == [0, 0, 0, 0]
    assert ranks[0][0]["output"].abs().max().item() > 0.1  # a real output, not zeros


# ---- whole models -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
def test_two_ranks_match_one(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    config = ModelConfig.from_pretrained(path)
    reference = greedy_paged(load_model(path, impl="torch"), PROMPTS, MAX_NEW_TOKENS)
    ranks = run_ranks(model_rank, WORLD_SIZE, str(path), PROMPTS, MAX_NEW_TOKENS)
    num_sparse, num_dense = len(config.moe_layers), config.num_hidden_layers - len(config.moe_layers)
    for rank, result in enumerate(ranks):
        assert result["tokens"] == reference["tokens"], f"rank {rank}"
        assert (result["prompt_logits"] - reference["prompt_logits"]).abs().max().item() <= TOLERANCE
        for step, logits in enumerate(result["decode_logits"]):
            assert (logits - reference["decode_logits"][step]).abs().max().item() <= TOLERANCE, f"step {step}"
        layout = TensorParallelLayout(config, rank, WORLD_SIZE)
        heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
        assert (result["kv_cache"] - reference["kv_cache"][:, :, :, :, heads]).abs().max().item() <= TOLERANCE
        # per step: the embedding, each attention and each dense MLP sum once; each MoE layer
        # exchanges three times and gathers once; the logits are gathered once
        assert result["collectives"] == {
            "all_reduce": MAX_NEW_TOKENS * (1 + config.num_hidden_layers + num_dense),
            "all_gather": MAX_NEW_TOKENS * (1 + num_sparse),
            "all_to_all_single": MAX_NEW_TOKENS * 3 * num_sparse,
        }
        shapes = result["parameter_shapes"]
        sparse = config.moe_layers[0]
        expert_rows = 2 * config.moe_intermediate_size
        assert shapes[f"layers.{sparse}.mlp.experts.w13"] == (4, expert_rows, config.hidden_size)
        assert shapes[f"layers.{sparse}.mlp.router.weight"] == (8, config.hidden_size)
        if config.attention_sinks:
            assert shapes["layers.0.self_attn.sinks"] == (config.num_attention_heads // WORLD_SIZE,)


def test_engine_generates_on_two_ranks_as_on_one(checkpoints: dict[str, Path]) -> None:
    """`LLM.generate` with chunked prefill beside decodes: every step's token count differs."""
    path = checkpoints["gpt-oss"]
    prompts = [[i * 11 % 500 + 5 for i in range(length)] for length in (7, 30, 13)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    engine_kwargs = dict(device="cpu", dtype="float32", seed=11, max_model_len=64, max_num_batched_tokens=16,
                         num_blocks=24, block_size=8)
    outputs = LLM(path, **engine_kwargs).generate(prompts, params)
    expected = [[sample.token_ids for sample in output.outputs] for output in outputs]
    ranks = run_ranks(engine_rank, WORLD_SIZE, str(path), prompts, params, engine_kwargs)
    for rank, result in enumerate(ranks):
        assert result["model_type"] == "TensorParallelCausalLM"
        assert result["enforce_eager"]  # chosen by the engine: the exchange cannot be graph-captured
        assert result["tokens"] == expected, f"rank {rank}"
