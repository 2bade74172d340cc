"""Lesson 10's checkers: the sinks + window policy and the bytes at a budget; right answers pass, slips are named."""

from kvlessons import exercises


def test_sinks_policy_right_and_wrong():
    right = lambda obs: obs.positions.float().masked_fill(obs.positions < 4, float("inf"))  # noqa: E731
    assert exercises.check_sinks_policy(right)
    cases = {
        "only the newest 12": lambda obs: obs.positions.float(),
        "oldest 12": lambda obs: -obs.positions.float(),
        "shaped (B, H_kv, S)": lambda obs: obs.positions[0].float(),
        "the sinks stay": lambda obs: (-(obs.positions.float() - 20).abs()).masked_fill(obs.positions < 4, float("inf")),
    }
    for words, fn in cases.items():
        fb = exercises.check_sinks_policy(fn)
        assert not fb and words in fb.message, (words, fb.message)

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
    }
    for value, words in cases.items():
        fb = exercises.check_budget_bytes(value)
        assert not fb and words in fb.message, (value, fb.message)
