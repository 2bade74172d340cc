"""Lesson 03's checkers: each accepts the right answer and names each typical wrong one."""

import math

import numpy as np
import pytest
import torch

from kvlessons import exercises
from kvlessons.attention import repeat_kv
from kvlessons.gqa import query_groups
from kvlessons.memory import kv_bytes_per_token, preset


# --- 03.1: kv_head_for ---------------------------------------------------------------------------

def test_kv_head_for_accepts_the_rule_in_either_form():
    """h // (q // kv) and h * kv // q are the same mapping; NumPy and tensor integers count as integers."""
    assert exercises.check_kv_head_for(lambda h, q, kv: h // (q // kv)).correct
    assert exercises.check_kv_head_for(lambda h, q, kv: h * kv // q).correct
    assert exercises.check_kv_head_for(lambda h, q, kv: np.int64(h // (q // kv))).correct
    assert exercises.check_kv_head_for(lambda h, q, kv: torch.tensor(h) // (q // kv)).correct


def test_kv_head_answer_key_is_query_groups():
    """The checker's key inverts kvlessons.gqa.query_groups, which the lesson prints."""
    from kvlessons.exercises.lesson03 import _kv_head_answers

    for (h, q, kv), j in _kv_head_answers().items():
        assert h in query_groups(q, kv)[j]


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        (lambda h, q, kv: h % kv, "round robin"),
        (lambda h, q, kv: h // kv, "divided by kv_heads"),
        (lambda h, q, kv: h // (kv // q), "divided by zero"),
        (lambda h, q, kv: h * (q // kv), "multiplied by the group size"),
        (lambda h, q, kv: h % (q // kv), "place inside its group"),
        (lambda h, q, kv: h // (q // kv) + 1, "off by one"),
        (lambda h, q, kv: h, "only for MHA"),
        (lambda h, q, kv: h / (q // kv), "floor division"),
    ],
    ids=["modulo", "by-kv-heads", "group-inverted", "times-group", "within-group", "one-based", "identity", "true-division"],
)
def test_kv_head_for_diagnoses_each_mistake(wrong, diagnosis):
    fb = exercises.check_kv_head_for(wrong)
    assert not fb.correct and diagnosis in fb.message


@pytest.mark.parametrize("returns", [None, "1", 1.0, True])
def test_kv_head_for_explains_values_that_are_not_indices(returns):
    fb = exercises.check_kv_head_for(lambda h, q, kv: returns)
    assert not fb.correct and "integer KV head index" in fb.message


def test_kv_head_for_reports_a_stub_instead_of_raising():
    def kv_head_for(query_head, q_heads, kv_heads):
        raise NotImplementedError("Exercise: replace this stub")

    fb = exercises.check_kv_head_for(kv_head_for)
    assert not fb.correct and "NotImplementedError" in fb.message and exercises.KV_HEAD_HINTS[0] in fb.message


def test_kv_head_for_reports_an_error_in_the_learners_code():
    def kv_head_for(query_head, q_heads, kv_heads):
        return (query_head // (q_heads // kv_heads)).item()  # a tensor habit applied to a Python int

    fb = exercises.check_kv_head_for(kv_head_for)
    assert not fb.correct and "raised AttributeError" in fb.message and "item" in fb.message


def test_kv_head_for_unrecognised_mapping_gets_the_group_spelled_out():
    fb = exercises.check_kv_head_for(lambda h, q, kv: 0)
    assert not fb.correct and "query heads 4..7 read KV head 1" in fb.message


# --- 03.2: Llama-3-70B as MHA, GQA-8, MQA -------------------------------------------------------

def test_70b_answers_follow_from_the_formula():
    """20 GiB, 2.5 GiB, 0.3125 GiB: bytes per token of the preset x 8,192, and the ratios q/kv."""
    shape = preset("Llama-3-70B").shape
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim) == (80, 64, 8, 128)
    gqa8 = kv_bytes_per_token(shape, "bf16") * 8192 / 2**30
    assert exercises.LLAMA70B_GQA8.answer == gqa8 == 2.5
    assert exercises.LLAMA70B_MHA.answer == 8 * gqa8 == 20
    assert exercises.LLAMA70B_MQA.answer == gqa8 / 8 == 0.3125


def test_70b_right_answers():
    assert exercises.check_70b_cache(20, 2.5, 0.3125).correct
    assert exercises.check_70b_cache(np.float32(20), torch.tensor(2.5), 320 / 1024).correct


@pytest.mark.parametrize(
    "answers, diagnosis",
    [
        ((10, 2.5, 0.3125), "only keys"),
        ((21.47, 2.5, 0.3125), "GB"),
        ((2.5, 2.5, 0.3125), "as shipped"),
        ((20, 20, 0.3125), "64 query heads"),
        ((20, 160, 0.3125), "inverted"),
        ((20, 0.3125, 0.3125), "divided MHA by the 64 query heads"),
        ((20, 2.5, 2.5), "GQA-8 figure"),
        ((20, 2.5, 1280), "inverted"),
        ((20, 2.5, 0), "one key head and one value head"),
        ((20, 2.5, 0.15625), "only keys"),
    ],
)
def test_70b_diagnoses_each_mistake(answers, diagnosis):
    fb = exercises.check_70b_cache(*answers)
    assert not fb.correct and diagnosis in fb.message


def test_70b_stubbed_values_are_explained():
    """A student copy passes None for each value: three explanations, no exception."""
    fb = exercises.check_70b_cache(None, None, None)
    assert not fb.correct and fb.message.count("Expected a number") == 3


def test_70b_mistakes_are_distinct_from_the_answer():
    """No known mistake is within tolerance of its answer or of another mistake (else a diagnosis is unreachable)."""
    for exercise in (exercises.LLAMA70B_MHA, exercises.LLAMA70B_GQA8, exercises.LLAMA70B_MQA):
        values = [exercise.answer] + [wrong for wrong, _ in exercise.mistakes]
        for i, a in enumerate(values):
            for b in values[i + 1:]:
                assert not math.isclose(a, b, rel_tol=exercise.rel_tol, abs_tol=1e-9), (exercise.name, a, b)


def test_70b_hints_are_tiered():
    for name in ("llama70b_mha", "llama70b_gqa8", "llama70b_mqa"):
        hints = [exercises.hint(name, level) for level in (1, 2, 3)]
        assert len(set(hints)) == 3
    assert "2.5 GiB" in exercises.hint("llama70b_gqa8", 3) and "2.5 GiB" not in exercises.hint("llama70b_gqa8", 1)


# --- 03.3: repeat_kv ----------------------------------------------------------------------------

def test_repeat_kv_accepts_the_usual_right_answers():
    assert exercises.check_repeat_kv(lambda x, g: x.repeat_interleave(g, dim=1)).correct
    assert exercises.check_repeat_kv(repeat_kv).correct
    assert exercises.check_repeat_kv(lambda x, g: torch.repeat_interleave(x, g, dim=1)).correct


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        (lambda x, g: x.repeat(1, g, 1, 1), "tiled"),
        (lambda x, g: torch.tile(x, (1, g, 1, 1)), "tiled"),
        (lambda x, g: x[:, :, None].expand(-1, -1, g, -1, -1), "group axis is still separate"),
        (lambda x, g: x.repeat_interleave(g, dim=2), "along the sequence"),
        (lambda x, g: x.repeat_interleave(g, dim=0), "along the batch"),
        (lambda x, g: x, "input's shape"),
        (lambda x, g: x.repeat_interleave(g, dim=1) * 2, "copied unchanged"),
        (lambda x, g: x.repeat_interleave(g, dim=1).flip(1), "order [2, 2, 1, 1, 0, 0]"),
        (lambda x, g: None, "returned None"),
        (lambda x, g: x.numpy(), "returned a ndarray"),
    ],
    ids=["repeat", "tile", "no-reshape", "dim2", "dim0", "unchanged", "scaled", "reversed", "none", "numpy"],
)
def test_repeat_kv_diagnoses_each_mistake(wrong, diagnosis):
    fb = exercises.check_repeat_kv(wrong)
    assert not fb.correct and diagnosis in fb.message


def test_repeat_kv_reports_a_stub_instead_of_raising():
    def stub(x, group_size):
        raise NotImplementedError("Exercise: replace this stub")

    fb = exercises.check_repeat_kv(stub)
    assert not fb.correct and "NotImplementedError" in fb.message and "still the stub" in fb.message
    fb = exercises.check_repeat_kv(lambda x, g: x.repeat_interleave(g, dim=4))
    assert not fb.correct and "raised IndexError" in fb.message


def test_repeat_kv_checker_does_not_let_the_learner_change_its_input():
    """A function that overwrites its input in place is still judged on what it returns."""
    def in_place(x, g):
        out = x.repeat_interleave(g, dim=1)
        x.zero_()
        return out

    assert exercises.check_repeat_kv(in_place).correct
