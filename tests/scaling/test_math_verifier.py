import pytest

from cleave.errors import InvalidArgument
from cleave.scaling.math_verifier import MAX_EXPECTED_ANSWER_CHARS, MathVerifier
from cleave.scaling.symbolic import UnsafeExpression, to_sympy_syntax


@pytest.fixture(scope="module")
def verify():
    verifiers: dict[str, MathVerifier] = {}

    def equal(candidate: str, expected: str) -> bool:
        verifier = verifiers.setdefault(expected, MathVerifier(expected, timeout_s=5.0))
        return verifier.answers_equal(candidate)

    yield equal
    for verifier in verifiers.values():
        verifier.close()


@pytest.mark.parametrize(
    "candidate, expected",
    [
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("\\boxed{12}", "12"),
        ("12.0", "12"),
        ("1,000", "1000"),
        ("-0.5", "-\\frac{1}{2}"),
        ("\\frac{\\sqrt{2}}{2}", "1/sqrt(2)"),
        ("2x+2", "2(x+1)"),
        ("x^2 - 1", "(x-1)(x+1)"),
        ("\\pi/2", "\\frac{\\pi}{2}"),
    ],
)
def test_equal_answers(verify, candidate, expected):
    assert verify(candidate, expected)


@pytest.mark.parametrize(
    "candidate, expected",
    [
        ("0.333", "1/3"),
        ("13", "12"),
        ("x^2", "x"),
        ("2x+1", "2(x+1)"),
        ("", "1"),
        ("__import__('os').system('true')", "0"),
        ("9^9^9^9", "1"),
    ],
)
def test_unequal_answers(verify, candidate, expected):
    assert not verify(candidate, expected)


def test_score_uses_the_final_answer_only():
    verifier = MathVerifier("5791", use_sympy=False)
    assert verifier.score("<think>5790?</think> The answer is 5791.") == 1.0
    assert verifier.score("<think>5791</think> The answer is 5790.") == 0.0
    assert verifier.score("<think>5791") == 0.0


def test_an_expected_answer_is_bounded():
    longest = "1" * MAX_EXPECTED_ANSWER_CHARS
    assert MathVerifier(longest, use_sympy=False).score(f"\\boxed{{{longest}}}") == 1.0
    with pytest.raises(InvalidArgument, match=f"at most {MAX_EXPECTED_ANSWER_CHARS} characters, got") as raised:
        MathVerifier(longest + "1", use_sympy=False)
    assert raised.value.field == "expected_answer"


@pytest.mark.parametrize("text", ["a.b", "x_1", "open(1)", "'1'", "lambda"])
def test_parser_whitelist_rejects(text):
    with pytest.raises(UnsafeExpression):
        to_sympy_syntax(text)


def test_symbolic_worker_is_killed_at_the_deadline_and_restarted():
    from cleave.scaling.symbolic import SymbolicWorker

    worker = SymbolicWorker(timeout_s=0.0)
    try:
        outcome = worker.compare("(x+1)^30", "(1+x)^30")
        assert outcome == type(outcome)(False, "timed out after 0.0s")
        worker.timeout_s = 10.0
        assert worker.compare("(x+1)^2", "x^2+2x+1").equal
    finally:
        worker.close()
