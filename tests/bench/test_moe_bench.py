"""bench/moe.py: argument parsing and a dry run at tiny shapes on the CPU."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_modules import bench_fixture


bench = bench_fixture("moe")


def test_defaults_are_the_h200_plan(bench):
    args = bench.parse_args([])
    assert args.tokens == [1, 16, 64, 512, 8192] and args.batch == [1, 64] and args.part == "all"
    assert not args.no_compile and not args.dry_run
    shape = bench.MoEShape()
    assert (shape.hidden, shape.inter, shape.experts, shape.top_k, shape.layers) == (2048, 768, 128, 8, 48)
    custom = bench.parse_args(["--part", "layer", "--tokens", "2,4", "--batch", "8", "--context", "64"])
    assert (custom.part, custom.tokens, custom.batch, custom.context) == ("layer", [2, 4], [8], 64)
    assert args.gemv_tiles == [] and bench.parse_args(["--gemv-tiles", "2:4,4:8"]).gemv_tiles == [(2, 4), (4, 8)]
    assert bench.parse_args(["--gemv-tiles", "4:8:1024:8,2:4:512"]).gemv_tiles == [(4, 8, 1024, 8), (2, 4, 512)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--gemv-tiles", "4"])


def test_layer_dry_run_times_gemv_tiles_with_their_k_tile(bench, tmp_path):
    rows = bench.main(["--dry-run", "--part", "layer", "--tokens", "1", "--no-transformers", "--gemv-tiles",
                       "2:4:16:2", "--out", str(tmp_path)])["layer"]
    (row,) = [row for row in rows if row["method"] == "fused, GEMV tiles 2:4:16:2"]
    assert "error" not in row and row["max_diff"] < 1e-4

GEMV_DOWN_ROWS = ("decode layout (PDL)",)


def test_dry_run_writes_both_parts(bench, tmp_path):
    results = bench.main(["--dry-run", "--out", str(tmp_path)])
    layer = results["layer"]
    methods = {row["method"] for row in layer}
    # torch.compile skipped in a dry run; 1 and 3 tokens also run the grouped GEMMs and the
    # GEMVs routing inside their first kernel, and the down GEMV at its other depth (1 token: one
    # tile ahead instead of two; 3 tokens: two instead of one), the down products side by side, and
    # the decode layout's launches under PDL with either down kernel
    assert methods == {"fused", "fused, routing in GEMV", "fused, down one tile ahead", "fused, down two tiles ahead",
                       "fused, grouped GEMMs", "reference", "transformers", *GEMV_DOWN_ROWS}
    assert all("error" not in row and row["us"] > 0 for row in layer)
    assert all(row["max_diff"] < 1e-4 for row in layer)  # fused and transformers agree with the reference
    assert {row["tokens"] for row in layer} == {1, 3}
    decode = results["decode"]
    assert [row["batch"] for row in decode] == [1, 2]
    for row in decode:
        assert 1 <= row["touched_experts_per_layer"] <= 2 * row["batch"] and row["bytes_gb"] > 0
    (decode_file,) = tmp_path.glob("moe-decode-*.json")  # one file per run, named by its UTC time
    saved = json.loads(decode_file.read_text())
    assert saved["summary"]["shape"]["experts"] == 8 and len(saved["rows"]) == 2
    (layer_file,) = tmp_path.glob("moe-layer-*.md")
    assert layer_file.read_text().startswith("# moe-layer")


def test_gpt_oss_decode_dry_run_builds_its_model(bench, tmp_path):
    """gpt-oss's decode step (sinks, biases, alternating windows) at tiny shapes; its real
    shape is the 20B model's."""
    assert bench.MODELS["gpt-oss-20b"].architecture == "gpt-oss" and bench.MODELS["gpt-oss-20b"].experts == 32
    config = bench.decode_model_config(bench.MODELS["gpt-oss-20b"], 2048)
    assert config.attention_sinks and config.router_bias and config.num_experts_per_tok == 4
    assert [config.layer_sliding_window(i) for i in range(2)] == [bench.GPT_OSS_WINDOW, None]
    rows = bench.main(["--dry-run", "--part", "decode", "--model", "gpt-oss-20b", "--out", str(tmp_path)])["decode"]
    assert [row["batch"] for row in rows] == [1, 2] and all(row["bytes_gb"] > 0 for row in rows)


