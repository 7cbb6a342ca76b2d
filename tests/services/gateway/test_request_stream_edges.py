"""`stream_samples` at its edges, fed by hand: worker deltas go into the request's queue as an
Attach stream would put them, so each test decides which deltas arrive together. Ready deltas
make one chunk, a sample a stop string ends here is aborted on its worker once (and only
with n > 1), a migration with nothing new sends no empty chunk, the prompt's scores ride on
one chunk, a vote shows the winner's body, and the usage counts the cached prompt.

The model is the tiny checkpoint without its reasoning config (token id i is the character
chr(i + 28): "A" is 37), except where a think block is the point.
"""

from __future__ import annotations

import shutil

import pytest

from cleave.config import ModelConfig as ServedModelConfig
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning_formats import special_tag_tokens
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2, decode_pb2
from cleave.rpc.types import ReasoningOptions
from cleave.scaling.strategies import Strategy
from services.gateway.attach import WorkerLost
from services.gateway.backend import GenerateChunk, GenerateSpec, Prompt, Scaling, StreamShape
from services.gateway.delta_queue import DeltaQueue
from services.gateway.model import ServedModel
from services.gateway.placement import RunningRequest, WorkerRequest
from services.gateway.request_stream import stream_samples

PROMPT = (40, 41, 42)
LENGTH = common_pb2.FINISH_REASON_LENGTH


def ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of `text`'s characters (one token each)."""
    return [ord(character) - 28 for character in text]


@pytest.fixture(scope="module")
def plain_model(model_dir, tmp_path_factory) -> ServedModel:
    directory = tmp_path_factory.mktemp("plain")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, directory / name)
    return ServedModel(ServedModelConfig(source=str(directory), served_name="tiny-plain"))


@pytest.fixture(scope="module")
def reasoning_model(model_dir) -> ServedModel:
    return ServedModel(ServedModelConfig(source=str(model_dir), served_name="tiny-reasoning"))


def request(n: int = 1, stop: tuple[str, ...] = (), strategy: Strategy = Strategy.NONE,
            return_all_samples: bool = False, continuous_usage: bool = False) -> GenerateSpec:
    return GenerateSpec(
        request_id="req", model="tiny", prompt=Prompt(token_ids=PROMPT),
        sampling=SamplingParams(max_tokens=16, n=n, stop=list(stop), ignore_eos=True),
        reasoning=ReasoningOptions(), scaling=Scaling(strategy, n, return_all_samples=return_all_samples),
        stream=StreamShape(include_token_ids=True, continuous_usage=continuous_usage))


def delta(sample_index: int, text: str, finish: int = 0, worker_request_id: str = "w1",
          prompt_score: float | None = None) -> decode_pb2.RequestDelta:
    """A worker's delta; with `prompt_score`, the prompt's scores (each token that logprob)."""
    scores = [common_pb2.TopLogprobs(sampled=common_pb2.TokenLogprob(token_id=token, logprob=prompt_score))
              for token in PROMPT[1:]] if prompt_score is not None else []
    return decode_pb2.RequestDelta(request_id=worker_request_id, sample_index=sample_index, token_ids=ids(text),
                                   finish_reason=finish, prompt_logprobs=scores)


class Worker:
    """The request's queue and worker requests, and what the stream asked of its workers
    (per-sample aborts, migrations)."""

    def __init__(self, n: int) -> None:
        self.running = RunningRequest(DeltaQueue())
        self.add("w1", tuple(range(n)))
        self.finished = [False] * n
        self.aborted: list[int] = []
        self.lost: list[str] = []
        self.after_migration: list[decode_pb2.RequestDelta] = []  # the new worker's deltas

    def add(self, worker_request_id: str, sample_indices: tuple[int, ...]) -> None:
        self.running.add(WorkerRequest(worker_request_id, decode=None, stream=None,  # type: ignore[arg-type]
                                       sample_indices=sample_indices))

    def send(self, *deltas: object) -> None:
        for item in deltas:
            self.running.queue.put_nowait(item)

    async def migrate(self, lost, texts):  # type: ignore[no-untyped-def]
        """Every lost sample restarts on "w2", which streams `after_migration` from there."""
        self.lost.extend(item.worker_request_id for item in lost)
        self.add("w2", tuple(text.index for text in texts))
        self.send(*self.after_migration)
        return []

    def stream(self, model: ServedModel, spec: GenerateSpec, num_cached: int = 0):  # type: ignore[no-untyped-def]
        return stream_samples(spec, list(PROMPT), num_cached, self.running, self.finished, model=model,
                              tag_tokens=special_tag_tokens(model.tokenizer, model.reasoning),
                              migrate=self.migrate, abort_sample=self.aborted.append)


async def collect(chunks) -> list[GenerateChunk]:  # type: ignore[no-untyped-def]
    return [chunk async for chunk in chunks]


def body(chunk: GenerateChunk) -> list[tuple[int, str, tuple[int, ...], FinishReason | None]]:
    return [(s.index, s.text, s.token_ids, s.finish_reason) for s in chunk.samples]


async def test_deltas_ready_together_make_one_chunk_with_the_text_of_one_long_delta(plain_model):
    apart, together = Worker(1), Worker(1)
    apart.send(delta(0, "AB"), delta(0, "CD"), delta(0, "EF", LENGTH))
    together.send(delta(0, "ABCDEF", LENGTH))
    apart_chunks = await collect(apart.stream(plain_model, request()))
    together_chunks = await collect(together.stream(plain_model, request()))
    assert len(apart_chunks) == len(together_chunks) == 2  # the news, then the final usage
    whole = [(0, "ABCDEF", tuple(ids("ABCDEF")), FinishReason.LENGTH)]
    assert body(apart_chunks[0]) == body(together_chunks[0]) == whole
    assert apart.finished == [True]


