"""Lesson 06's checkers: the right answer passes, each classic mistake is named, odd values become feedback."""

import math

import pytest
import torch

from kvlessons import exercises
from kvlessons.paging import BlockTables


# -- 06.1 blocks and waste ------------------------------------------------------------------------

def test_blocks_and_waste_right_answer():
    """129 blocks and 14 empty slots for 2,050 tokens in blocks of 16."""
    assert exercises.BLOCKS_2050.answer == math.ceil(2050 / 16) == 129
    assert exercises.WASTE_2050.answer == 129 * 16 - 2050 == 14
    assert exercises.check_blocks_and_waste(129, 14).correct


@pytest.mark.parametrize(
    "blocks, wasted, diagnosis",
    [
        (128, 14, "rounded down"),  # floor instead of ceil
        (128.125, 14, "Blocks come whole"),
        (129, 2, "filled"),  # 2050 % 16: the filled part of the last block, not its empty part
        (129, 0, "128 blocks would waste nothing"),  # the partial block forgotten
        (129, -2, "negative"),
        (129, 16, "Not a whole block"),
    ],
)
def test_blocks_and_waste_diagnoses(blocks, wasted, diagnosis):
    fb = exercises.check_blocks_and_waste(blocks, wasted)
    assert not fb.correct and diagnosis in fb.message


@pytest.mark.parametrize("bad", [None, "129", float("nan"), True, [129]])
def test_blocks_and_waste_odd_values_are_feedback(bad):
    fb = exercises.check_blocks_and_waste(bad, bad)
    assert not fb.correct and "Expected a number" in fb.message


def test_blocks_hints_are_tiered():
    hints = [exercises.hint("blocks_2050", level) for level in (1, 2, 3)]
    assert len(set(hints)) == 3 and "129" in hints[-1] and "129" not in hints[0]
    assert "14" in exercises.hint("waste_2050", 3) and "14 " not in exercises.hint("waste_2050", 1)


# -- 06.2 slot_of ---------------------------------------------------------------------------------

