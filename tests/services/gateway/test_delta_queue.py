"""`DeltaQueue`: a lagging request's deltas merged per sample, in order, never across an error
or past a sample's end, never into a delta its consumer has taken; the token counts, log
probabilities and ending of the merged deltas are those of the deltas one by one."""

from __future__ import annotations

from cleave.proto.cleave.v1 import common_pb2, decode_pb2
from services.gateway.attach import WorkerLost
from services.gateway.delta_queue import DeltaQueue


def delta(request_id: str, sample: int, *tokens: int, reasoning: int = 0, finish: int = 0,
          logprob: float | None = None) -> decode_pb2.RequestDelta:
    message = decode_pb2.RequestDelta(request_id=request_id, sample_index=sample, token_ids=list(tokens),
                                      num_reasoning_tokens=reasoning, finish_reason=finish)
    if logprob is not None:
        for token in tokens:
            scores = message.logprobs.add()
            scores.sampled.token_id, scores.sampled.logprob = token, logprob
    return message


def drain(queue: DeltaQueue) -> list:
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_a_samples_queued_deltas_merge_with_their_counts_and_scores():
    queue = DeltaQueue()
    first = delta("w", 0, 1, reasoning=1, logprob=-0.1)
    queue.put_nowait(first)
    queue.put_nowait(delta("w", 0, 2, reasoning=1, logprob=-0.2))
    queue.put_nowait(delta("w", 0, 3, 4, reasoning=1, logprob=-0.3))
    head, merged = drain(queue)
    assert head is first  # into an empty queue as it came
    assert list(merged.token_ids) == [2, 3, 4]
    assert merged.num_reasoning_tokens == 2
    assert [(s.sampled.token_id, round(s.sampled.logprob, 3)) for s in merged.logprobs] == [(2, -0.2), (3, -0.3),
                                                                                               (4, -0.3)]
    assert merged.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


def test_the_ending_delta_merges_and_closes_its_sample():
    queue = DeltaQueue()
    queue.put_nowait(delta("w", 0, 1))
    queue.put_nowait(delta("w", 0, 2))
    queue.put_nowait(delta("w", 0, 3, finish=common_pb2.FINISH_REASON_LENGTH))
    queue.put_nowait(delta("w", 0, 4))  # nothing should follow an end; if it does, it stands apart
    items = drain(queue)
    assert [(list(item.token_ids), item.finish_reason) for item in items] == [
        ([1], 0), ([2, 3], common_pb2.FINISH_REASON_LENGTH), ([4], 0)]


def test_nothing_merges_across_an_error_or_between_worker_requests():
    queue = DeltaQueue()
    queue.put_nowait(delta("w", 0, 1))
    queue.put_nowait(delta("w", 0, 2))
    queue.put_nowait(delta("moved", 0, 3))  # the same sample's new worker request after a move
    queue.put_nowait(lost := WorkerLost("gone", "w"))
    queue.put_nowait(delta("moved", 0, 4))
    items = drain(queue)
    assert items[3] is lost
    assert [(item.request_id, list(item.token_ids)) for item in items if item is not lost] == [
        ("w", [1]), ("w", [2]), ("moved", [3]), ("moved", [4])]


def test_a_taken_delta_takes_no_more_tokens():
    queue = DeltaQueue()
    queue.put_nowait(delta("w", 0, 1))
    queue.put_nowait(delta("w", 0, 2))
    assert list(queue.get_nowait().token_ids) == [1]
    taken = queue.get_nowait()
    queue.put_nowait(delta("w", 0, 3))  # the queue is empty again: a new head
    queue.put_nowait(delta("w", 0, 4))
    assert list(taken.token_ids) == [2]
    assert [list(item.token_ids) for item in drain(queue)] == [[3], [4]]
