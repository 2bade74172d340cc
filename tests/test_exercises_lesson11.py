"""Lesson 11's checkers: the blocks of a running batch and one round of speculative verification."""

from kvlessons import exercises
from kvlessons.exercises import lesson11


def test_the_batch_scenario_is_what_the_lesson_describes():
    tables, names = lesson11.batch_scenario()
    tables.check_invariants()
    # A holds 70 positions in ceil(70/16) = 5 blocks; B and C read the system prompt's 2 full blocks from A.
    assert {n: tables.sequences[s].table for n, s in names.items()} == {
        "A": [0, 1, 2, 3, 4], "B": [0, 1, 5, 6, 7, 8, 9], "C": [0, 1, 10, 11]}
    assert tables.allocator.num_free == 24 - 5 - 5 - 2


def test_freed_blocks_right_and_named_slips():
    assert exercises.check_freed_blocks([5, 6, 7, 8, 9])
    assert exercises.check_freed_blocks((9, 8, 7, 6, 5))
    cases = {
        "B's whole table": [0, 1, 5, 6, 7, 8, 9],
        "B alone holds more": [5, 6, 7],
        "not in B's table": [5, 6, 7, 8, 9, 10],
        "belong to other sequences": [2, 3],
        "Expected a list": "5, 6, 7",
    }
    for words, value in cases.items():
        fb = exercises.check_freed_blocks(value)
        assert not fb and words in fb.message, (words, fb.message)
    assert not exercises.check_freed_blocks([5, 5, 6, 7, 8, 9])  # a block listed twice is not freed twice


def test_requests_fit_right_and_named_slips():
    # written out: 12 free + B's 5 own blocks = 17; a 24-position request needs ceil(24/16) = 2 blocks; 17 // 2 = 8
    assert exercises.check_requests_fit(8)
    cases = {11: "free slots", 6: "before B finished", 9: "shared blocks", 12: "whole pool", 17: "not of requests"}
    for value, words in cases.items():
        fb = exercises.check_requests_fit(value)
        assert not fb and words in fb.message, (value, fb.message)
    assert "Hint 3/3" in exercises.hint("requests_fit", 3)


def _accepted(p, c):
    a = 0
    while a < len(p) and p[a] == c[a]:
        a += 1
    return a


def test_verify_round_right_and_named_slips():
    def right(p, c, n):
        a = _accepted(p, c)
        return p[:a] + [c[a]], n + 1 + a

    assert exercises.check_verify_round(right)
    assert exercises.check_verify_round(lambda p, c, n: (tuple(right(p, c, n)[0]), right(p, c, n)[1]))
    import torch

    assert exercises.check_verify_round(lambda p, c, n: (torch.tensor(right(p, c, n)[0]), torch.tensor(right(p, c, n)[1])))
    cases = {
        "leaves out the target's own token": lambda p, c, n: (p[: _accepted(p, c)], n + 1 + _accepted(p, c)),
        "one short": lambda p, c, n: (right(p, c, n)[0], n + _accepted(p, c)),
        "rejected ones must be cropped": lambda p, c, n: (right(p, c, n)[0], n + 1 + len(p)),
        "one position too many": lambda p, c, n: (right(p, c, n)[0], n + 2 + _accepted(p, c)),
        "after the first disagreement": lambda p, c, n: (
            [x for x, y in zip(p, c) if x == y] + [c[sum(x == y for x, y in zip(p, c))]],
            n + 1 + sum(x == y for x, y in zip(p, c))),
        "return two things": lambda p, c, n: right(p, c, n)[0],
        "list of ints": lambda p, c, n: (None, 3),
        "still the stub": lambda p, c, n: (_ for _ in ()).throw(NotImplementedError()),
        "IndexError": lambda p, c, n: (p[:1] + [c[len(p) + 3]], n),
        "a list even when the round emits one token": lambda p, c, n: (c[0], n + 1),
        "rejected proposal": lambda p, c, n: (p[: _accepted(p, c) + 1], n + 1 + _accepted(p, c)),
        "start from cached": lambda p, c, n: (right(p, c, n)[0], 1 + _accepted(p, c)),
    }
    for words, fn in cases.items():
        fb = exercises.check_verify_round(fn)
        assert not fb and words in fb.message, (words, fb.message)
    assert "Expected your function" in exercises.check_verify_round(None).message
