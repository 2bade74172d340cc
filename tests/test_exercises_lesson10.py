"""Lesson 10's checkers: the sinks + window policy and the bytes at a budget; right answers pass, slips are named."""

import torch

from kvlessons import exercises


def test_sinks_policy_right_and_wrong():
    right = lambda obs: obs.positions.float().masked_fill(obs.positions < 4, float("inf"))  # noqa: E731
    assert exercises.check_sinks_policy(right)
    cases = {
        "only the newest 12": lambda obs: obs.positions.float(),
        "oldest positions": lambda obs: -obs.positions.float(),
        "returned shape (2, 30)": lambda obs: obs.positions[0].float(),
        "wrote into obs.positions": lambda obs: obs.positions.masked_fill_(obs.positions < 4, 1000),
        "NaN": lambda obs: obs.positions.float().masked_fill(obs.positions < 4, float("nan")),
        "True/False mask": lambda obs: obs.positions < 4,
        "returned ndarray": lambda obs: obs.positions.numpy(),
        "number of sinks": lambda obs: obs.positions.float().masked_fill(obs.positions <= 4, float("inf")),
        "KV head 1": lambda obs: torch.cat([right(obs)[:, :1], -right(obs)[:, 1:]], dim=1),
        "the sinks stay": lambda obs: (-(obs.positions.float() - 20).abs()).masked_fill(obs.positions < 4, float("inf")),
    }
    for words, fn in cases.items():
        fb = exercises.check_sinks_policy(fn)
        assert not fb and words in fb.message, (words, fb.message)
    assert "Expected your policy function" in exercises.check_sinks_policy(None).message

    def stub(obs):
        raise NotImplementedError

    assert "still the stub" in exercises.check_sinks_policy(stub).message


def test_budget_bytes_right_and_named_slips():
    # written out: 30 layers x 3 KV heads x 256 x (2 x 64 x 4 B + 4 B)
    assert exercises.check_budget_bytes(11_888_640)
    cases = {
        11_796_480: "keys and values only",
        30 * 9 * 256 * 516: "query heads",
        30 * 3 * 256 * (64 * 4 + 4): "a key and a value",  # keys only in fp32 = keys and values in bf16: both named
        11_888_640 // 30: "one layer",
        11_888_640 // 3: "one KV head",
        11_888_640 / 2**20: "MiB",
        11.34: "in MiB",  # as the lesson prints it, rounded
        11.89: "in MB",
        11_980_800: "int64",
        11_827_200: "One position per layer",
        95_109_120: "bits",
        35_389_440: "Query heads, and no positions",
    }
    for value, words in cases.items():
        fb = exercises.check_budget_bytes(value)
        assert not fb and words in fb.message, (value, fb.message)
