"""Lesson 09's checkers: right answers pass, each named slip gets its diagnosis, odd input is explained."""

import torch

from kvlessons import exercises


def test_mla_bytes_right_and_named_slips():
    # DeepSeek-V2 written out: 60 layers x (512 + 64) x 2 B, and 60 x 128 heads x (128 + 64 + 128) x 2 B.
    assert exercises.check_mla_bytes(69_120, 4_915_200)
    cases = {
        (61_440, 4_915_200): "rotary key is missing",
        (138_240, 4_915_200): "Twice the answer",
        (69_120 * 128, 4_915_200): "shared by every head",
        (1_152, 4_915_200): "one layer's share",
        (69_120, 3_932_160): "rotary part is missing",
        (69_120, 5_898_240): "values as wide as the keys",
        (70_272, 4_915_200): "DeepSeek-V3",
        (69_120, 4_997_120): "DeepSeek-V3",
        (69_120, 4_800): "KiB",
        (69_120, 38_400): "one head's share",
        (60 * (512 + 128 * 64) * 2, 4_915_200): "once per head",
        (69_100, 4_915_200): "Not 69,100 bytes",  # an exact count: close is not right
    }
    for (latent, kv), words in cases.items():
        fb = exercises.check_mla_bytes(latent, kv)
        assert not fb and words in fb.message, (latent, kv, fb.message)
    assert "Replace the None" in exercises.check_mla_bytes(None, None).message
    assert "remove the quotes" in exercises.check_mla_bytes("69120", 4_915_200).message


def test_absorb_query_right_and_wrong():
    assert exercises.check_absorb_query(lambda q, w: q @ w)
    assert exercises.check_absorb_query(lambda q, w: torch.einsum("bhtd,hdr->bhtr", q, w))
    wrong = {
        "head 0's matrix": lambda q, w: q @ w[0],
        "summed": lambda q, w: q @ w.sum(0),
        "scaled": lambda q, w: (q @ w) / q.shape[-1] ** 0.5,
        "heads and tokens are swapped": lambda q, w: torch.einsum("bhtd,hdr->bthr", q, w),
        "still d_nope": lambda q, w: q,
        "raised RuntimeError": lambda q, w: q @ w.transpose(-1, -2),
        "returned None": lambda q, w: None,
        "keep the queries' dtype": lambda q, w: q.double() @ w.double(),
        "fixed sizes": lambda q, w: q.reshape(2, 3, 4, 6) @ w,  # the sizes the messages print: right there, wrong in a model
    }
    for words, fn in wrong.items():
        fb = exercises.check_absorb_query(fn)
        assert not fb and words in fb.message, (words, fb.message)

    def stub(q, w):
        raise NotImplementedError

    assert "still the stub" in exercises.check_absorb_query(stub).message
