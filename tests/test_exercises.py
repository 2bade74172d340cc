import pytest
import torch

from kvlessons import exercises
from kvlessons.memory import SOURCE_EXAMPLE, kv_cache_bytes


def test_32k_right_answer():
    """16 GiB (and anything within rounding) is accepted."""
    assert exercises.check_32k_estimate(16).correct
    assert exercises.check_32k_estimate(16.02).correct
    assert exercises.KV_32K.answer == kv_cache_bytes(SOURCE_EXAMPLE, 32768, 4, "fp16") / 2**30 == 16


@pytest.mark.parametrize(
    "wrong, diagnosis",
    [
        (17.18, "GB"),
        (8, "key and a value"),
        (64, "query heads"),
        (4, "one sequence"),
        (32, "2 bytes per value"),
        (128, "bits"),
        (0.5, "layers"),
    ],
)
def test_32k_diagnoses_each_mistake(wrong, diagnosis):
    """Each classic wrong answer gets its own diagnosis, not a generic 'wrong'."""
    fb = exercises.check_32k_estimate(wrong)
    assert not fb.correct and diagnosis in fb.message


def test_unrecognised_answer_gets_the_first_hint():
    fb = exercises.check_32k_estimate(3)
    assert not fb.correct and exercises.KV_32K.hints[0] in fb.message


@pytest.mark.parametrize("bad", [None, ..., "16", float("nan"), True])
def test_non_numbers_are_explained(bad):
    fb = exercises.check_32k_estimate(bad)
    assert not fb.correct and "Expected a number" in fb.message


def test_64k_plan():
    """1 user fits at 64K; bytes per token must shrink 8x to keep 8; each known slip diagnosed."""
    assert exercises.check_64k_plan(1, 8).correct
    fb = exercises.check_64k_plan(8, 8)
    assert not fb.correct and "today's number" in fb.message
    assert "inverse" in exercises.check_64k_plan(1, 0.125).message
    assert "fewer users" in exercises.check_64k_plan(64, 8).message
    assert "One still fits" in exercises.check_64k_plan(0, 8).message


def test_hints_are_tiered_and_end_with_the_working():
    """hint(name, 1..n) gets more specific; the last contains the answer; levels clamp; unknown names error."""
    hints = [exercises.hint("kv_32k", level) for level in (1, 2, 3)]
    assert len(set(hints)) == 3 and "16 GiB" in hints[-1] and "16 GiB" not in hints[0]
    assert exercises.hint("kv_32k", 99) == hints[-1]
    with pytest.raises(ValueError, match="name"):
        exercises.hint("nope")


def test_feedback_shows_its_message():
    fb = exercises.check_32k_estimate(16)
    assert repr(fb) == fb.message


# --- lesson 05: one FP4 block by hand ----------------------------------------------------------

from kvlessons.exercises import FP4_BLOCK, check_fp4_block  # noqa: E402
from kvlessons.exercises.lesson05 import _block_answer  # noqa: E402


def test_fp4_block_right_answer():
    scale, codes, packed = _block_answer()
    assert scale == 0.5 and len(codes) == 16 and len(packed) == 8
    assert check_fp4_block(scale, codes, packed).correct


def test_fp4_block_key_agrees_with_quantize():
    """The hand-written answer key (scale, 16 codes, 8 bytes) is what kvlessons.fp4.quantize stores for the block."""
    from kvlessons.fp4 import quantize

    q = quantize(torch.tensor([FP4_BLOCK]), block=16, tensor_scale=1.0)
    scale, codes, packed = _block_answer()
    assert q.block_scales.float().item() == scale
    assert q.codes()[0].tolist() == codes
    assert q.data[0].tolist() == packed


def test_fp4_block_key_does_not_come_from_the_code_under_test(monkeypatch):
    """The checker's key is written out: with quantize broken, the hand-worked answer is still the one accepted."""
    import kvlessons.fp4

    def broken(*args, **kwargs):
        raise AssertionError("the checker must not compute its key with quantize")

    monkeypatch.setattr(kvlessons.fp4, "quantize", broken)
    codes = [15, 4, 0, 2, 11, 6, 0, 6, 9, 2, 4, 14, 4, 2, 12, 6]
    assert check_fp4_block(0.5, codes, [79, 32, 107, 96, 41, 228, 36, 108]).correct