async def test_a_sample_a_stop_string_ends_here_is_aborted_on_its_worker_once(plain_model):
    """Sample 1's stop string matches in its first delta; its worker, not told yet, sends
    two more: one per-sample Abort all the same, and the worker never ended it."""
    worker = Worker(2)
    worker.send(delta(1, "ABC"), delta(0, "KL"), delta(1, "DE"), delta(1, "FG"))
    worker.send(delta(0, "MN", LENGTH))
    chunks = await collect(worker.stream(plain_model, request(n=2, stop=("B",))))
    assert worker.aborted == [1] and worker.finished == [True, False]
    samples = {sample.index: sample for chunk in chunks for sample in chunk.samples if sample.text}
    assert (samples[1].text, samples[1].finish_reason) == ("A", FinishReason.STOP)


async def test_the_only_sample_a_stop_string_ends_is_left_to_the_caller_to_abort(plain_model):
    worker = Worker(1)
    worker.send(delta(0, "ABC"))
    chunks = await collect(worker.stream(plain_model, request(stop=("B",))))
    assert worker.aborted == [] and worker.finished == [False]  # the caller aborts the whole request
    assert body(chunks[0]) == [(0, "A", tuple(ids("AB")), FinishReason.STOP)]


async def test_a_migration_with_nothing_new_sends_no_empty_chunk(plain_model):
    worker = Worker(1)
    worker.after_migration = [delta(0, "XY", LENGTH, worker_request_id="w2")]
    worker.send(delta(0, "AB"))
    chunks = worker.stream(plain_model, request())
    assert body(await anext(chunks)) == [(0, "AB", tuple(ids("AB")), None)]
    worker.send(WorkerLost("decode worker gone", "w1"))
    rest = await collect(chunks)
    assert worker.lost == ["w1"]
    assert [body(chunk) for chunk in rest[:-1]] == [[(0, "XY", tuple(ids("XY")), FinishReason.LENGTH)]]
    assert rest[-1].samples == () and rest[-1].usage is not None


async def test_the_prompt_scores_ride_on_one_chunk_only(plain_model):
    """Two worker requests' deltas both score the prompt (a split request's second worker
    should not, but may): the first scores go out on the first chunk, none on later ones."""
    worker = Worker(2)
    worker.send(delta(0, "AB", prompt_score=-1.0), delta(1, "CD", prompt_score=-2.0))
    chunks = worker.stream(plain_model, request(n=2))
    first = await anext(chunks)
    assert first.prompt_token_ids == PROMPT
    assert [(lp.sampled.token_id, lp.sampled.logprob) for lp in first.prompt_logprobs] == [(41, -1.0), (42, -1.0)]
    worker.send(delta(0, "E", LENGTH), delta(1, "F", LENGTH))
    later = await collect(chunks)
    assert [body(chunk) for chunk in later[:-1]] == [[(0, "E", tuple(ids("E")), FinishReason.LENGTH),
                                                      (1, "F", tuple(ids("F")), FinishReason.LENGTH)]]
    assert all((chunk.prompt_logprobs, chunk.prompt_token_ids) == ((), ()) for chunk in later)


def vote_on(worker: Worker) -> None:
    """Sample 0 answers 1, samples 1 and 2 answer 2: the vote picks sample 1."""
    worker.send(*(delta(index, answer, LENGTH) for index, answer in enumerate("122")))


async def test_a_vote_holds_the_samples_and_shows_only_the_winners_body(plain_model):
    worker = Worker(3)
    vote_on(worker)
    (final,) = await collect(worker.stream(plain_model, request(n=3, strategy=Strategy.MAJORITY_VOTE)))
    assert final.selected_index == 1
    assert [(s.index, s.text, s.token_ids, s.answer) for s in final.samples] == [
        (0, "", (), "1"), (1, "2", tuple(ids("2")), "2"), (2, "", (), "2")]


async def test_a_vote_returning_all_samples_streams_them_as_they_come(plain_model):
    worker = Worker(3)
    vote_on(worker)
    *streamed, final = await collect(worker.stream(
        plain_model, request(n=3, strategy=Strategy.MAJORITY_VOTE, return_all_samples=True)))
    assert [body(chunk) for chunk in streamed] == [[
        (index, answer, tuple(ids(answer)), FinishReason.LENGTH) for index, answer in enumerate("122")]]
    assert final.selected_index == 1
    assert [(s.text, s.answer) for s in final.samples] == [("", "1"), ("", "2"), ("", "2")]


async def test_each_chunk_carries_the_usage_with_continuous_usage_and_the_final_counts_the_cache(plain_model):
    worker = Worker(1)
    worker.send(delta(0, "AB"))
    chunks = worker.stream(plain_model, request(continuous_usage=True), num_cached=2)
    first = await anext(chunks)
    assert first.usage is not None and (first.usage.prompt_tokens, first.usage.completion_tokens) == (3, 2)
    worker.send(delta(0, "C", LENGTH))
    *_, final = await collect(chunks)
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (3, 3, 2)


async def test_a_vote_counts_the_answer_after_a_closed_think_block(reasoning_model):
    """The verifier sees a sample's answer once its think block closed, not its thoughts."""
    worker = Worker(2)
    tokenizer = reasoning_model.tokenizer
    for index, answer in enumerate(("7", "7")):
        worker.send(decode_pb2.RequestDelta(
            request_id="w1", sample_index=index, finish_reason=LENGTH,
            token_ids=tokenizer.encode(f"so 3</think>{answer}", add_special_tokens=False)))
    *_, final = await collect(worker.stream(reasoning_model, request(n=2, strategy=Strategy.MAJORITY_VOTE)))
    assert final.selected_index == 0 and [sample.answer for sample in final.samples] == ["7", "7"]