@pytest.fixture
def built_models(bench, monkeypatch) -> list:
    """Every model the bench builds from now on, in order."""
    models = []
    real_random_model = bench.random_model

    def keeping(*args, **kwargs):  # type: ignore[no-untyped-def]
        models.append(real_random_model(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(bench, "random_model", keeping)
    return models


def test_decode_dry_run_times_each_route_on_one_count(bench, tmp_path, built_models):
    """`--routes launch,in-gemv`: each batch's experts are counted once, through the routing
    launch, and the step is timed both ways, the in-GEMV row last with every MoE block routing
    inside its first expert GEMV (the layout itself is tested against transformers in
    tests/model/test_moe_parity.py)."""
    from cleave.model.moe import SparseMoeBlock

    rows = bench.main(["--dry-run", "--part", "decode", "--model", "gpt-oss-20b", "--routes", "launch,in-gemv",
                       "--out", str(tmp_path)])["decode"]
    assert [(row["batch"], row["route"]) for row in rows] == [(1, "launch"), (1, "in-gemv"), (2, "launch"),
                                                               (2, "in-gemv")]
    assert rows[0]["bytes_gb"] == rows[1]["bytes_gb"] and all(row["touched_experts_per_layer"] > 0 for row in rows)
    (model,) = built_models
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    assert blocks and all(block.route_in_gemv for block in blocks)
    with pytest.raises(SystemExit):
        bench.parse_args(["--routes", "launch,sideways"])


def test_decode_dry_run_times_the_rotary_inside_and_outside_attention(bench, tmp_path, monkeypatch, built_models):
    """`--rotary-in-attention on,off`: a row of each per batch, with the layers' setting
    changed before each timing (the step's kernels then read it)."""
    seen = []
    real_us = bench.Timer.us

    def recording(timer, fn):  # type: ignore[no-untyped-def]
        seen.append({layer.self_attn.rotary_in_decode_attention for layer in built_models[-1].layers})
        return real_us(timer, fn)

    monkeypatch.setattr(bench.Timer, "us", recording)
    rows = bench.main(["--dry-run", "--part", "decode", "--rotary-in-attention", "on,off", "--out", str(tmp_path)])
    assert [(row["batch"], row["rotary_in_attention"]) for row in rows["decode"]] == [
        (1, "on"), (1, "off"), (2, "on"), (2, "off")]
    assert seen == [{True}, {False}, {True}, {False}]
    with pytest.raises(SystemExit):
        bench.parse_args(["--rotary-in-attention", "sideways"])


def test_decode_inputs_put_the_null_block_behind_gpt_oss_windows(bench):
    """gpt-oss's paired cache past its 128-token window: each window table holds the null
    block for the pages wholly behind the window, and the step runs over it."""
    torch = bench.torch
    cpu = torch.device("cpu")
    context, block_size = 200, 16  # the new token at 200 sees positions 73..200: pages 0-3 are behind
    config = bench.decode_model_config(bench.replace(bench.TINY, architecture="gpt-oss"), context + 1)
    model = bench.random_model(config, torch.float32, cpu)
    kv_cache, metadata, input_ids, positions = bench.decode_inputs(
        config, 2, context, block_size, torch.float32, cpu, torch.Generator().manual_seed(0))
    assert kv_cache.shape[0] == 1  # the sliding layer and the full one share a slot
    window = metadata.window.block_tables
    assert window.shape == (2, 13) and (window[:, :4] == 0).all() and (window[:, 4:] > 0).all()
    assert set(window[:, 4:].flatten().tolist()).isdisjoint(metadata.block_tables.flatten().tolist())
    assert positions.tolist() == [context, context] and metadata.seq_lens.tolist() == [context + 1] * 2
    # zeroed split counters, shared with the window layers, as the decode graphs' buffers give them
    assert metadata.split_counters is not None and not metadata.split_counters.any()
    assert metadata.window.split_counters is metadata.split_counters
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, kv_cache, metadata))
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()
    assert (kv_cache[:, :, 0] == 0).all() and kv_cache.abs().sum() > 0  # written, never into the null block


