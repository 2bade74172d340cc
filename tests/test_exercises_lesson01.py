"""Lesson 01's checkers: each accepts the right answer and names each typical wrong one.

01.2 (write the cache yourself) is tested by planting each classic bug in the model answer
and checking that check_my_cache names it.
"""

import pytest
import torch

from kvlessons import exercises, scaffold
from kvlessons.generate import expected_kv_work, measure_kv_work
from conftest import small_model


# --- 01.1: the K/V work of a generation -------------------------------------------------------------


def test_kv_work_right_answers():
    """11,225 token-positions recomputed, 249 cached, for 50 tokens after a 200-token prompt."""
    fb = exercises.check_kv_work(11225, 249)
    assert fb.correct and "45x fewer" in fb.message


def test_kv_work_takes_numpy_and_torch_numbers():
    """A count computed with NumPy or torch is judged by its value."""
    import numpy as np

    assert exercises.check_kv_work(np.int64(11225), torch.tensor(249)).correct
    assert "Off by one" in exercises.check_kv_work(np.int64(11225), torch.tensor(250)).message


def test_kv_work_key_is_the_formula_and_the_count():
    """The answer key is expected_kv_work's, and counting the projections of a real generation agrees."""
    p, n = exercises.KV_WORK_PROMPT, exercises.KV_WORK_NEW_TOKENS
    assert (exercises.KV_WORK_RECOMPUTE.answer, exercises.KV_WORK_CACHED.answer) == (11225, 249)
    assert exercises.KV_WORK_RECOMPUTE.answer == expected_kv_work(p, n, cached=False)
    counted = measure_kv_work(small_model(), [n], prompt_len=p)
    assert counted["recompute"] == [11225] and counted["cached"] == [249]


@pytest.mark.parametrize(
    "recompute, diagnosis",
    [
        (1275, "new tokens only"),  # n(n+1)/2: the prompt forgotten
        (1225, "new tokens only"),  # n(n-1)/2
        (31375, "as if the prompt were also written"),  # 1 + ... + 250
        (31125, "as if the prompt were also written"),  # 1 + ... + 249
        (11275, "Off by one"),  # steps over 201 .. 250
        (12500, "Not every step sees all 250"),
        (10000, "tokens generated so far"),
        (22450, "Twice the answer"),
    ],
)
def test_kv_work_recompute_mistakes(recompute, diagnosis):
    fb = exercises.check_kv_work(recompute, 249)
    assert not fb.correct and diagnosis in fb.message, fb.message


@pytest.mark.parametrize(
    "cached, diagnosis",
    [
        (250, "Off by one"),
        (50, "left out the prompt"),
        (49, "left out the prompt"),
        (200, "prefill alone"),
        (498, "Twice the answer"),
        (11225, "recompute count"),
    ],
)
def test_kv_work_cached_mistakes(cached, diagnosis):
    fb = exercises.check_kv_work(11225, cached)
    assert not fb.correct and diagnosis in fb.message, fb.message


@pytest.mark.parametrize("bad", [None, ..., "249"])
def test_kv_work_non_numbers_are_explained(bad):
    fb = exercises.check_kv_work(bad, bad)
    assert not fb.correct and fb.message.count("Expected a number") == 2


def test_kv_work_hints_are_tiered_and_end_with_the_working():
    for name, answer in [("kv_work_recompute", "11,225"), ("kv_work_cached", "249")]:
        hints = [exercises.hint(name, level) for level in (1, 2, 3)]
        assert len(set(hints)) == 3 and answer in hints[-1] and answer not in hints[0]


# --- 01.2: write the cache yourself ------------------------------------------------------------------


class ModelAnswer:
    """The lesson's model answer (the notebook's solution cell holds the same class)."""

    def __init__(self, layers):
        self.keys = [None] * layers
        self.values = [None] * layers
        self.seq_len = 0

    def positions_and_mask(self, t):
        positions = torch.arange(self.seq_len, self.seq_len + t)
        mask = torch.ones(t, self.seq_len + t, dtype=torch.bool).tril(diagonal=self.seq_len)
        return positions, mask

    def update(self, layer, k, v, cos, sin):
        k = scaffold.rotate(k, cos, sin)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def advance(self, t):
        self.seq_len += t

    def reset(self):
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.seq_len = 0


def test_model_answer_passes():
    """The model answer matches the uncached pass, generates the same tokens, and its bytes are the formula's."""
    fb = exercises.check_my_cache(ModelAnswer)
    assert fb.correct, fb.message
    assert "same 10 tokens" in fb.message and "384 per token" in fb.message


def test_a_mask_of_none_for_single_tokens_and_float_masks_pass():
    """One decoded token needs no mask; an additive 0/-inf mask is a mask too."""

    class NoneForOne(ModelAnswer):
        def positions_and_mask(self, t):
            positions, mask = super().positions_and_mask(t)
            return positions, None if t == 1 else mask

    class Additive(ModelAnswer):
        def positions_and_mask(self, t):
            positions, mask = super().positions_and_mask(t)
            return positions.tolist(), torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    assert exercises.check_my_cache(NoneForOne).correct
    assert exercises.check_my_cache(Additive).correct


