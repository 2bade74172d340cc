"""Lesson 11's exercises: the block arithmetic of a running batch, and one round of speculative verification."""

from __future__ import annotations

from .core import Feedback, NumericExercise, as_int, as_ints, check_parts, describe_error

__all__ = [
    "BATCH_BLOCK_SIZE", "BATCH_POOL_BLOCKS", "NEWCOMER_LEN", "REQUESTS_FIT", "VERIFY_HINTS",
    "batch_scenario", "check_freed_blocks", "check_requests_fit", "check_verify_round",
]

# -- 11.1 blocks of a running batch ----------------------------------------------------------------

BATCH_POOL_BLOCKS, BATCH_BLOCK_SIZE = 24, 16
SYSTEM_LEN = 40  # the system prompt the three chats share
HELD = {"A": 70, "B": 100, "C": 52}  # positions each chat holds in the cache now
NEWCOMER_LEN = 24  # positions each newcomer will need


def batch_scenario():
    """The running batch of exercise 11.1, built on the course's own block tables.

    Three chats share a 40-token system prompt; A came first, so its first two blocks
    (positions 0-31, all system prompt) are in the prefix cache when B and C arrive and
    read them from there. Returns ``(tables, names)``: the BlockTables and ``{name: seq_id}``.
    """
    from ..paging import BlockTables

    tables = BlockTables(BATCH_POOL_BLOCKS, BATCH_BLOCK_SIZE)
    system = list(range(1000, 1000 + SYSTEM_LEN))
    names = {}
    for i, (name, held) in enumerate(HELD.items()):
        ids = system + [2000 + 100 * i + j for j in range(held - SYSTEM_LEN)]  # each chat's own words after the system prompt
        seq, reused = tables.add_sequence(ids)
        tables.append(seq, held - reused, ids[reused:])
        names[name] = seq
    return tables, names


def _answers():
    tables, names = batch_scenario()
    b = tables.sequences[names["B"]].table
    freed = sorted(x for x in b if tables.allocator.ref_counts[x] == 1)
    shared = sorted(x for x in b if tables.allocator.ref_counts[x] > 1)
    free_before = tables.allocator.num_free
    tables.free(names["B"])
    free_after = tables.allocator.num_free
    return freed, shared, free_before, free_after, list(b)


