"""Under a thinking budget the shipped reasoner stops at the cut and states a number.

The engine forces `</think>` and the model's answer prefix (" The answer is") once the
budget is spent; the model was trained on such cut-short blocks, so it finishes with a number.
"""

import re

import pytest
import torch

from cleave.engine.llm import LLM, default_model_path
from cleave.generation.sampling_params import SamplingParams
from cleave.tasks import arithmetic

NUM_PROBLEMS = 10
NUM_TAG_TOKENS = 2  # `<think>` and `</think>` are one token each and counted as reasoning
ANSWER_RE = re.compile(r" The answer is \d+\.")


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(default_model_path(), device="cpu", dtype="float32")


@pytest.mark.parametrize("budget", [0, 8])
def test_budget_cut_thinking_ends_in_a_well_formed_answer(llm, budget):
    problems = arithmetic.heldout_problems(NUM_PROBLEMS, seed=0)
    prompts = [[{"role": "user", "content": arithmetic.format_prompt(p)}] for p in problems]
    params = SamplingParams(max_tokens=40, temperature=0.0, max_thinking_tokens=budget)
    for request_output in llm.generate(prompts, params):
        (output,) = request_output.outputs
        # Every scratchpad is longer than the budget, so each block is cut exactly at it.
        assert output.num_reasoning_tokens - NUM_TAG_TOKENS == budget
        assert len(llm.tokenizer.encode(output.reasoning_text, add_special_tokens=False)) == budget
        assert ANSWER_RE.fullmatch(output.text), output.text
        assert output.finish_reason.value == "stop"


def test_without_a_budget_the_model_thinks_through_the_whole_scratchpad(llm):
    (problem,) = arithmetic.heldout_problems(1, seed=0)
    params = SamplingParams(max_tokens=160, temperature=0.0)
    (request_output,) = llm.generate([[{"role": "user", "content": arithmetic.format_prompt(problem)}]], params)
    (output,) = request_output.outputs
    expected = arithmetic.format_solution(problem)
    assert "<think>" + output.reasoning_text + "</think>" + output.text == expected
