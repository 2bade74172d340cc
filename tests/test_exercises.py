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


def test_32k_query_heads_and_only_keys_is_not_only_fp32():
    """32 GiB is reached by fp32 alone or by query heads (x4) with only keys (x1/2): the diagnosis names both."""
    fb = exercises.check_32k_estimate(32)
    assert not fb.correct
    for words in ("2 bytes per value", "32 query heads", "only keys"):
        assert words in fb.message, fb.message


@pytest.mark.parametrize(
    "wrong, words",
    [
        (16 * 1024, "in MiB"),
        (16 * 2**30, "in bytes"),
        (32000 * 131072 * 4 / 2**30, "32,768"),  # 15.625
        (32000 * 131072 * 4 / 10**9, "32,768"),  # and in GB: both slips named
        (16 * 2**30 / 2 / 10**9, "key and a value"),  # 8.59: GB and only keys
    ],
)
def test_32k_unit_and_token_slips_are_named(wrong, words):
    """MiB, raw bytes and 32,000 tokens get their own words, alone or combined with another slip."""
    fb = exercises.check_32k_estimate(wrong)
    assert not fb.correct and words in fb.message, fb.message
    assert exercises.KV_32K.hints[0] not in fb.message  # a diagnosis, not the generic first hint


def test_32k_combined_slips_name_both():
    """A number two slips give together names both slips."""
    fb = exercises.check_32k_estimate(32000 * 131072 * 4 / 10**9)
    assert "GB (10^9 bytes)" in fb.message and "32,000 tokens" in fb.message, fb.message


def test_32k_wrong_answers_are_distinct():
    """No listed wrong answer is within tolerance of another, or of the answer: no diagnosis shadows another."""
    ex = exercises.KV_32K
    values = [v for v, _ in ex.mistakes]
    assert len(values) >= 10
    for i, a in enumerate(values):
        assert not ex._close(a, ex.answer), a
        for b in values[i + 1:]:
            assert not ex._close(a, b), (a, b)
    for value, diagnosis in ex.mistakes:  # and each is reached through its own entry
        assert ex.check(value).message.endswith(diagnosis)


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


# --- lesson 05, exercise 2: the bytes of an NVFP4 cache with a full-precision tail --------------------

from kvlessons.exercises import FP4_CACHE_BYTES, check_fp4_cache_bytes  # noqa: E402
from kvlessons.exercises.lesson05 import _fp4_cache_bytes  # noqa: E402


def test_fp4_cache_bytes_key_is_the_formula():
    """The hand-worked 314,048,768 B is what quantized_cache_bytes predicts for that cache."""
    from kvlessons.memory import quantized_cache_bytes

    predicted = quantized_cache_bytes(SOURCE_EXAMPLE, 8192, 1, "nvfp4", residual=128, residual_dtype="bf16")
    assert FP4_CACHE_BYTES.answer == _fp4_cache_bytes() == predicted == 314_048_768
    assert check_fp4_cache_bytes(314_048_768).correct
    assert check_fp4_cache_bytes(314_048_768.0).correct


def test_fp4_cache_bytes_model_matches_a_measured_cache():
    """The byte model behind the wrong answers is, without slips, what a real bf16 QuantizedCache holds."""
    from kvlessons.fp4 import QuantizedCache
    from kvlessons.memory import measured_bytes

    cache = QuantizedCache("nvfp4", residual=4)
    for i in range(2):  # 2 layers, 2 KV heads of width 32, 10 tokens: 6 quantized, 4 in the tail
        k = torch.randn(1, 2, 10, 32, dtype=torch.bfloat16)
        cache.layer(i).update(k, k.clone())
    assert measured_bytes(cache) == _fp4_cache_bytes(layers=2, kv_heads=2, head_dim=32, seq_len=10, residual=4)


@pytest.mark.parametrize(
    "slip, words",
    [
        (dict(block_scale_bytes=0), "block scales are missing"),
        (dict(block_scale_bytes=2), "E4M3, one byte"),
        (dict(tensor_scales="none"), "Off by 256 B"),
        (dict(tensor_scales="token"), "counted per token"),
        (dict(tensor_scales="every token"), "counted for every token"),
        (dict(tensor_scales="head"), "per KV head"),
        (dict(tail="ignored"), "every token in NVFP4"),
        (dict(tail="on top"), "counted twice"),
        (dict(tail_bytes=4), "in fp32"),
        (dict(kv=1), "only K"),
    ],
)
def test_fp4_cache_bytes_diagnoses_each_slip(slip, words):
    """Each slip (block scales forgotten, tensor scale per token, tail ignored, ...) gets its own words."""
    fb = check_fp4_cache_bytes(_fp4_cache_bytes(**slip))
    assert not fb.correct and words in fb.message, fb.message


