"""benchmarks/draft_replay.py: llama.cpp's ngram-simple as it is documented, and the replay's round arithmetic."""

from benchmarks.draft_replay import ngram_simple, replay_answer
from paraspec.drafters.adaptive import ForwardCost


def test_ngram_simple_takes_the_last_earlier_occurrence():
    sequence = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_simple(sequence, 3, 4) == [7, 8, 5, 1]  # the later of the two earlier "1 2 3", not the first
    assert ngram_simple(sequence, 3, 2) == [7, 8]
    assert ngram_simple([4, 5, 6], 3, 4) == []  # no earlier occurrence
    assert ngram_simple([1, 2, 1, 2], 2, 16) == [1, 2]  # the continuation runs up to the end


def test_replay_counts_rounds_and_costs():
    cost = ForwardCost({1: 1.0, 2: 1.5, 4: 2.0})
    answer = [10, 11, 12, 13, 14]
    calls = []

    def propose(sequence, k, pending):
        calls.append((len(sequence), k, pending))
        return [11, 12, 99][:k] if len(sequence) == 3 else []  # right twice, then wrong, in the second round

    out = replay_answer([1, 2], answer, cost, propose, lambda *a: None)
    # round 1: the prompt (2 pending), commits 10; round 2: 3 drafts, 2 accepted + 13; round 3: plain, 14
    assert calls == [(2, 4, 2), (3, 3, 1), (6, 0, 1)]
    assert out["seconds"] == cost(4) + cost(1)  # the prompt round is not counted
    assert out["ar_seconds"] == 4 * cost(1)
    assert (out["draft_rounds"], out["drafted"], out["accepted"]) == (1, 3, 2)