FREED, SHARED, FREE_BEFORE, FREE_AFTER, B_TABLE = _answers()
_PER_NEWCOMER = -(-NEWCOMER_LEN // BATCH_BLOCK_SIZE)


def check_freed_blocks(blocks) -> Feedback:
    """Exercise 11.1 (a): the ids of the blocks that go back to the free list when B finishes."""
    got = as_ints(blocks)
    if got is None:
        return Feedback(False, f"Expected a list of block ids (integers), got {blocks!r}.")
    got_set = set(got)
    if got_set == set(FREED) and len(got) == len(FREED):
        return Feedback(True, f"Correct: blocks {FREED} return to the pool. Blocks {SHARED} hold the shared system "
                              f"prompt: A and C still hold them (reference count {len(HELD) - 1} after B lets go), so they stay.")
    if got_set == set(B_TABLE):
        return Feedback(False, f"Not quite: {sorted(got)} is B's whole table. Blocks {SHARED} are shared with A and C "
                               f"(the system prompt): B drops its reference, but they stay allocated for the others.")
    if got_set >= set(FREED) and got_set - set(B_TABLE):
        return Feedback(False, f"Not quite: blocks {sorted(got_set - set(B_TABLE))} are not in B's table at all.")
    if got_set < set(FREED):
        return Feedback(False, f"Not quite: B alone holds more than {sorted(got)}. Every block in B's table whose "
                               f"reference count is 1 goes back.")
    if got_set - set(B_TABLE):
        return Feedback(False, f"Not quite: blocks {sorted(got_set - set(B_TABLE))} belong to other sequences; only blocks "
                               f"in B's table can be freed when B finishes.")
    return Feedback(False, f"Not {sorted(got)}. Hint: read B's table, then the reference count of each of its blocks: "
                           f"a block returns to the pool when its count drops to 0.")


REQUESTS_FIT = NumericExercise(
    name="requests_fit",
    question=f"After B finishes, how many newcomers of {NEWCOMER_LEN} positions each (no shared prefix) fit at once?",
    answer=FREE_AFTER // _PER_NEWCOMER,
    unit="requests",
    explanation=(f"{FREE_AFTER} free blocks after B finishes; each newcomer needs ceil({NEWCOMER_LEN} / "
                 f"{BATCH_BLOCK_SIZE}) = {_PER_NEWCOMER} whole blocks, so {FREE_AFTER} // {_PER_NEWCOMER} = "
                 f"{FREE_AFTER // _PER_NEWCOMER} fit."),
    mistakes=[
        (FREE_AFTER * BATCH_BLOCK_SIZE // NEWCOMER_LEN,
         f"That divides free slots by {NEWCOMER_LEN}: a block belongs to one sequence, so each newcomer takes "
         f"{_PER_NEWCOMER} whole blocks, the last one partly empty."),
        (FREE_BEFORE // _PER_NEWCOMER, f"That uses the {FREE_BEFORE} blocks free before B finished; B gives some back."),
        ((FREE_AFTER + len(SHARED)) // _PER_NEWCOMER,
         f"That counts B's shared blocks {SHARED} as freed too; A and C still hold them."),
        (BATCH_POOL_BLOCKS // _PER_NEWCOMER, f"That divides the whole pool; A and C still hold their blocks."),
        (FREE_AFTER, f"{FREE_AFTER} is the number of free blocks, not of requests: each newcomer needs {_PER_NEWCOMER}."),
    ],
    hints=[
        "Count the free blocks after B finishes (those free now, plus the ones B alone held).",
        f"Each newcomer needs whole blocks: ceil({NEWCOMER_LEN} / {BATCH_BLOCK_SIZE}).",
        f"{FREE_AFTER} // {_PER_NEWCOMER} = {FREE_AFTER // _PER_NEWCOMER}.",
    ],
    rel_tol=1e-9,
)


def check_requests_fit(value) -> Feedback:
    """Exercise 11.1 (b): how many newcomers fit in the free blocks once B has finished."""
    return check_parts(("Newcomers that fit", REQUESTS_FIT, value))


# -- 11.2 one round of speculative verification ----------------------------------------------------

VERIFY_HINTS = [
    "Walk along the proposals while each equals the target's choice at the same index; the first difference stops you.",
    "The round emits the accepted proposals and then chosen[a], the target's own token after them. The cache was fed "
    "the last chosen token and every proposal: keep cached + 1 + a of its positions.",
    "a = 0\nwhile a < len(proposed) and proposed[a] == chosen[a]:\n    a += 1\nreturn proposed[:a] + [chosen[a]], cached + 1 + a",
]

_VERIFY_CASES = [  # the first tells every slip below apart
    ([8, 1, 1], [8, 2, 1, 1], 33),
    ([5, 7, 9], [5, 7, 2, 4], 10),
    ([1, 2], [1, 2, 8], 0),
    ([1, 9, 3], [2, 9, 3, 4], 5),
    ([], [3], 4),
    ([4, 4, 4, 4], [4, 4, 4, 4, 6], 20),
]


def _verify_diagnosis(case, got_emitted, got_keep, emitted, keep) -> str:
    proposed, chosen, cached = case
    a = len(emitted) - 1
    matches = sum(p == c for p, c in zip(proposed, chosen))
    if got_emitted is not None and got_emitted == list(proposed[: a + 1]) and a < len(proposed):
        return (f"its last token is the rejected proposal {proposed[a]}; the round emits the target's own choice "
                f"there, chosen[a] = {chosen[a]}.")
    if got_emitted == emitted[:-1]:
        return ("it leaves out the target's own token after the accepted proposals: chosen[a] comes free with the "
                "verification pass (a correction, or a bonus token when every proposal was right).")
    if got_emitted is not None and len(got_emitted) > len(emitted) and matches > a:
        return ("it keeps proposals after the first disagreement. Each later proposal was drafted after a rejected "
                "token, so it answers a different prefix: stop at the first mismatch.")
    if got_emitted == emitted and got_keep == cached + a:
        return ("the crop point is one short: the round fed the last chosen token first, and its key and value "
                "belong in the cache too (cached + 1 + a).")
    if got_emitted == emitted and got_keep == cached + 1 + len(proposed):
        return "it keeps every proposal's key and value: the rejected ones must be cropped away."
    if got_emitted == emitted and got_keep in (a, a + 1):
        return f"the crop length is the cache's whole length, not the round's share: start from cached = {cached}."
    if got_emitted == emitted and got_keep == cached + a + 2:
        return ("it keeps one position too many: the target's new token was chosen by this pass but not fed through "
                "it, so it has no key or value in the cache yet.")
    if got_emitted == emitted:
        return f"the tokens are right, the crop point is not: {got_keep} instead of {keep}."
    return f"it emitted {got_emitted} where the round emits {emitted}."


def check_verify_round(fn) -> Feedback:
    """Exercise 11.2: ``fn(proposed, chosen, cached)`` returns (the tokens the round emits, the length to crop the cache to)."""
    from ..serving.speculative import verify

    if not callable(fn):
        return Feedback(False, f"Expected your function (def verify_round(proposed, chosen, cached): ...), got {fn!r}.")
    for case in _VERIFY_CASES:
        proposed, chosen, cached = case
        emitted, keep = verify(proposed, chosen, cached)
        call = f"verify_round({proposed}, {chosen}, cached={cached})"
        try:
            out = fn(list(proposed), list(chosen), cached)
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            return Feedback(False, f"{call} raised {describe_error(err)} Hint: {VERIFY_HINTS[0]}")
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return Feedback(False, f"{call} returned {out!r}; return two things: (emitted tokens as a list, crop length).")
        if as_int(out[0]) is not None and getattr(out[0], "dim", lambda: 0)() == 0:
            return Feedback(False, f"{call} returned {out!r}; return two things: a list of the emitted tokens (a list "
                                   f"even when the round emits one token), then the crop length, e.g. ([5, 9], 12).")
        got_emitted, got_keep = as_ints(out[0]), as_int(out[1])
        if got_emitted is None or got_keep is None:
            return Feedback(False, f"{call} returned {out!r}; the tokens must be a list of ints and the crop length an int.")
        if (got_emitted, got_keep) != (emitted, keep):
            why = _verify_diagnosis(case, got_emitted, got_keep, emitted, keep)
            return Feedback(False, f"Not yet: {call} returned ({got_emitted}, {got_keep}), expected ({emitted}, {keep}): "
                                   f"{why} Hint: {VERIFY_HINTS[1]}")
    return Feedback(True, f"Correct on all {len(_VERIFY_CASES)} rounds: the accepted run of proposals, the target's own "
                          f"token after it, and the cache cropped to the last chosen token plus the accepted proposals.")