def test_gpt_oss_decode_dry_run_with_packed_experts(bench, tmp_path):
    config = bench.decode_model_config(bench.MODELS["gpt-oss-20b"], 2048, packed_experts=True)
    assert config.packed_experts and config.quantization == "mxfp4"
    shape = bench.MODELS["gpt-oss-20b"]
    assert bench.expert_bytes(shape, bench.torch.bfloat16, packed=True) * 3 < bench.expert_bytes(shape, bench.torch.bfloat16)
    with pytest.raises(SystemExit, match="for gpt-oss"):
        bench.decode_model_config(bench.MODELS["qwen3-30b-a3b"], 2048, packed_experts=True)
    rows = bench.main(["--dry-run", "--part", "decode", "--model", "gpt-oss-20b", "--packed-experts",
                       "--out", str(tmp_path)])["decode"]
    assert [row["batch"] for row in rows] == [1, 2] and all(row["bytes_gb"] > 0 for row in rows)


def test_layer_dry_run_reads_packed_experts(bench, tmp_path):
    rows = bench.main(["--dry-run", "--part", "layer", "--packed-experts", "--out", str(tmp_path)])["layer"]
    assert {row["method"] for row in rows} == {"fused", "fused, routing in GEMV", "fused, down one tile ahead",
                                               "fused, down two tiles ahead", "fused, grouped GEMMs", "reference",
                                               "transformers", *GEMV_DOWN_ROWS}
    assert all("error" not in row and row["max_diff"] < 1e-4 for row in rows)


def test_prefill_dry_run_counts_active_flops(bench, tmp_path):
    rows = bench.main(["--dry-run", "--part", "prefill", "--model", "gpt-oss-20b", "--out", str(tmp_path)])["prefill"]
    assert [row["tokens"] for row in rows] == [24] and rows[0]["ms"] > 0 and rows[0]["tflops"] > 0
    shape = bench.MODELS["qwen3-30b-a3b"]
    config = bench.decode_model_config(shape, 8193)
    flops = bench.active_flops(shape, config, 8192)
    # 2.7B active parameters a token: 44.7 TFLOP of projections and experts, 26.4 of causal attention
    assert 70.5e12 < flops < 71.5e12
    gpt_oss = bench.MODELS["gpt-oss-20b"]
    windowed = bench.active_flops(gpt_oss, bench.decode_model_config(gpt_oss, 8193), 8192)
    full = bench.active_flops(gpt_oss, bench.replace(bench.decode_model_config(gpt_oss, 8193), layer_types=None,
                                                     sliding_window=None), 8192)
    assert windowed < full  # half its layers see 128 keys


def test_prefill_dry_run_times_each_attention_launch(bench, tmp_path):
    """`--attention-launches`: the default launch's row, then one row per setting, each set on
    every attention layer (packed GQA heads and the unmasked walk below the diagonal here)."""
    results = bench.main(["--dry-run", "--part", "prefill", "--out", str(tmp_path), "--profile", "--attention-launches",
                          '{"pack_gqa": true, "causal_split": true, "block_m": 16, "block_n": 16}'])
    rows = results["prefill"]
    assert [row["launch"] for row in rows] == [
        "default", '{"block_m":16,"block_n":16,"causal_split":true,"pack_gqa":true}']
    assert rows[0]["active_tflop"] == rows[1]["active_tflop"] and all(row["ms"] > 0 for row in rows)
    # `--profile`: the prompt's matrix products by shape, each layer's qkv projection among them
    # (24 tokens x hidden 64 x (4 + 2 x 2 heads of 16)); kernels only on a GPU
    gemms = {row["name"]: row for row in results["prefill_profile"] if row["what"] == "gemm"}
    assert gemms["24x64x128"]["calls"] == bench.TINY.layers and len(list(tmp_path.glob("moe-prefill-profile-*.md"))) == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--attention-launches", "{not json"])


def test_decode_rows_name_their_attention_setting_and_a_setting_no_call_takes_fails(bench, tmp_path):
    """The default row says so; on the CPU the step's attention is torch's, so a kernel setting
    reaches no call, and the run fails rather than time the default under its name."""
    rows = bench.main(["--dry-run", "--part", "decode", "--out", str(tmp_path)])["decode"]
    assert {row["attention"] for row in rows} == {"default"}
    with pytest.raises(RuntimeError, match="no decode attention call took"):
        bench.main(["--dry-run", "--part", "decode", "--decode-attention", '{"num_warps": 4}', "--out", str(tmp_path)])
