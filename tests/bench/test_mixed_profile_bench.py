"""bench/mixed_profile.py: the step it profiles is laid out as the engine lays out a mixed
step, and runs through the model (profiling needs a GPU)."""

from __future__ import annotations

import torch

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("mixed_profile")


def test_a_mixed_step_runs_its_decodes_first_and_samples_each_sequences_last_token(bench):
    from cleave.model.llama import CausalLM, allocate_kv_cache
    from tests.graphs.test_runner import tiny_config

    args = bench.parse_args([])
    assert args.attention_launches == [{"decode_rows": False}, {}] and args.sampler_impls == ["auto"]
    query_lens, seq_lens = bench.mixed_lengths(3, 40, 60, 25)
    config = tiny_config()
    input_ids, positions, metadata, logits_rows, num_blocks = bench.mixed_step_inputs(
        query_lens, seq_lens, config.vocab_size, torch.device("cpu"))
    assert metadata.num_decode_seqs == 3 and input_ids.shape == positions.shape == (60,)
    assert positions[:3].tolist() == [seq_len - 1 for seq_len in seq_lens[:3]]
    assert positions[3:28].tolist() == list(range(25))
    assert logits_rows.tolist() == [0, 1, 2, 27, 52, 59]
    model = CausalLM(config).eval()
    with torch.no_grad():
        hidden = model(input_ids, positions, allocate_kv_cache(config, num_blocks, bench.BLOCK_SIZE), metadata)
        logits = model.compute_logits(hidden.index_select(0, logits_rows))
    assert logits.shape == (6, config.vocab_size) and torch.isfinite(logits).all()
