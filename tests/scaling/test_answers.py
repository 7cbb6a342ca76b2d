from fractions import Fraction

import pytest

from cleave.scaling.answers import extract_code, extract_final_answer, normalize_answer, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\n1+2=3 and 7\n</think> The answer is 5791.", "5791"),
        ("<think>maybe 12</think>So \\boxed{\\frac{3}{4}} it is, not 9", "\\frac{3}{4}"),
        ("We get \\boxed{x^{2}+1}.", "x^{2}+1"),
        ("Final answer: 0.75", "0.75"),
        ("the answer is -12. Next we check 7.", "-12"),
        ("First 3 then 4, finally 1,234", "1,234"),
        ("<think>still thinking about 42", None),
        ("<think>a</think> nothing numeric here", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        (" $\\boxed{0.750}$. ", "0.75"),
        ("\\frac{6}{8}", "0.75"),
        ("\\dfrac{1}{3}", "1/3"),
        ("-2/4", "-0.5"),
        ("1,234", "1234"),
        ("007", "7"),
        ("\\text{ yes }", "yes"),
        ("x  +  1", "x + 1"),
        ("", None),
        (None, None),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_parse_number_rejects_non_numbers_and_huge_inputs():
    assert parse_number("3/0") is None
    assert parse_number("x/2") is None
    assert parse_number("1" * 100) is None
    assert parse_number("1.5e2") == Fraction(150)


def test_extract_code_takes_last_python_block_after_thinking():
    text = "<think>```python\nprint(0)\n```</think>Try:\n```python\nprint(1)\n```\n```js\nx\n```\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no code here") is None