def _top_left(self, t):
    return torch.arange(self.seq_len, self.seq_len + t), torch.ones(t, self.seq_len + t, dtype=torch.bool).tril()


class PositionsRestart(ModelAnswer):
    def positions_and_mask(self, t):
        return torch.arange(t), super().positions_and_mask(t)[1]


class NeverAdvances(ModelAnswer):
    def advance(self, t):
        pass


class PositionsOffByOne(ModelAnswer):
    def positions_and_mask(self, t):
        positions, mask = super().positions_and_mask(t)
        return positions + (1 if self.seq_len else 0), mask


class TopLeftMask(ModelAnswer):
    positions_and_mask = _top_left


class NoMaskForAppends(ModelAnswer):  # the textbook is_causal=(cache is None)
    def positions_and_mask(self, t):
        positions, mask = super().positions_and_mask(t)
        return positions, mask if self.seq_len == 0 else None


class NoMaskAtAll(ModelAnswer):
    def positions_and_mask(self, t):
        return super().positions_and_mask(t)[0], None


class InvertedMask(ModelAnswer):  # nn.MultiheadAttention's True-means-hidden
    def positions_and_mask(self, t):
        positions, mask = super().positions_and_mask(t)
        return positions, ~mask


class MaskOverNewKeysOnly(ModelAnswer):
    def positions_and_mask(self, t):
        return super().positions_and_mask(t)[0], torch.ones(t, t, dtype=torch.bool).tril()


class FloatZeroOneMask(ModelAnswer):  # 1 = may look, as a float: added to the scores, it hides nothing
    def positions_and_mask(self, t):
        positions, mask = super().positions_and_mask(t)
        return positions, mask.float()


class TransposedMask(ModelAnswer):
    def positions_and_mask(self, t):
        positions, mask = super().positions_and_mask(t)
        return positions, mask.T