def _with(codes, i, value):
    out = list(codes)
    out[i] = value
    return out


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda s, c, p: (3.0, c, p), "divide by 6"),
        (lambda s, c, p: (max(FP4_BLOCK) / 6, c, p), "largest magnitude"),
        (lambda s, c, p: (0.3, c, p), "max|x| / 6"),
        (lambda s, c, p: (s, _with(c, 0, c[0] & 7), p), "sign bit"),
        (lambda s, c, p: (s, _with(c, 2, 1), p), "rounded up, away from zero"),  # tie 0.25 -> 0.5 instead of 0
        (lambda s, c, p: (s, _with(c, 5, 7), p), "rounded up, away from zero"),  # tie 5.0 -> 6 instead of 4
        (lambda s, c, p: (s, _with(c, 7, 5), p), "rounded down, toward zero"),  # tie 3.5 -> 3 instead of 4
        (lambda s, c, p: (None, None, None), "Step 1, the scale: expected a number"),
        (lambda s, c, p: (s, None, None), "Step 2: give the codes as a list of 16 integers"),
        (lambda s, c, p: (s, [float(x) for x in c], p), "Step 2: give the codes as a list of 16 integers"),
        (lambda s, c, p: (s, c, None), "Step 3: give the packed bytes"),
        (lambda s, c, p: (s, c, 79), "Step 3: give the packed bytes"),
        (lambda s, c, p: (s, c[:15], p), "16 codes"),
        (lambda s, c, p: (s, c, [((b & 15) << 4) | (b >> 4) for b in p]), "swapped"),
        (lambda s, c, p: (s, c, p[:7]), "8 bytes"),
    ],
)
def test_fp4_block_diagnoses_the_wrong_step(mutate, words):
    """Each mistake is named at the step where it happens."""
    fb = check_fp4_block(*mutate(*_block_answer()))
    assert not fb.correct and words in fb.message, fb.message


def test_fp4_block_takes_numpy_and_torch_answers():
    """Codes from NumPy or torch are judged by value: right is right, and a wrong code is diagnosed, not its type."""
    import numpy as np

    scale, codes, packed = _block_answer()
    assert check_fp4_block(np.float64(scale), np.array(codes), np.array(packed)).correct
    assert check_fp4_block(torch.tensor(scale), torch.tensor(codes), torch.tensor(packed)).correct
    fb = check_fp4_block(scale, np.array(_with(codes, 2, 1)), packed)
    assert not fb.correct and "halfway" in fb.message, fb.message


def test_fp4_block_integer_rounding_is_diagnosed():
    """x/scale = -0.4 rounded like an integer gives -0; the grid has 0.5, and the checker says so."""
    scale, codes, packed = _block_answer()
    assert FP4_BLOCK[8] / scale == -0.4 and codes[8] == 9  # -0.5
    fb = check_fp4_block(scale, _with(codes, 8, 8), packed)
    assert not fb.correct and "the grid is 0, 0.5, 1" in fb.message


# --- lesson 07: fix the bug ----------------------------------------------------------------------

from kvlessons.exercises import check_mask, check_positions  # noqa: E402


def test_positions_checker():
    assert check_positions(lambda c, n: list(range(c, c + n))).correct
    assert check_positions(lambda c, n: torch.arange(c, c + n)).correct
    cases = {
        "start at position 0": lambda c, n: list(range(n)),
        "skips position 7": lambda c, n: list(range(c + 1, c + n + 1)),
        "reuses position 6": lambda c, n: list(range(c - 1, c + n - 1)),
        "one per new token": lambda c, n: list(range(c, c + n + 1)),
        "raised ZeroDivisionError": lambda c, n: 1 / 0,
        "expected [12, 13, 14]": lambda c, n: [c] * n,
    }
    for words, fn in cases.items():
        fb = check_positions(fn)
        assert not fb.correct and words in fb.message, (words, fb.message)


def test_mask_checker():
    assert check_mask(lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(k - q)).correct
    cases = {
        "aligned to the top left": lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(),
        "lets token 4 see token 5": lambda q, k: torch.ones(q, k, dtype=torch.bool),
        "transposed": lambda q, k: torch.ones(k, q, dtype=torch.bool),
        "hides token": lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(k - q - 1),
        "raised": lambda q, k: undefined_name,  # noqa: F821
    }
    for words, fn in cases.items():
        fb = check_mask(fn)
        assert not fb.correct and words in fb.message, (words, fb.message)
