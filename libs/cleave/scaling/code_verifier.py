"""Code verifier: run a completion's program against test cases in the sandbox.

Each test runs in its own fresh sandbox (`cleave.scaling.sandbox`). A test gives the
program's stdin and expected stdout (compared after stripping trailing whitespace, per line),
and/or check code run after the program in its namespace (e.g. `assert add(2, 3) == 5`).
"""

from __future__ import annotations

import dataclasses
import enum
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from cleave.errors import InvalidArgument
from cleave.scaling.answers import extract_code
from cleave.scaling.sandbox import EXIT_CHECK_FAILED, EXIT_MEMORY, SandboxLimits, SandboxRun, run_sandboxed

MAX_CODE_TESTS = 64  # test cases one verifier runs per candidate
# A test's stdin and expected stdout together. The sandbox cuts a program's stdout at 1 MiB
# (`SandboxLimits.max_stdout_bytes`), so a longer expected output could never be matched (a
# 15 MB one failed every candidate as OUTPUT_LIMIT); within it, a test's input and output
# cost each candidate about 15 ms a MiB (written, read, compared) beside its sandbox's 30 ms,
# so MAX_CODE_TESTS bounds their sum as it bounds the runs.
MAX_TEST_IO_CHARS = 1024 * 1024
MAX_CANDIDATE_TIMEOUT_S = 120.0  # wall-clock budget of all of one candidate's tests, at most


class FailureReason(str, enum.Enum):
    """Why a test did not pass."""

    WRONG_ANSWER = "wrong_answer"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    NO_CODE = "no_code"


@dataclass(frozen=True)
class CodeTest:
    """One test case: stdin and expected stdout, and/or check code run after the program."""

    stdin: str = ""
    expected_stdout: str | None = None
    check_code: str | None = None


def check_tests(tests: Sequence[CodeTest], field: str = "tests") -> None:
    """Raise InvalidArgument (naming `field[i]`) for the first test whose stdin and expected
    stdout hold more than MAX_TEST_IO_CHARS characters."""
    for index, test in enumerate(tests):
        size = len(test.stdin) + len(test.expected_stdout or "")
        if size > MAX_TEST_IO_CHARS:
            raise InvalidArgument(f"stdin and expected_stdout hold at most {MAX_TEST_IO_CHARS} characters together, "
                                  f"got {size}", field=f"{field}[{index}]")


@dataclass(frozen=True)
class TestOutcome:
    """The result of one test; `reason` is None when it passed."""

    passed: bool
    reason: FailureReason | None
    stdout: str
    stderr: str
    elapsed_s: float


@dataclass(frozen=True)
class CodeVerification:
    """All tests of one candidate: reward is the fraction passed; `reason` the first failure's."""

    reward: float
    outcomes: list[TestOutcome]
    reason: FailureReason | None

    @property
    def passed(self) -> bool:
        """Whether every test passed."""
        return self.reason is None


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def classify(run: SandboxRun, test: CodeTest) -> FailureReason | None:
    """The failure reason of one sandboxed run of `test`, or None when it passed."""
    if run.timed_out:
        return FailureReason.TIMEOUT
    if run.output_limited:
        return FailureReason.OUTPUT_LIMIT
    if run.returncode == EXIT_MEMORY or "MemoryError" in run.stderr:
        return FailureReason.MEMORY
    if run.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit
        return FailureReason.TIMEOUT
    if run.returncode == EXIT_CHECK_FAILED:
        return FailureReason.WRONG_ANSWER
    if run.returncode != 0:
        return FailureReason.RUNTIME_ERROR
    if test.expected_stdout is not None and _normalize_output(run.stdout) != _normalize_output(test.expected_stdout):
        return FailureReason.WRONG_ANSWER
    return None


class CodeVerifier:
    """Scores completions by the fraction of `tests` their last code block passes.

    Args:
        tests: the test cases (1 to MAX_CODE_TESTS, each within MAX_TEST_IO_CHARS).
        limits: sandbox limits of each test run.
        language: fence tag of the code block to take from completions.
        total_timeout_s: wall-clock budget for all tests of one candidate (None: no budget).
    """

    def __init__(
        self,
        tests: Sequence[CodeTest],
        limits: SandboxLimits = SandboxLimits(),
        language: str = "python",
        total_timeout_s: float | None = None,
    ):
        if not tests:
            raise ValueError("CodeVerifier needs at least one test case")
        if len(tests) > MAX_CODE_TESTS:
            raise ValueError(f"CodeVerifier runs at most {MAX_CODE_TESTS} test cases, got {len(tests)}")
        check_tests(tests)
        self.tests = list(tests)
        self.limits = limits
        self.language = language
        self.total_timeout_s = total_timeout_s
        self._reported_isolation = False
        self.log = structlog.get_logger("cleave.scaling.sandbox")

    def _report_isolation(self, run: SandboxRun) -> None:
        """Say once per verifier which sandbox layers the kernel refused (the run went on
        with the others: uid drop, rlimits, the audit hook)."""
        isolation = run.isolation
        if self._reported_isolation or isolation is None:
            return
        self._reported_isolation = True
        limits = self.limits
        wanted = {"mount": limits.mount_namespace, "pid": limits.pid_namespace, "network": limits.network_namespace}
        refused = [name for name, asked in wanted.items() if asked and name not in isolation.namespaces]
        if refused or (limits.mount_namespace and not isolation.read_only_root):
            self.log.warning("the kernel refused part of the sandbox; candidates run without it",
                             refused_namespaces=refused, read_only_root=isolation.read_only_root,
                             proc=isolation.proc, uid=isolation.uid, errors=list(isolation.errors))

    def verify_program(self, program: str) -> CodeVerification:
        """Run `program` against every test; past `total_timeout_s` the rest count as timeouts."""
        outcomes = []
        started = time.monotonic()
        for test in self.tests:
            spent = time.monotonic() - started
            if self.total_timeout_s is not None and spent >= self.total_timeout_s:
                outcomes.append(TestOutcome(False, FailureReason.TIMEOUT, "", "", 0.0))
                continue
            limits = self.limits
            if self.total_timeout_s is not None:
                wall = min(limits.wall_timeout_s, self.total_timeout_s - spent)
                limits = dataclasses.replace(limits, wall_timeout_s=wall)
            run = run_sandboxed(program, stdin=test.stdin, check_code=test.check_code, limits=limits)
            self._report_isolation(run)
            reason = classify(run, test)
            outcomes.append(TestOutcome(reason is None, reason, run.stdout, run.stderr, run.elapsed_s))
        num_passed = sum(outcome.passed for outcome in outcomes)
        first_failure = next((outcome.reason for outcome in outcomes if not outcome.passed), None)
        return CodeVerification(num_passed / len(outcomes), outcomes, first_failure)

    def verify(self, text: str) -> CodeVerification:
        """Take the last code block of a completion and run it against every test."""
        program = extract_code(text, self.language)
        if program is None:
            return CodeVerification(0.0, [], FailureReason.NO_CODE)
        return self.verify_program(program)

    def score(self, text: str) -> float:
        """Reward of a completion: the fraction of tests passed."""
        return self.verify(text).reward
