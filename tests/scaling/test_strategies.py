import math

import pytest

from cleave.scaling.strategies import AnswerVotes, best_of_n, group_advantages, majority_vote, vote_summary


def test_majority_vote_counts_and_abstentions():
    winner, counts = majority_vote(["7", None, "5", "7", "5", "7"])
    assert winner == "7"
    assert counts == {"7": 3, "5": 2}
    assert list(counts) == ["7", "5"]
    assert majority_vote([None, None]) == (None, {})
    assert majority_vote([]) == (None, {})


def test_majority_vote_ties_go_to_the_earliest_first_occurrence():
    assert majority_vote(["b", "a", "a", "b"]) == ("b", {"b": 2, "a": 2})
    assert majority_vote([None, "a", "c", "c", "a"])[0] == "a"
    assert vote_summary(["x", "y", "y", "z", "x", "z"]) == [
        AnswerVotes("x", 2, [0, 4]),
        AnswerVotes("y", 2, [1, 2]),
        AnswerVotes("z", 2, [3, 5]),
    ]


def test_best_of_n_takes_the_earliest_highest_and_skips_nan():
    assert best_of_n(["a", "b", "c", "d"], [0.2, 0.9, 0.9, 0.1]) == 1
    assert best_of_n(["a", "b"], [math.nan, 0.0]) == 1
    assert best_of_n(["a", "b"], [-1.0, -1.0]) == 0
    with pytest.raises(ValueError):
        best_of_n(["a"], [1.0, 2.0])
    with pytest.raises(ValueError):
        best_of_n([], [])


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert advantages == pytest.approx([3 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-5)
    assert sum(advantages) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []
