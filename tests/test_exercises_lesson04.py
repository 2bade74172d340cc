"""Lesson 04's checkers: each accepts the right answer and names each typical wrong one."""

import math

import numpy as np
import pytest
import torch

from kvlessons import exercises
from kvlessons.crosslayer import yoco_shape
from kvlessons.memory import kv_bytes_per_token, kv_cache_bytes, preset
from kvlessons.shape import cross_layer_owners


# --- 04.1: kv_owners for CLA ---------------------------------------------------------------------

def test_cla_owners_accepts_the_rule_in_any_container():
    """i - i % k and (i // k) * k, as a tuple, a list, a tensor or an array, are all right."""
    assert exercises.check_cla_owners(lambda n, k: tuple(i - i % k for i in range(n))).correct
    assert exercises.check_cla_owners(lambda n, k: [(i // k) * k for i in range(n)]).correct
    assert exercises.check_cla_owners(lambda n, k: torch.arange(n) - torch.arange(n) % k).correct
    assert exercises.check_cla_owners(lambda n, k: np.arange(n) // k * k).correct
    assert exercises.check_cla_owners(cross_layer_owners).correct


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        (lambda n, k: [i // k for i in range(n)], "group numbers"),
        (lambda n, k: [i % k for i in range(n)], "place inside its group"),
        (lambda n, k: [i - i % k + k - 1 for i in range(n)], "last layer of each group"),
        (lambda n, k: list(range(n)), "no sharing"),
        (lambda n, k: [0] * n, "one cache for the whole model"),
        (lambda n, k: list(range(0, n, k)), "listed only the owners"),
        (lambda n, k: [i - i % k for i in range(n)][::-1], "not a valid sharing table"),
        (lambda n, k: [i - i % k for i in range(n - 1)] + [n - 1], "whose cache layer"),
    ],
    ids=["group-number", "within-group", "last-owns", "no-sharing", "all-layer-0", "owners-only", "invalid", "other"],
)
def test_cla_owners_diagnoses_each_mistake(wrong, diagnosis):
    fb = exercises.check_cla_owners(wrong)
    assert not fb.correct and diagnosis in fb.message


@pytest.mark.parametrize("returns", [None, "0, 0, 2, 2", [0.0, 0.0, 2.0, 2.0, 4.0, 4.0], 3])
def test_cla_owners_explains_values_that_are_not_tables(returns):
    fb = exercises.check_cla_owners(lambda n, k: returns)
    assert not fb.correct and "integers, one layer index per layer" in fb.message


def test_cla_owners_reports_a_stub_instead_of_raising():
    def cla_owners(layers, factor):
        raise NotImplementedError("Exercise: replace this stub")

    fb = exercises.check_cla_owners(cla_owners)
    assert not fb.correct and "NotImplementedError" in fb.message and exercises.CLA_OWNERS_HINTS[0] in fb.message
    fb = exercises.check_cla_owners(lambda n, k: tuple(i - i % k for i in range(n + 1))[n])
    assert not fb.correct and "raised" not in fb.message  # an int, not a table: explained, not crashed
    fb = exercises.check_cla_owners(lambda n, k: [i - i % k for i in range(n)][n])
    assert not fb.correct and "raised IndexError" in fb.message


# --- 04.2: SmolLM2-135M under CLA-3 and YOCO ----------------------------------------------------

def test_sharing_answers_follow_from_the_formula():
    """60 MiB and 17.25 MiB: a third of 180 MiB, and 15 windows of 1,024 tokens plus one global cache of 8,192."""
    shape = preset("SmolLM2-135M").shape
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (30, 3, 64)
    per_layer = kv_bytes_per_token(shape, "bf16") // 30  # 768 B
    assert exercises.SMOLLM_CLA3.answer * 2**20 == 10 * per_layer * 8192
    assert exercises.SMOLLM_YOCO.answer * 2**20 == per_layer * (15 * 1024 + 8192)
    yoco = yoco_shape(30, 9, 3, 64, window=1024)
    assert exercises.SMOLLM_YOCO.answer == kv_cache_bytes(yoco, 8192, dtype="bf16") / 2**20 == 17.25


def test_sharing_right_answers():
    assert exercises.check_sharing_bytes(60, 17.25).correct
    assert exercises.check_sharing_bytes(np.float64(60.0), torch.tensor(17.25)).correct


@pytest.mark.parametrize(
    "answers, diagnosis",
    [
        ((180, 17.25), "without sharing"),
        ((90, 17.25), "That is CLA-2"),
        ((540, 17.25), "inverted"),
        ((120, 17.25), "layers that read"),
        ((30, 17.25), "only keys"),
        ((60, 90), "halved every layer"),
        ((60, 96), "forgot the window"),
        ((60, 101.25), "every upper layer its own cache"),
        ((60, 11.25), "lower half alone"),
        ((60, 6), "global cache alone"),
        ((60, 12), "capped the global cache"),
        ((60, 18.09), "MB"),
    ],
)
def test_sharing_diagnoses_each_mistake(answers, diagnosis):
    fb = exercises.check_sharing_bytes(*answers)
    assert not fb.correct and diagnosis in fb.message


def test_sharing_stubbed_values_are_explained():
    fb = exercises.check_sharing_bytes(None, "17.25")
    assert not fb.correct and fb.message.count("Expected a number") == 2


def test_sharing_mistakes_are_distinct_from_the_answer():
    """No known mistake is within tolerance of its answer or of another mistake (else a diagnosis is unreachable)."""
    for exercise in (exercises.SMOLLM_CLA3, exercises.SMOLLM_YOCO):
        values = [exercise.answer] + [wrong for wrong, _ in exercise.mistakes]
        for i, a in enumerate(values):
            for b in values[i + 1:]:
                assert not math.isclose(a, b, rel_tol=exercise.rel_tol, abs_tol=1e-9), (exercise.name, a, b)


def test_sharing_hints_are_tiered():
    for name, answer in (("smollm_cla3", "60 MiB"), ("smollm_yoco", "17.25 MiB")):
        hints = [exercises.hint(name, level) for level in (1, 2, 3)]
        assert len(set(hints)) == 3 and answer in hints[-1] and answer not in hints[0]


def test_180_mib_names_both_slips_that_give_it():
    """180 MiB for CLA-3 is the unshared model or the 9 query heads counted: the checker names both."""
    from kvlessons import exercises

    fb = exercises.check_sharing_bytes(180, 17.25)
    assert not fb.correct and "without sharing" in fb.message and "query heads" in fb.message
