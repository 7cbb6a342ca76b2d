"""Final-answer and code extraction from reasoning outputs, and answer normalization.

A reasoning model writes `<think> ... </think>` and then its answer. The answer is looked for
only after the last `</think>` (an unterminated think block has no answer), in this order:
the last `\\boxed{...}`, the last "The answer is X" / "Answer: X" sentence, the last number.
`normalize_answer` maps equal-looking answers to one string so votes can be counted:
`" $\\boxed{0.750}$. "` -> `"0.75"`, `"\\frac{6}{8}"` -> `"0.75"`, `"1,234"` -> `"1234"`.
"""

from __future__ import annotations

import re
from fractions import Fraction

THINK_START = "<think>"
THINK_END = "</think>"
MAX_NUMBER_CHARS = 64  # Fraction("1e999999999") would take forever; real answers are short

_ANSWER_SENTENCE_RE = re.compile(
    r"(?:the\s+(?:final\s+)?answer\s+is|final\s+answer\s*:|answer\s*:)\s*:?\s*(.+?)\s*(?:\.\s|\.?$|\n)",
    re.IGNORECASE,
)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?$")
_FRACTION_RE = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")
_LATEX_FRAC_RE = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")


def answer_region(text: str) -> str | None:
    """The part of `text` that may hold the answer, or None inside an unfinished think block."""
    if THINK_END in text:
        return text.rsplit(THINK_END, 1)[1]
    if THINK_START in text:
        return None
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), with balanced braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    index = text.index("{", start) + 1
    depth = 1
    for position in range(index, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[index:position]
    return None


def extract_final_answer(text: str) -> str | None:
    """The raw final answer of a completion (not normalized), or None when it states none."""
    region = answer_region(text)
    if region is None:
        return None
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed.strip()
    sentences = _ANSWER_SENTENCE_RE.findall(region)
    if sentences:
        return sentences[-1].strip()
    numbers = _NUMBER_RE.findall(region)
    return numbers[-1] if numbers else None


def extract_code(text: str, language: str = "python") -> str | None:
    """The last fenced code block of `language` (or untagged) after the think block."""
    region = answer_region(text)
    if region is None:
        return None
    blocks = [body for tag, body in _FENCE_RE.findall(region) if tag.lower() in ("", language, "py")]
    return blocks[-1] if blocks else None


def parse_number(answer: str) -> Fraction | None:
    """An exact rational for integers, decimals, `a/b` and `\\frac{a}{b}`; None otherwise."""
    text = answer.strip().replace(" ", "")
    if not text or len(text) > MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS_RE.match(text):
        text = text.replace(",", "")
    latex = _LATEX_FRAC_RE.match(text)
    if latex is not None:
        sign, numerator, denominator = latex.groups()
        numerator_value, denominator_value = parse_number(numerator), parse_number(denominator)
        if numerator_value is None or not denominator_value:
            return None
        value = numerator_value / denominator_value
        return -value if sign == "-" else value
    fraction = _FRACTION_RE.match(text)
    if fraction is not None:
        if int(fraction.group(2)) == 0:
            return None
        return Fraction(int(fraction.group(1)), int(fraction.group(2)))
    if _DECIMAL_RE.match(text):
        return Fraction(text)
    return None


def format_number(value: Fraction) -> str:
    """Canonical text of a rational: `5`, `0.75`, or `1/3` when the decimal does not end."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    scaled = value
    while scaled.denominator != 1:
        scaled *= 10
        digits += 1
    sign = "-" if scaled < 0 else ""
    magnitude = str(abs(scaled.numerator)).rjust(digits + 1, "0")
    return f"{sign}{magnitude[:-digits]}.{magnitude[-digits:]}"


def strip_latex(answer: str) -> str:
    """Remove math delimiters, `\\boxed`, text wrappers, `\\left`/`\\right` and end punctuation."""
    text = answer.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    for delimiter in ("$$", "$", "\\(", "\\)", "\\[", "\\]"):
        text = text.replace(delimiter, "")
    text = _TEXT_WRAPPER_RE.sub(r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.strip().rstrip(".").strip()


def normalize_answer(answer: str | None) -> str | None:
    """One canonical string per answer; numbers become their exact canonical form."""
    if answer is None:
        return None
    text = strip_latex(answer)
    if not text:
        return None
    number = parse_number(text)
    if number is not None:
        return format_number(number)
    return " ".join(text.split())
