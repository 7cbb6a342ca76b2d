"""Multi-digit addition with a column-by-column scratchpad, verifiable by exact match.

A problem adds two numbers of 2-4 digits. The solution thinks one column per line, right to
left, then states the answer:

    <think>
    4821+_970 1+0+0=01 ____1
    _482+__97 2+7+0=09 ___91
    __48+___9 8+9+0=17 __791
    ___4+____ 4+0+1=05 _5791
    </think> The answer is 5791.

Each line holds both operands right-aligned in 4 columns and shifted one column further
right per line, so their last characters are the digits of this column ('_' counts as 0);
then `digit+digit+carry=two-digit sum`, where the carry is the previous line's tens digit;
then the answer digits found so far, right-aligned in 5 columns. Every line has the same
layout, so each character the model writes depends on characters a fixed distance back.

The held-out set is disjoint from training by construction: a hash of the operand pair puts
every problem on one side of the split, `make_problem` rejects held-out pairs and
`heldout_problems` draws only held-out pairs.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
ANSWER_PREFIX = "The answer is"
MIN_DIGITS = 2
MAX_DIGITS = 4
OPERAND_WIDTH = MAX_DIGITS
RESULT_WIDTH = MAX_DIGITS + 1
HELDOUT_PERCENT = 10

_ANSWER_RE = re.compile(r"The answer is\s*(-?\d+)")
_LAST_NUMBER_RE = re.compile(r"-?\d+")
_LINE_RE = re.compile(r"^([_\d]{4})\+([_\d]{4}) (\d)\+(\d)\+(\d)=(\d\d) ([_\d]{5})$")


@dataclass(frozen=True)
class Problem:
    """One addition problem: the operands, the question shown to the model and the answer."""

    left: int
    right: int
    question: str
    answer: str


def _problem(left: int, right: int) -> Problem:
    return Problem(left, right, f"What is {left} + {right}?", str(left + right))


def is_heldout(left: int, right: int) -> bool:
    """Whether the operand pair belongs to the held-out evaluation side of the split."""
    digest = hashlib.sha256(f"{left}+{right}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < HELDOUT_PERCENT


def _random_operand(rng: random.Random) -> int:
    num_digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)


def _random_pair(rng: random.Random, heldout: bool) -> tuple[int, int]:
    while True:
        left, right = _random_operand(rng), _random_operand(rng)
        if is_heldout(left, right) == heldout:
            return left, right


def make_problem(rng: random.Random) -> Problem:
    """A training problem: uniform digit counts, never a held-out pair."""
    return _problem(*_random_pair(rng, heldout=False))


def heldout_problems(n: int, seed: int = 0) -> list[Problem]:
    """`n` distinct held-out problems, the same list for the same (n, seed)."""
    rng = random.Random(f"heldout-{seed}")
    seen: set[tuple[int, int]] = set()
    problems: list[Problem] = []
    while len(problems) < n:
        pair = _random_pair(rng, heldout=True)
        if pair not in seen:
            seen.add(pair)
            problems.append(_problem(*pair))
    return problems


def format_prompt(problem: Problem) -> str:
    """The user message content for a problem."""
    return problem.question


def _scratchpad_lines(left: int, right: int) -> list[str]:
    left_field = str(left).rjust(OPERAND_WIDTH, "_")
    right_field = str(right).rjust(OPERAND_WIDTH, "_")
    num_columns = max(len(str(left)), len(str(right)))
    carry = 0
    result = ""
    lines = []
    for column in range(num_columns):
        left_digit = 0 if left_field[-1] == "_" else int(left_field[-1])
        right_digit = 0 if right_field[-1] == "_" else int(right_field[-1])
        total = left_digit + right_digit + carry
        result = str(total % 10) + result
        if column == num_columns - 1 and total >= 10:
            result = "1" + result
        lines.append(
            f"{left_field}+{right_field} {left_digit}+{right_digit}+{carry}={total:02d} "
            f"{result.rjust(RESULT_WIDTH, '_')}"
        )
        carry = total // 10
        left_field = "_" + left_field[:-1]
        right_field = "_" + right_field[:-1]
    return lines


def format_solution(problem: Problem) -> str:
    """The assistant's full reply: the think block, then the final answer sentence."""
    lines = _scratchpad_lines(problem.left, problem.right)
    return f"{THINK_START}\n" + "\n".join(lines) + f"\n{THINK_END} {ANSWER_PREFIX} {problem.answer}."


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, or None when it states none.

    Looks only after the last `</think>` when there is one. Prefers the
    "The answer is N" sentence; otherwise takes the last number, unless the text is an
    unterminated think block (a completion cut off while thinking has no answer).
    """
    if THINK_END in text:
        text = text.rsplit(THINK_END, 1)[1]
    elif THINK_START in text:
        return None
    match = None
    for match in _ANSWER_RE.finditer(text):
        pass
    if match is not None:
        return _canonical(match.group(1))
    numbers = _LAST_NUMBER_RE.findall(text)
    return _canonical(numbers[-1]) if numbers else None


def _canonical(number: str) -> str:
    return str(int(number))


def is_correct(text: str, answer: str) -> bool:
    """Whether the completion's extracted answer equals `answer` exactly (as an integer)."""
    extracted = extract_answer(text)
    return extracted is not None and extracted == _canonical(answer)


def is_well_formed(text: str) -> bool:
    """One closed think block at the start, then exactly one "The answer is N." sentence."""
    if not text.startswith(THINK_START) or text.count(THINK_START) != 1 or text.count(THINK_END) != 1:
        return False
    after = text.split(THINK_END, 1)[1]
    return re.fullmatch(r" The answer is \d+\.", after) is not None


_QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")


def step_consistency(text: str, question: str | None = None) -> float:
    """Fraction of the scratchpad's own checks that hold, in [0, 1]; 0 without a scratchpad.

    A verifier that does not know the answer: per line it checks the layout, that the column
    digits are the operands' last characters, the column sum, the carry taken from the line
    before and the new result digit; finally that the stated answer equals the last result.
    Given the question, it also checks that the first line copied the operands faithfully.
    """
    if THINK_END not in text:
        return 0.0
    lines = text.split(THINK_END, 1)[0].removeprefix(THINK_START).strip("\n").split("\n")
    passed = total = 0
    question_match = _QUESTION_RE.fullmatch(question) if question is not None else None
    if question_match is not None:
        total += 1
        first = _LINE_RE.match(lines[0])
        passed += first is not None and (
            first.group(1).lstrip("_"),
            first.group(2).lstrip("_"),
        ) == question_match.groups()
    previous_carry = 0
    previous_digits = ""
    for line in lines:
        total += 5
        match = _LINE_RE.match(line)
        if match is None:
            continue
        left_field, right_field, left_digit, right_digit, carry, total_sum, result_field = match.groups()
        passed += 1
        passed += left_digit == left_field[-1].replace("_", "0") and right_digit == right_field[-1].replace("_", "0")
        passed += int(left_digit) + int(right_digit) + int(carry) == int(total_sum)
        passed += int(carry) == previous_carry
        expected = total_sum[1] + previous_digits
        digits = result_field.lstrip("_")
        # The last column's carry may already be written in front of the result.
        passed += digits == expected or (total_sum[0] == "1" and digits == "1" + expected)
        previous_carry = int(total_sum[0])
        previous_digits = digits
    total += 1
    answer = extract_answer(text)
    passed += answer is not None and previous_digits != "" and answer == str(int(previous_digits))
    return passed / total
