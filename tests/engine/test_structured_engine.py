"""Structured outputs in the engine: a random tiny model's samples decoded under a JSON
schema are instances of it (checked by `json` and by hand against the schema), seeded
samples repeat, parallel samples each keep their own grammar state, and on the GPU the graph-
replayed engine answers what the CPU engine does under the same constraint."""

from __future__ import annotations

import json

import pytest
import torch

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.structured_output import StructuredKind, StructuredOutput
from cleave.testing.tiny_models import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"sky": {"enum": ["blue", "grey"]}, "clear": {"type": "boolean"},
                   "birds": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}},
    "required": ["sky", "clear", "birds"],
    "additionalProperties": False,
}
PROMPTS = ["Describe the sky:", "Weather report as JSON"]


def is_instance(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"sky", "clear", "birds"} and value["sky"] in ("blue", "grey")
            and isinstance(value["clear"], bool) and len(value["birds"]) <= 3
            and all(bird in (1, 2, 3) for bird in value["birds"]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "model")


def generate(llm: LLM, params: SamplingParams) -> list[list[str]]:
    return [[sample.text for sample in output.outputs] for output in llm.generate(PROMPTS, params, raw=True)]


def test_samples_are_instances_and_seeded_ones_repeat(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, num_blocks=64, enforce_eager=True)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=3,
                            structured_output=StructuredOutput.json_schema(SCHEMA))
    texts = generate(llm, params)
    assert all(is_instance(text) for sample_texts in texts for text in sample_texts)
    assert len({text for sample_texts in texts for text in sample_texts}) > 1  # the grammar left choices
    assert generate(llm, params) == texts
    greedy = generate(llm, SamplingParams(max_tokens=60, temperature=0.0,
                                          structured_output=StructuredOutput(StructuredKind.CHOICE,
                                                                             choices=("yes", "no", "maybe"))))
    assert all(text in ("yes", "no", "maybe") for sample_texts in greedy for text in sample_texts)
    # unconstrained requests in the same engine are untouched by it
    free = SamplingParams(max_tokens=8, temperature=0.0)
    assert generate(llm, free) == generate(LLM(model_dir, device="cpu", dtype="float32", max_model_len=256,
                                                   num_blocks=64, enforce_eager=True), free)


@pytest.mark.gpu
def test_the_graph_replayed_engine_answers_as_the_cpu_one(model_dir):
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput.json_schema(SCHEMA))
    cpu = generate(LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, num_blocks=64,
                       enforce_eager=True), params)
    llm = LLM(model_dir, device="cuda", dtype="float32", max_model_len=256, num_blocks=64)
    assert llm.engine.runner.graph_runner is not None
    assert generate(llm, params) == cpu
    sampled = generate(llm, SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=4,
                                           structured_output=StructuredOutput.json_schema(SCHEMA)))
    assert all(is_instance(text) for sample_texts in sampled for text in sample_texts)
    torch.cuda.synchronize()
