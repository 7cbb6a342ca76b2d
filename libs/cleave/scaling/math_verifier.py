"""Math verifier: does a completion's final answer equal the expected answer?

Equality is decided in three steps, cheapest first: the normalized strings match; both
parse as exact rationals (`3/4`, `0.75`, `\\frac{3}{4}`, `1,000`) and are equal; or, when
sympy is installed, both parse as short expressions whose difference simplifies to zero
(`\\frac{\\sqrt{2}}{2}` == `1/sqrt(2)`), decided in a worker process under a time limit.
"""

from __future__ import annotations

import importlib.util
import threading

from cleave.errors import InvalidArgument
from cleave.scaling.answers import extract_final_answer, normalize_answer, parse_number, strip_latex
from cleave.scaling.symbolic import SymbolicWorker, UnsafeExpression, to_sympy_syntax

# Real answers are short (a number, an expression, a tuple; symbolic comparison takes 200
# characters at most), and each sample's comparison reads the expected answer again: 30 MB
# took 0.9 s to normalise and 0.5 s a sample, 64 KiB (a structured-output spec's bound) 3 ms.
MAX_EXPECTED_ANSWER_CHARS = 64 * 1024


def check_expected_answer(expected_answer: str, field: str = "expected_answer") -> None:
    """Raise InvalidArgument (naming `field`) when `expected_answer` is longer than
    MAX_EXPECTED_ANSWER_CHARS."""
    if len(expected_answer) > MAX_EXPECTED_ANSWER_CHARS:
        raise InvalidArgument(f"at most {MAX_EXPECTED_ANSWER_CHARS} characters, got {len(expected_answer)}; "
                              "give the final answer alone", field=field)


def _looks_symbolic(text: str) -> bool:
    try:
        to_sympy_syntax(text)
    except UnsafeExpression:
        return False
    return True


class MathVerifier:
    """Scores completions 1.0 when their final answer equals `expected_answer`, else 0.0.

    Args:
        expected_answer: the reference answer (plain, LaTeX or `\\boxed{}`), at most
            MAX_EXPECTED_ANSWER_CHARS characters.
        timeout_s: time limit of one symbolic comparison.
        use_sympy: allow symbolic comparison (only when sympy is installed).

    Holds a worker process once a symbolic comparison was needed; `close()` stops it.
    """

    def __init__(self, expected_answer: str, *, timeout_s: float = 2.0, use_sympy: bool = True) -> None:
        check_expected_answer(expected_answer)
        self.expected_answer = expected_answer
        self.timeout_s = timeout_s
        self.use_sympy = use_sympy and importlib.util.find_spec("sympy") is not None
        self._expected_normalized = normalize_answer(expected_answer)
        self._worker: SymbolicWorker | None = None
        self._worker_lock = threading.Lock()

    def answers_equal(self, candidate_answer: str | None) -> bool:
        """Whether an already-extracted answer equals the expected answer."""
        candidate = normalize_answer(candidate_answer)
        if candidate is None or self._expected_normalized is None:
            return False
        if candidate == self._expected_normalized:
            return True
        candidate_number = parse_number(candidate)
        expected_number = parse_number(self._expected_normalized)
        if candidate_number is not None and expected_number is not None:
            return candidate_number == expected_number
        if not self.use_sympy:
            return False
        left, right = strip_latex(candidate), strip_latex(self.expected_answer)
        if not (_looks_symbolic(left) and _looks_symbolic(right)):
            return False
        with self._worker_lock:
            if self._worker is None:
                self._worker = SymbolicWorker(self.timeout_s)
            worker = self._worker
        return worker.compare(left, right).equal

    def score(self, text: str) -> float:
        """Reward of a full completion: 1.0 when its final answer is correct, else 0.0."""
        return 1.0 if self.answers_equal(extract_final_answer(text)) else 0.0

    def close(self) -> None:
        """Stop the symbolic worker, if one was started."""
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
