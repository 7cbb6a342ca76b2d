"""bench/serve_load.py: HTTP chats as long in tokens as the gRPC prompts they are compared with."""

from __future__ import annotations

import importlib
import random
from pathlib import Path

from cleave.config import SHIPPED_MODEL_DIR
from cleave.model.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_chats_of_the_derived_word_counts_are_about_the_asked_tokens(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # serve_load imports its bench/ neighbours
    serve_load = importlib.import_module("serve_load")
    random_text, words_for_tokens = serve_load.random_text, serve_load.words_for_tokens
    tokenizer = Tokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    rng = random.Random(0)
    for target in (64, 512):
        low, high = words_for_tokens(SHIPPED_MODEL_DIR, (target // 2, target))
        assert 1 <= low < high
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": random_text(rng, high)}])
                 for _ in range(40)]
        mean = sum(len(tokenizer.encode(chat, add_special_tokens=False)) for chat in chats) / len(chats)
        assert abs(mean - target) < 0.15 * target, (target, mean)