def slot_of(position, block_table, block_size):
    return block_table[position // block_size], position % block_size


def test_slot_of_right_answer():
    assert exercises.check_slot_of(slot_of).correct


def test_slot_of_accepts_tensors_and_lists():
    """Any pair of integers will do: a list, or tensors."""
    assert exercises.check_slot_of(lambda p, t, bs: [t[p // bs], p % bs]).correct
    assert exercises.check_slot_of(lambda p, t, bs: torch.tensor([t[p // bs], p % bs])).correct


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        (lambda p, t, bs: (t[p % bs], p // bs), "swapped // and %"),
        (lambda p, t, bs: (p // bs, p % bs), "sequence's own block number"),  # no table lookup
        (lambda p, t, bs: slot_of(p + 1, t, bs), "Off by one: you return where the next position"),
        (lambda p, t, bs: slot_of(p - 1, t, bs) if p else slot_of(0, t, bs), "Off by one: you return where the previous"),
        (lambda p, t, bs: (t[(p - 1) // bs] if p else t[0], p % bs), "Wrong only at block boundaries"),
        (lambda p, t, bs: (t[-(-p // bs)], p % bs), "rounded the block number up"),
        (lambda p, t, bs: (t[p // bs], p % bs + 1), "Offsets count from 0"),
        (lambda p, t, bs: (p % bs, t[p // bs]), "(offset, block)"),
        (lambda p, t, bs: t[p // bs] * bs + p % bs, "flat slot"),
    ],
)
def test_slot_of_diagnoses_each_mistake(wrong, diagnosis):
    fb = exercises.check_slot_of(wrong)
    assert not fb.correct and diagnosis in fb.message, fb.message


def test_slot_of_right_except_for_block_size_one_is_caught():
    """A lookup that only goes wrong for blocks of 1 slot is still caught (block size 1 is tried)."""
    fb = exercises.check_slot_of(lambda p, t, bs: slot_of(p, t, bs) if bs > 1 else (t[0], p))
    assert not fb.correct and ", 1)" in fb.message


def stub(*args):
    raise NotImplementedError("Exercise: replace this stub")


@pytest.mark.parametrize("fn", [None, 3, "slot_of", stub, lambda p, t, bs: None, lambda p, t, bs: 1 / 0,
                                lambda p, t, bs: (1, 2, 3), lambda p, t, bs: "7, 0"])
def test_slot_of_odd_values_are_feedback(fn):
    """A missing function, a stub, an exception or a value of the wrong type: feedback, never an exception."""
    fb = exercises.check_slot_of(fn)
    assert not fb.correct and fb.message
    if fn is stub:
        assert "NotImplementedError" in fb.message


# -- 06.3 gather_sequence -------------------------------------------------------------------------

def n_blocks(seq_len, block_size):
    return -(-seq_len // block_size)


def gather_sequence(pool, block_table, seq_len):
    n = n_blocks(seq_len, pool.shape[1])
    blocks = pool[torch.as_tensor(block_table[:n])]
    return blocks.reshape(n * pool.shape[1], *pool.shape[2:])[:seq_len]


def gather_by_position(pool, block_table, seq_len):
    return torch.stack([pool[slot_of(p, block_table, pool.shape[1])] for p in range(seq_len)])


def gather_with_view(pool, block_table, seq_len):
    n = n_blocks(seq_len, pool.shape[1])
    return pool[torch.tensor(block_table[:n])].view(-1, *pool.shape[2:])[:seq_len]  # right for the contiguous pool the lesson describes


def test_gather_right_answers():
    """Whole blocks at a time (indexing, then reshape or view), or one position at a time with slot_of: all pass."""
    for fn in (gather_sequence, gather_by_position, gather_with_view):
        fb = exercises.check_gather_sequence(fn)
        assert fb.correct, fb.message
    assert "same tokens" in exercises.check_gather_sequence(gather_sequence).message


def flat_index(pool, slots):
    return pool.reshape(-1, *pool.shape[2:])[torch.as_tensor(slots)]


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        # the whole last block, empty slots past seq_len included
        (lambda pool, t, L: pool[torch.as_tensor(t[: n_blocks(L, pool.shape[1])])].reshape(-1, *pool.shape[2:]),
         "Keep the first seq_len rows"),
        # the pool indexed by logical block number instead of through the table
        (lambda pool, t, L: pool.reshape(-1, *pool.shape[2:])[:L], "Index the pool through the table"),
        # // and % swapped, with flat slot numbers
        (lambda pool, t, L: flat_index(pool, [t[p % pool.shape[1]] * pool.shape[1] + p // pool.shape[1] for p in range(L)]),
         "swapped // and %"),
        # off by one: starts one position late
        (lambda pool, t, L: gather_sequence(pool, t, L + 1)[1:], "row p holds position p + 1"),
        # off by one at block boundaries only
        (lambda pool, t, L: torch.stack([pool[slot_of(p - 1 if p % pool.shape[1] == 0 and p else p, t, pool.shape[1])]
                                         for p in range(L)]), "Wrong only at block boundaries"),
        # blocks in pool order, not table order
        (lambda pool, t, L: gather_sequence(pool, sorted(t[: n_blocks(L, pool.shape[1])]), L), "order they sit in the pool"),
        # attention's layout instead of the rows
        (lambda pool, t, L: gather_sequence(pool, t, L).transpose(0, 1).unsqueeze(0), "(seq_len, H_kv, D)"),
        (lambda pool, t, L: gather_sequence(pool, t, L).double(), "keep the pool's dtype"),
        (lambda pool, t, L: gather_sequence(pool, t, L).flip(1), "not rows of the pool as stored"),
    ],
)
def test_gather_diagnoses_each_mistake(wrong, diagnosis):
    fb = exercises.check_gather_sequence(wrong)
    assert not fb.correct and diagnosis in fb.message, fb.message


def test_gather_swapped_in_a_loop_is_named():
    """// and % swapped in a per-position loop is named too: the first case keeps it inside the pool."""
    fb = exercises.check_gather_sequence(
        lambda pool, t, L: torch.stack([pool[t[p % pool.shape[1]], p // pool.shape[1]] for p in range(L)]))
    assert not fb.correct and "swapped // and %" in fb.message, fb.message


def test_gather_index_error_is_explained():
    """An IndexError is reported with its likely cause."""
    fb = exercises.check_gather_sequence(lambda pool, t, L: pool[len(pool)])
    assert not fb.correct and "IndexError" in fb.message and "swapped" in fb.message, fb.message


def test_gather_through_the_decoder():
    """A gather right on the checker's small pools but wrong on the model's (other head_dim) is caught by generating."""
    def right_on_small_pools_only(pool, block_table, seq_len):
        if pool.shape[-1] == 3:
            return gather_sequence(pool, block_table, seq_len)
        return pool.reshape(-1, *pool.shape[2:])[:seq_len]  # logical blocks: the decoder's table is scattered

    fb = exercises.check_gather_sequence(right_on_small_pools_only)
    assert not fb.correct and "tiny decoder" in fb.message and "new token 0" in fb.message, fb.message


@pytest.mark.parametrize("fn", [None, "gather", stub, lambda pool, t, L: None, lambda pool, t, L: [[0.0]],
                                lambda pool, t, L: 1 / 0])
def test_gather_odd_values_are_feedback(fn):
    fb = exercises.check_gather_sequence(fn)
    assert not fb.correct and fb.message
    if fn is stub:
        assert "NotImplementedError" in fb.message


def test_gather_check_leaves_the_global_rng_alone():
    """The checker builds its model from the config's seed: the notebook's random stream is untouched."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    exercises.check_gather_sequence(gather_sequence)
    assert torch.equal(torch.rand(3), expected)


# -- 06.4 prefix reuse ----------------------------------------------------------------------------

def test_prefix_reuse_answers_come_from_the_pool():
    """The answers are what BlockTables reuses: 80 tokens for B, 96 for C."""
    assert (exercises.REUSE_B.answer, exercises.REUSE_C.answer) == (80, 96)
    tables = BlockTables(num_blocks=16, block_size=16)
    a_prompt = list(range(112))
    a, _ = tables.add_sequence(a_prompt)
    tables.append(a, 112)
    assert tables.add_sequence(list(range(90)) + [500 + i for i in range(7)])[1] == 80
    assert tables.add_sequence(a_prompt)[1] == 96
    assert exercises.check_prefix_reuse(80, 96).correct


@pytest.mark.parametrize(
    "reuse_b, reuse_c, diagnosis",
    [
        (90, 96, "whole blocks"),  # the partial block of system-prompt tokens counted
        (96, 96, "You counted block 5 too"),  # rounded up to the block
        (97, 96, "B's question is new"),
        (5, 96, "number of blocks"),
        (80, 112, "last prompt token"),  # the last-token recompute forgotten
        (80, 111, "reuse goes by whole blocks"),
        (80, 6, "number of blocks"),
    ],
)
def test_prefix_reuse_diagnoses(reuse_b, reuse_c, diagnosis):
    fb = exercises.check_prefix_reuse(reuse_b, reuse_c)
    assert not fb.correct and diagnosis in fb.message, fb.message


def test_prefix_reuse_odd_values_are_feedback():
    fb = exercises.check_prefix_reuse(None, "96")
    assert not fb.correct and fb.message.count("Expected a number") == 2
