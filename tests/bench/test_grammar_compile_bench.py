"""bench/grammar_compile.py on a small vocabulary: every kind compiles, its walk stays inside
what the grammar allows, and the results are written."""

from __future__ import annotations

import json

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("grammar_compile")


def test_every_kind_compiles_and_is_walked_and_written(bench, tmp_path):
    assert bench.main(["--vocab", "3000", "--steps", "12", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("grammar-compile-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [row["kind"] for row in rows] == ["json_schema", "json_object", "regex", "choice", "grammar"]
    for row in rows:
        assert row["vocab"] == 3000 and 1 <= row["steps"] <= 12 and row["first_compile_ms"] > 0
        assert row["mask_us_median"] > 0


def test_the_vocabulary_is_byte_level_with_every_byte(bench):
    tokenizer = bench.byte_level_tokenizer(400, seed=1)
    vocab = tokenizer.backend.get_vocab()
    assert len(vocab) == 400 and vocab[bench.EOS] == 0 and tokenizer.eos_token_ids == {0}
    assert tokenizer.backend.decode([vocab["\u0120"]]) == " "  # the byte-level space