class AdvancePerLayer(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        self.seq_len += k.shape[2]
        return super().update(layer, k, v, cos, sin)

    def advance(self, t):
        pass


class AdvancePerLayerAndPass(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        self.seq_len += k.shape[2]
        return super().update(layer, k, v, cos, sin)


class RotateAfterCaching(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return scaffold.rotate(k, cos, sin), v


class NeverRotates(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _concat_along(dim):
    class WrongDim(ModelAnswer):
        def update(self, layer, k, v, cos, sin):
            k = scaffold.rotate(k, cos, sin)
            if self.keys[layer] is not None:
                k = torch.cat([self.keys[layer], k], dim=dim)
                v = torch.cat([self.values[layer], v], dim=dim)
            self.keys[layer], self.values[layer] = k, v
            return k, v

    return WrongDim


class ReturnsOnlyNew(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        super().update(layer, k, v, cos, sin)
        return scaffold.rotate(k, cos, sin), v


class Prepends(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        k = scaffold.rotate(k, cos, sin)
        if self.keys[layer] is not None:
            k = torch.cat([k, self.keys[layer]], dim=2)
            v = torch.cat([v, self.values[layer]], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class OneStoreForAllLayers(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        return super().update(0, k, v, cos, sin)


class ForgetsToReset(ModelAnswer):
    def reset(self):
        pass


class ResetRebindsSelf(ModelAnswer):
    def reset(self):
        self = ModelAnswer(len(self.keys))  # noqa: F841 - the bug: a new local object, the real one untouched


class ResetsOnlyTheCounter(ModelAnswer):
    def reset(self):
        self.seq_len = 0


class ResetsOnlyTheKeys(ModelAnswer):
    def reset(self):
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)


PLANTED = {
    "positions restart at 0": (PositionsRestart, ["Positions restart at 0", "starts at 0 anyway"]),
    "advance never moves the counter": (NeverAdvances, ["Positions restart at 0", "advance() does not move it"]),
    "positions off by one": (PositionsOffByOne, ["Off by one", "skips position 5"]),
    "is_causal top-left mask": (TopLeftMask, ["top left", "is_causal=True"]),
    "no mask for multi-token appends": (NoMaskForAppends, ["No mask for a multi-token append", "3-token append"]),
    "no mask even for the prompt": (NoMaskAtAll, ["No mask for the prompt"]),
    "True-means-hidden mask": (InvertedMask, ["inverted", "nn.MultiheadAttention"]),
    "mask over the new keys only": (MaskOverNewKeysOnly, ["covers only the 3 new keys"]),
    "float 0/1 mask": (FloatZeroOneMask, ["float tensor of 0s and 1s"]),
    "transposed mask": (TransposedMask, ["The mask is transposed", "upper triangle"]),
    "advancing per layer": (AdvancePerLayer, ["Advancing per layer instead of per pass", "15 = 5 x 3"]),
    "advancing per layer and per pass": (AdvancePerLayerAndPass, ["Advancing per layer", "once more in advance()"]),
    "rotating keys after caching": (RotateAfterCaching, ["Rotating keys after caching"]),
    "keys never rotated": (NeverRotates, ["never rotated"]),
    "concat along the KV heads": (_concat_along(1), ["wrong concat dimension", "dim 1 (the KV heads)"]),
    "concat along head_dim": (_concat_along(-1), ["wrong concat dimension", "dim 3 (head_dim)"]),
    "concat along the batch": (_concat_along(0), ["wrong concat dimension", "dim 0 (the batch)"]),
    "returns only the new K/V": (ReturnsOnlyNew, ["returns only this pass's keys and values"]),
    "new tokens before the cached": (Prepends, ["before the cached ones"]),
    "one store for every layer": (OneStoreForAllLayers, ["Every layer shares one store"]),
    "forgetting to reset": (ForgetsToReset, ["Forgetting to reset", "leaves the cache as it was"]),
    "reset rebinds self": (ResetRebindsSelf, ["Forgetting to reset", "assigning a new object to self"]),
    "reset keeps the keys": (ResetsOnlyTheCounter, ["Forgetting to reset the keys"]),
    "reset keeps the counter": (ResetsOnlyTheKeys, ["leaves the counter where it was", "start at 12"]),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_bug_is_named(bug):
    """The model answer with one classic bug planted fails, and the feedback names that bug."""
    cls, words = PLANTED[bug]
    fb = exercises.check_my_cache(cls)
    assert not fb.correct
    for w in words:
        assert w in fb.message, fb.message
    assert "Traceback" not in fb.message


def test_the_detector_reports_where_it_disagrees():
    """A wrong position shows as a logit difference from the first appended token on."""
    fb = exercises.check_my_cache(PositionsRestart)
    assert "from position 5 on, in the 3-token append after 5 cached tokens" in fb.message


class Stub:
    def __init__(self, layers):
        raise NotImplementedError("Exercise: replace this stub")

    def positions_and_mask(self, t):
        raise NotImplementedError("Exercise: replace this stub")


class ResetStub(ModelAnswer):
    def reset(self):
        raise NotImplementedError("Exercise: replace this stub")


def test_stubs_are_reported_not_raised():
    """The student copy's stub class, or one stubbed method, is named; NotImplementedError appears in words."""
    fb = exercises.check_my_cache(Stub)
    assert not fb.correct and "Not written yet: every method" in fb.message and "NotImplementedError" in fb.message
    fb = exercises.check_my_cache(ResetStub)
    assert not fb.correct and "reset() of ResetStub still raises NotImplementedError" in fb.message


class UpdateRaises(ModelAnswer):
    def update(self, layer, k, v, cos, sin):
        raise ValueError("boom")


class NoAdvance:
    def __init__(self, layers):
        self.inner = ModelAnswer(layers)

    def positions_and_mask(self, t):
        return self.inner.positions_and_mask(t)

    def update(self, *args):
        return self.inner.update(*args)


class WantsNoLayers(ModelAnswer):
    def __init__(self):
        super().__init__(3)


class PlanNotAPair(ModelAnswer):
    def positions_and_mask(self, t):
        return super().positions_and_mask(t)[0]


@pytest.mark.parametrize(
    "cls, words",
    [
        (UpdateRaises, "update() raised ValueError: boom"),
        (NoAdvance, "has no method advance()"),
        (WantsNoLayers, "WantsNoLayers(3) raised TypeError"),
        (PlanNotAPair, "it must return (positions, mask)"),
    ],
)
def test_learner_exceptions_become_feedback(cls, words):
    """Whatever the learner's code raises, the checker returns feedback naming the method, never a traceback."""
    fb = exercises.check_my_cache(cls)
    assert not fb.correct and words in fb.message, fb.message


def test_passing_an_instance_is_explained():
    fb = exercises.check_my_cache(None)
    assert not fb.correct and "Pass the class itself" in fb.message


def test_my_cache_hints_are_tiered_and_end_with_code():
    """Each TODO's hints grow more specific and the last is code; unknown TODOs are refused."""
    for todo in (1, 2, 3, 4):
        hints = [exercises.my_cache_hint(todo, level) for level in range(1, len(exercises.MY_CACHE_HINTS[todo]) + 1)]
        assert len(set(hints)) == len(hints) >= 2
        assert exercises.my_cache_hint(todo, 99) == hints[-1]
    assert "tril(diagonal=self.seq_len)" in exercises.my_cache_hint(3, 3)
    assert "tril(diagonal" not in exercises.my_cache_hint(3, 1)
    with pytest.raises(ValueError, match="todo"):
        exercises.my_cache_hint(5)


def test_an_integer_mask_is_named_as_the_mask_dtype():
    """A 0/1 integer mask with the right pattern: the checker names the mask's dtype (TODO 3), not the update."""

    class IntMask(ModelAnswer):
        def positions_and_mask(self, t):
            positions, mask = super().positions_and_mask(t)
            return positions, mask.int()

    fb = exercises.check_my_cache(IntMask)
    assert not fb.correct and "integers" in fb.message and "torch.bool" in fb.message, fb.message
