"""Random and JSONL workloads: exact token lengths with a tokenizer, seeded, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cleave
from cleave.benchmark.workload import WorkloadError, jsonl_requests, length_range, load_tokenizer, random_requests

SHIPPED_MODEL = Path(cleave.__file__).parent / "assets" / "reasoner"


@pytest.fixture(scope="module")
def tokenizer():
    if not (SHIPPED_MODEL / "tokenizer.json").is_file():
        pytest.skip("the shipped reasoner is not in this checkout")
    return load_tokenizer(SHIPPED_MODEL)


def test_length_range():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(1, 0.9) == (1, 2)
    with pytest.raises(WorkloadError, match="--random-range-ratio"):
        length_range(100, 1.0)


def test_tokenizer_prompts_have_the_asked_length(tokenizer):
    requests = random_requests(20, input_len=40, output_len=8, range_ratio=0.5, seed=1, tokenizer=tokenizer)
    lengths = [r.prompt_len for r in requests]
    assert all(20 <= n <= 60 for n in lengths) and len(set(lengths)) > 1
    for request in requests:
        assert len(tokenizer.encode(request.prompt, add_special_tokens=False).ids) == request.prompt_len
        assert "\ufffd" not in request.prompt
        assert 4 <= request.output_len <= 12


def test_seeded_and_distinct(tokenizer):
    first = random_requests(5, 30, 4, seed=3, tokenizer=tokenizer)
    assert first == random_requests(5, 30, 4, seed=3, tokenizer=tokenizer)
    assert first != random_requests(5, 30, 4, seed=4, tokenizer=tokenizer)
    assert len({r.prompt for r in first}) == 5


def test_word_prompts_without_tokenizer():
    requests = random_requests(3, input_len=25, output_len=7, seed=0)
    assert all(len(r.prompt.split()) == 25 and r.prompt_len is None and r.output_len == 7 for r in requests)


def test_jsonl_prompts_repeat_and_default_output_len(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?", "output_len": 3}) + "\n\n"
                    + json.dumps({"prompt": "Say hi"}) + "\n")
    requests = jsonl_requests(path, 5, default_output_len=9, tokenizer=tokenizer)
    assert [r.prompt for r in requests] == ["What is 2+2?", "Say hi"] * 2 + ["What is 2+2?"]
    assert [r.output_len for r in requests] == [3, 9, 3, 9, 3]
    assert requests[1].prompt_len == len(tokenizer.encode("Say hi", add_special_tokens=False).ids)


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "ok"}\nnot json\n', "line 2: not JSON"),
    ('{"text": "x"}\n', 'line 1: needs a non-empty "prompt" string'),
    ('{"prompt": "x", "output_len": 0}\n', 'line 1: "output_len" must be a positive integer'),
    ("\n", "no prompts"),
])
def test_jsonl_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        jsonl_requests(path, 2, 4)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(WorkloadError, match="--dataset-path .*missing.jsonl"):
        jsonl_requests(tmp_path / "missing.jsonl", 1, 4)
    with pytest.raises(WorkloadError, match="--tokenizer .*no tokenizer.json"):
        load_tokenizer(tmp_path)