def test_fp4_cache_bytes_units_near_misses_and_odd_values():
    """MiB and MB are named; a near miss says how far off; non-numbers get words and the first hint, never an error."""
    import numpy as np

    assert "MiB" in check_fp4_cache_bytes(299.5).message
    assert "MB (10^6" in check_fp4_cache_bytes(314.05).message
    assert "768 B short" in check_fp4_cache_bytes(314_048_000).message
    assert check_fp4_cache_bytes(np.int64(314_048_768)).correct
    assert check_fp4_cache_bytes(torch.tensor(314_048_768)).correct
    for bad in (None, ..., "314048768", float("nan"), float("inf"), True, [1, 2]):
        fb = check_fp4_cache_bytes(bad)
        assert not fb.correct and "Expected a number of bytes" in fb.message, bad
    assert FP4_CACHE_BYTES.hints[0] in check_fp4_cache_bytes(12345).message


def test_fp4_cache_bytes_wrong_answers_are_distinct():
    """No two listed wrong answers coincide, and none is the answer."""
    values = [v for v, _ in FP4_CACHE_BYTES.mistakes]
    assert len(set(values)) == len(values) and FP4_CACHE_BYTES.answer not in values
    assert exercises.hint("fp4_cache_bytes", 3).endswith("314,048,768 B.")


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


def _bottom_right(q, k):
    return torch.ones(q, k, dtype=torch.bool).tril(k - q)


def _additive(allowed):
    """The additive form of a bool mask: 0 where attention is allowed, -inf where it is not."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def test_mask_checker_accepts_a_right_additive_mask():
    """A float mask of 0 / -inf (or finfo.min) with the right pattern is right, and the convention is said."""
    fb = check_mask(lambda q, k: _additive(_bottom_right(q, k)))
    assert fb.correct and "additive" in fb.message, fb.message
    low = torch.finfo(torch.float32).min
    assert check_mask(lambda q, k: torch.zeros(q, k).masked_fill(~_bottom_right(q, k), low)).correct


def test_mask_checker_reads_additive_masks_before_diagnosing():
    """A wrong additive mask is diagnosed as the mask it means (0 = attend), not as its inverse."""
    fb = check_mask(lambda q, k: _additive(torch.ones(q, k, dtype=torch.bool).tril()))
    assert not fb.correct and "top left" in fb.message and "additive" in fb.message, fb.message
    fb = check_mask(lambda q, k: _additive(~_bottom_right(q, k)))
    assert not fb.correct and "swapped" in fb.message, fb.message


def test_mask_checker_explains_the_true_means_masked_convention():
    """nn.MultiheadAttention's True = masked out is named as a flipped convention, alone or with top-left alignment."""
    fb = check_mask(lambda q, k: ~_bottom_right(q, k))
    assert not fb.correct and "MultiheadAttention" in fb.message and "~mask" in fb.message, fb.message
    assert "lets token" not in fb.message and "hides token" not in fb.message
    fb = check_mask(lambda q, k: torch.ones(q, k, dtype=torch.bool).triu(1))  # the textbook square mask, flipped
    assert not fb.correct and "MultiheadAttention" in fb.message and "top left" in fb.message, fb.message


@pytest.mark.parametrize(
    "fn, words",
    [
        (lambda q, k: _bottom_right(q, k).float(), "hide nothing"),  # 1.0 / 0.0 would be added to the scores
        (lambda q, k: torch.randn(q, k), "is no mask"),
        (lambda q, k: None, "not a tensor"),
        (lambda q, k: "mask", "not a tensor"),
    ],
)
def test_mask_checker_never_raises_on_odd_returns(fn, words):
    """Floats that are no mask, and values that are no tensor, get words, not an exception."""
    fb = check_mask(fn)
    assert not fb.correct and words in fb.message, fb.message


def test_mask_checker_judges_every_shape_before_calling_a_mask_inverted():
    """An all-False mask, or a diagonal offset with the wrong sign, is inverted for one query only: the checker
    must not advise ~mask (which would be wrong too) but name what is hidden."""
    for fn in (lambda q, k: torch.zeros(q, k, dtype=torch.bool), lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(q - k)):
        fb = check_mask(fn)
        assert not fb.correct and "inverted" not in fb.message and "hides token" in fb.message, fb.message


def test_mask_checker_refuses_an_integer_mask():
    """A 0/1 integer mask with the right pattern is refused (SDPA rejects it), naming the dtype."""
    fb = check_mask(lambda q, k: torch.ones(q, k, dtype=torch.int).tril(k - q))
    assert not fb.correct and "integers" in fb.message and ".bool()" in fb.message


def test_feedback_is_false_when_wrong():
    """`assert exercises.check_...(...)` must fail on a wrong answer: Feedback is truthy only when correct."""
    from kvlessons import exercises

    assert exercises.check_32k_estimate(16) and not exercises.check_32k_estimate(17)


def test_fp4_block_takes_bytes_and_has_graded_hints():
    """The packed bytes may be a bytes object; FP4_BLOCK_HINTS step from the method to the code."""
    from kvlessons import exercises

    scale, codes, packed = _block_answer()
    assert check_fp4_block(scale, codes, bytes(packed)).correct
    assert len(exercises.FP4_BLOCK_HINTS) == 3 and "packed[i]" in exercises.FP4_BLOCK_HINTS[-1]
