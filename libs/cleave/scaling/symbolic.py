"""Symbolic equality of two short math expressions, parsed safely and run under a time limit.

Text is first rewritten from simple LaTeX to sympy syntax, then checked against a whitelist of
characters and names (no quotes, underscores, dots outside numbers or attribute access), so
`parse_expr` only ever sees arithmetic over numbers, single-letter symbols and a fixed set of
functions. Comparisons run in a separate worker process: a pathological input (`9^9^9^9`,
a nasty `simplify`) is killed at the deadline instead of hanging the caller.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from dataclasses import dataclass

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_TREE_NODES = 300
STARTUP_TIMEOUT_S = 60.0

_FUNCTIONS = ("sqrt", "sin", "cos", "tan", "log", "ln", "exp", "pi", "E", "I", "oo", "Abs")
_LATEX_REWRITES = (
    (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
    (r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))"),
    (r"\\(sin|cos|tan|log|ln|exp)\b", r"\1"),
    (r"\\pi\b", "pi"),
    (r"\\infty\b", "oo"),
    (r"\\(?:cdot|times)", "*"),
    (r"\\div", "/"),
    (r"\{", "("),
    (r"\}", ")"),
    (r"\^", "**"),
)
_ALLOWED_RE = re.compile(r"^[0-9a-zA-Z+\-*/(). ]*$")
_NAME_RE = re.compile(r"[A-Za-z]+")
_DOT_RE = re.compile(r"(?<![0-9])\.|\.(?![0-9])")


class UnsafeExpression(ValueError):
    """The text is not a short arithmetic expression this parser accepts."""


def to_sympy_syntax(text: str) -> str:
    """Rewrite simple LaTeX into sympy syntax and reject anything outside the whitelist."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for _ in range(8):  # nested \frac{\sqrt{..}}{..} unwrap one level per pass
        before = text
        for pattern, replacement in _LATEX_REWRITES[:2]:
            text = re.sub(pattern, replacement, text)
        if text == before:
            break
    for pattern, replacement in _LATEX_REWRITES[2:-3]:
        text = re.sub(pattern, replacement, text)
    for pattern, replacement in _LATEX_REWRITES[-3:]:
        text = re.sub(pattern, replacement, text)
    if not _ALLOWED_RE.match(text) or _DOT_RE.search(text):
        raise UnsafeExpression(f"unsupported characters in {text!r}")
    for name in _NAME_RE.findall(text):
        if len(name) > 1 and name not in _FUNCTIONS:
            raise UnsafeExpression(f"unknown name {name!r}")
    return text


def _parse(text: str):
    import sympy
    from sympy.parsing.sympy_parser import auto_number, implicit_multiplication, parse_expr

    source = to_sympy_syntax(text)
    names = {
        "sqrt": sympy.sqrt, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan,
        "log": sympy.log, "ln": sympy.log, "exp": sympy.exp, "pi": sympy.pi, "E": sympy.E,
        "I": sympy.I, "oo": sympy.oo, "Abs": sympy.Abs,
    }
    for name in set(_NAME_RE.findall(source)) - set(names):
        names[name] = sympy.Symbol(name)
    global_names = {
        name: getattr(sympy, name)
        for name in ("Integer", "Float", "Rational", "Symbol", "Function", "Add", "Mul", "Pow")
    }
    expression = parse_expr(
        source,
        local_dict=names,
        global_dict=global_names,
        transformations=(auto_number, implicit_multiplication),
        evaluate=False,
    )
    nodes = 0
    for node in sympy.preorder_traversal(expression):
        nodes += 1
        if nodes > MAX_TREE_NODES:
            raise UnsafeExpression("expression tree too large")
        if isinstance(node, sympy.Pow) and (
            node.exp.has(sympy.Pow) or (node.exp.is_Number and abs(node.exp) > MAX_EXPONENT)
        ):
            raise UnsafeExpression("exponent too large or a power tower")
    return expression


def symbolic_equal(left: str, right: str) -> bool:
    """Whether two expressions are mathematically equal (runs in the caller; no time limit)."""
    import sympy

    left_expr, right_expr = _parse(left), _parse(right)
    difference = sympy.simplify(left_expr - right_expr)
    if difference == 0:
        return True
    if difference.free_symbols:
        return False
    value = sympy.N(difference, 30)
    return value.is_number and abs(complex(value)) < 1e-12


def _serve(connection) -> None:
    while True:
        try:
            left, right = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", symbolic_equal(left, right)))
        except Exception as error:  # a rejected or unparsable expression is simply not equal
            connection.send(("error", f"{type(error).__name__}: {error}"))


@dataclass(frozen=True)
class SymbolicOutcome:
    """Result of one symbolic comparison: equal, or why it could not be decided."""

    equal: bool
    error: str | None = None


class SymbolicWorker:
    """A worker process that compares expressions; restarted when a comparison times out.

    Thread-safe: callers take turns. `close()` stops the process.
    """

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end,), daemon=True)
        self._process.start()
        child_end.close()
        self._connection = parent_end
        # Wait for the worker's start and its sympy import outside any comparison's deadline.
        parent_end.send(("0", "0"))
        if not parent_end.poll(STARTUP_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"symbolic worker did not start within {STARTUP_TIMEOUT_S}s")
        parent_end.recv()

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._connection.close()
        self._process = None
        self._connection = None

    def compare(self, left: str, right: str) -> SymbolicOutcome:
        """Compare in the worker; a comparison past `timeout_s` counts as not equal."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._stop()
                self._start()
            self._connection.send((left, right))
            if not self._connection.poll(self.timeout_s):
                self._stop()
                return SymbolicOutcome(False, f"timed out after {self.timeout_s}s")
            status, value = self._connection.recv()
            if status == "ok":
                return SymbolicOutcome(bool(value))
            return SymbolicOutcome(False, value)

    def close(self) -> None:
        """Stop the worker process."""
        with self._lock:
            self._stop()
