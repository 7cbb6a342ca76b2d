"""bench/kv_capacity.py: the pages one long sequence holds, paired cache vs a slot per layer."""

from __future__ import annotations

import json

from tests.bench.bench_modules import imported_bench


def test_a_paired_gpt_oss_cache_holds_the_full_blocks_and_one_window(tmp_path):
    with imported_bench("kv_capacity") as bench:
        assert bench.main(["--prompt-len", "300", "--output-len", "200", "--chunk", "64", "--kv-gib", "1",
                           "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("kv-capacity-*.json")
    unpaired, paired = json.loads(result.read_text())["rows"]
    blocks = -(-500 // 16)
    assert (unpaired["slots"], unpaired["peak_pages"]) == (24, blocks)  # every block of every layer
    # half the layers per page; the sliding half holds its 128-token window's pages and one more
    assert (paired["slots"], paired["peak_pages"]) == (12, blocks + 128 // 16 + 1)
    assert paired["pages"] == 2 * unpaired["pages"]
    assert paired["sequences"] == paired["pages"] // paired["peak_pages"] > unpaired["sequences"]
    # the 300-token prompt's hand-off: 19 blocks; paired, the first query (300) sees 173..300,
    # so the window pages of blocks 0..9 stay behind: 19 full pages and 9 window pages, half-size
    assert unpaired["handoff_mib"] == 19 * unpaired["page_kib"] / 1024
    assert paired["handoff_mib"] == (19 + 9) * paired["page_kib"] / 1024
