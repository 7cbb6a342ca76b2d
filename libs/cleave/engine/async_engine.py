"""`AsyncEngine`: an `LLMEngine` stepping on its own thread, streamed to asyncio callers.

    engine = AsyncEngine(LLMEngine(config))      # starts the step thread
    async for output in engine.submit("req-1", prompt, params):
        ...                                      # delta RequestOutputs; the last is finished
    await engine.shutdown()

The engine is not thread-safe, so it is touched only by the step thread: `submit` and
`abort` post commands that the thread applies between steps, and the thread hands each
step's outputs back to the event loop in one `call_soon_threadsafe`. Tokenization and
validation run in the caller (`prepare`: `prepare_request` has no side effects), so a bad
request raises InvalidArgument from the first iteration of `submit` before anything is
queued. A structured output's grammar is compiled there too, on a worker thread: a new
JSON schema over a 128k-token vocabulary takes tens of milliseconds, which the event loop
(every other stream's outputs) should not wait for.
Torch releases the GIL in the forward, so the event loop stays responsive while a step
runs. Leaving an iteration early (break, cancellation, `aclose`) aborts the request and
frees its KV blocks. A request submitted inside a traced request gets its engine spans
(`engine.queue_wait`, `engine.prefill_forward`) from `step_trace`.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from cleave.engine.llm_engine import LLMEngine, Prompt
from cleave.engine.request import RequestState
from cleave.engine.step_trace import StepTrace, TraceOrigin
from cleave.errors import InvalidArgument, Unavailable
from cleave.generation.outputs import RequestOutput
from cleave.generation.sampling_params import SamplingParams

T = TypeVar("T")
log = structlog.get_logger(__name__)

_STOP = object()
GRAMMAR_THREADS = 2  # each compile runs on one thread (`cleave.engine.grammar`)


class AsyncEngine:
    """Runs `engine.step()` in a background thread and streams outputs per request.

    Args:
        engine: the engine to drive; only the step thread touches it after this.
        idle_wait_s: how long the thread sleeps when idle before re-checking (it is woken
            at once by new commands).
        on_step: called on the step thread with every step's outputs (all requests, also
            those added through `call` that have no stream), e.g. to batch a step's tokens
            into one message per consumer.
        on_failure: called on the step thread with the error when the engine fails (a step
            raised: every stream has failed, and nothing more runs), e.g. to end the worker
            so that its supervisor starts a fresh one.
    """

    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.5,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams between the loop and the thread
        self._error: BaseException | None = None
        self._closed = False
        self.step_trace = StepTrace()  # touched by the step thread only
        # Grammar compiles of structured outputs (`prepare`): their own threads, so a burst of
        # large specs queues here instead of taking the loop's default executor from its users.
        self._compiles = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="cleave-grammar")
        self._thread = threading.Thread(target=self._run, name="cleave-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    async def prepare(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int | None = None,
        *,
        raw: bool = False,
        prefill_only: bool = False,
    ) -> RequestState:
        """`LLMEngine.prepare_request` (tokenize, validate, build the samples) without blocking
        the event loop on a grammar compile: a request with a structured output is prepared on
        one of the engine's GRAMMAR_THREADS compile threads."""
        prepare = functools.partial(self.engine.prepare_request, request_id, prompt, params, priority, raw=raw,
                                    prefill_only=prefill_only)
        if params is not None and params.structured_output is not None:
            return await asyncio.get_running_loop().run_in_executor(self._compiles, prepare)
        return prepare()

    async def submit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int | None = None,
        *,
        raw: bool = False,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its delta outputs until the finished one."""
        self._check_open()
        state = await self.prepare(request_id, prompt, params, priority, raw=raw, prefill_only=prefill_only)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidArgument(f"{request_id!r} is already running; use a unique id", field="request_id")
            self._streams[request_id] = (loop, outputs)
        self._post(("add", state, TraceOrigin.capture()))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and not self._closed:
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with an ABORT output); unknown ids are ignored."""
        self._post(("abort", request_id))

    def abort_sample(self, request_id: str, index: int) -> None:
        """End one sample of a request (`LLMEngine.abort_sample`); unknown ids are ignored."""
        self._post(("abort_sample", request_id, index))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the step thread between steps and return its result (e.g.
        reading a prefilled request's block table, reserving blocks for incoming KV)."""
        self._check_open()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._post(("call", fn, future))
        return await future

    async def shutdown(self) -> None:
        """Stop the step thread; open streams end with Unavailable."""
        if self._closed:
            return
        self._closed = True
        self._post(_STOP)
        self._compiles.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the engine is shut down")
        if self._error is not None:
            raise Unavailable(f"the engine failed: {self._error!r}")

    def _post(self, command: Any) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- step thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._apply_commands():
                if self.engine.has_unfinished():
                    step = self.engine.step
                    self._deliver(self.step_trace.step(step) if self.step_trace.watched else step())
                else:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as error:  # the engine's state is unknown now: fail every stream
            self._error = error
            self._fail_all(Unavailable(f"the engine failed: {error!r}"))
            if self._on_failure is not None:
                self._on_failure(error)
            return  # not closed: other ranks may be stuck in the failed step; they end with the process
        self._fail_all(Unavailable("the engine shut down"))
        self._close_engine()

    def _close_engine(self) -> None:
        """`engine.close()` on the step thread, the one that drives the engine."""
        try:
            self.engine.close()
        except Exception as error:  # shutting down either way; say why the close failed
            log.warning("engine close failed", error=repr(error))

    def _apply_commands(self) -> bool:
        """Apply queued commands; False once shutdown was requested."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is _STOP:
                return False
            kind = command[0]
            if kind == "add":
                _, state, origin = command
                try:
                    self.engine.enqueue(state)
                except Exception as error:  # e.g. a duplicate id: fail that stream only
                    self._deliver_to(state.request_id, error)
                else:
                    if origin is not None:
                        self.step_trace.watch(state, origin)
            elif kind == "abort":
                self.engine.abort(command[1])
            elif kind == "abort_sample":
                self.engine.abort_sample(command[1], command[2])
            elif kind == "call":
                _, fn, future = command
                try:
                    result, error = fn(self.engine), None
                except Exception as exc:
                    result, error = None, exc
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        if self._on_step is not None:
            self._on_step(outputs)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream[0], []).append((stream[1], output))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _deliver_to(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream[0], _put_all, [(stream[1], item)])

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for request_id, _ in streams:
            self._deliver_to(request_id, error)
        while True:  # settle pending calls so no awaiter hangs
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[0] == "call":
                future = command[2]
                _call_soon(future.get_loop(), _settle, future, None, error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
