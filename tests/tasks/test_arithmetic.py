"""The arithmetic task: solution format, answer extraction, verifier and the held-out split."""

import random

import pytest

from cleave.tasks import arithmetic
from cleave.tasks.arithmetic import (
    Problem,
    extract_answer,
    format_prompt,
    format_solution,
    heldout_problems,
    is_correct,
    is_heldout,
    is_well_formed,
    make_problem,
    step_consistency,
)


def problem(left: int, right: int) -> Problem:
    return Problem(left, right, f"What is {left} + {right}?", str(left + right))


def test_solution_format_is_exact():
    assert format_prompt(problem(4821, 970)) == "What is 4821 + 970?"
    assert format_solution(problem(4821, 970)) == (
        "<think>\n"
        "4821+_970 1+0+0=01 ____1\n"
        "_482+__97 2+7+0=09 ___91\n"
        "__48+___9 8+9+0=17 __791\n"
        "___4+____ 4+0+1=05 _5791\n"
        "</think> The answer is 5791."
    )


def test_final_carry_is_written_into_the_result():
    assert format_solution(problem(99, 9999)).splitlines()[-2] == "____+___9 0+9+1=10 10098"
    assert format_solution(problem(47, 80)).endswith("___4+___8 4+8+0=12 __127\n</think> The answer is 127.")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nx\n</think> The answer is 5791.", "5791"),
        ("The answer is 5791.", "5791"),
        ("The answer is 0057", "57"),
        ("<think>The answer is 3</think> The answer is 12.", "12"),
        ("<think>1+2=3</think> so it is 42", "42"),
        ("</think> The answer is 1. No, The answer is 2.", "2"),
        ("<think>\n4821+_970 1+0+0=01", None),
        ("<think>The answer is 7", None),
        ("</think> I do not know.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct_compares_integers():
    assert is_correct("</think> The answer is 0127.", "127")
    assert not is_correct("</think> The answer is 128.", "127")
    assert not is_correct("<think> The answer is 127.", "127")


def test_reference_solutions_are_well_formed_and_consistent():
    rng = random.Random(3)
    for _ in range(300):
        solution = format_solution(make_problem(rng))
        assert is_well_formed(solution)
        assert step_consistency(solution) == 1.0


def test_step_consistency_catches_each_kind_of_error():
    good = format_solution(problem(47, 80))  # 2 lines x 5 checks + answer = 11
    assert step_consistency(good.replace("4+8+0=12", "4+8+0=13")) == pytest.approx(9 / 11)
    assert step_consistency(good.replace("is 127.", "is 128.")) == pytest.approx(10 / 11)
    assert step_consistency(good.replace("4+8+0", "4+8+1")) == pytest.approx(9 / 11)
    assert step_consistency(good.replace("___4+___8 4", "___4+___8 5")) == pytest.approx(9 / 11)
    assert step_consistency("The answer is 127.") == 0.0
    assert not is_well_formed(good.replace("</think>", ""))
    assert not is_well_formed(good + " The answer is 127.")


def test_heldout_is_disjoint_from_training_by_construction():
    heldout = heldout_problems(500, seed=0)
    assert all(is_heldout(p.left, p.right) for p in heldout)
    assert len({(p.left, p.right) for p in heldout}) == 500
    rng = random.Random(0)
    training = [make_problem(rng) for _ in range(3000)]
    assert not any(is_heldout(p.left, p.right) for p in training)
    assert not {(p.left, p.right) for p in heldout} & {(p.left, p.right) for p in training}


def test_heldout_set_is_fixed_and_split_is_about_ten_percent():
    assert heldout_problems(20, seed=0) == heldout_problems(20, seed=0)
    assert heldout_problems(20, seed=0) != heldout_problems(20, seed=1)
    rng = random.Random(1)
    pairs = [(rng.randint(10, 9999), rng.randint(10, 9999)) for _ in range(20000)]
    fraction = sum(is_heldout(*pair) for pair in pairs) / len(pairs)
    assert abs(fraction - arithmetic.HELDOUT_PERCENT / 100) < 0.01


def test_problems_cover_two_to_four_digits():
    rng = random.Random(2)
    lengths = {len(str(make_problem(rng).left)) for _ in range(200)}
    assert lengths == {2, 3, 4}


def test_step_consistency_checks_the_copied_operands_against_the_question():
    good = format_solution(problem(47, 80))
    assert step_consistency(good, "What is 47 + 80?") == 1.0
    assert step_consistency(good, "What is 48 + 80?") == pytest.approx(11 / 12)
    assert step_consistency(good, "unrelated question") == 1.0
