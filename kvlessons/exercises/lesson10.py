"""Lesson 10's exercises: write the StreamingLLM scoring policy (sinks + window), and predict the bytes an evicting cache holds."""

from __future__ import annotations

from ..memory import preset
from .core import Feedback, NumericExercise, raised

__all__ = ["SINKS_HINTS", "BUDGET_BYTES", "check_sinks_policy", "check_budget_bytes"]

SINKS_HINTS = [
    "The cache keeps the positions with the highest scores. The sinks must beat everything, and among the rest the "
    "newest must win.",
    "obs.positions (B, H_kv, S) holds each key's original position. Newer = larger, so the position itself is a "
    "recency score; give positions below 4 a score no recent token can reach.",
    "score = obs.positions.float(); return score.masked_fill(obs.positions < 4, float('inf'))",
]


def check_sinks_policy(fn) -> Feedback:
    """Exercise 10.1: ``fn(obs)`` scores positions so that a budget keeps the first 4 (the sinks) and then the newest."""
    import torch

    from ..eviction import EvictingCache, sinks_and_window
    from ..model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig(vocab_size=50, hidden_size=32, layers=2, q_heads=4, kv_heads=2, head_dim=8,
                                   mlp_hidden=48, seed=10)).eval()
    ids = torch.randint(50, (1, 40), generator=torch.Generator().manual_seed(10))
    runs = {}
    for name, policy in (("yours", fn), ("reference", sinks_and_window)):
        cache = EvictingCache(policy, budget=12, when="decode")
        try:
            with torch.inference_mode():
                model(ids[:, :30], cache=cache)
                for i in range(30, 40):
                    model(ids[:, i : i + 1], cache=cache)
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            if name == "yours":
                return raised("a cache scoring with fn (a 30-token prompt, then 10 decode steps, budget 12)", err, SINKS_HINTS[1])
            raise
        runs[name] = cache.kept_positions()[0][0, 0].tolist()
    got, want = runs["yours"], runs["reference"]
    if got == want:
        return Feedback(True, f"Correct: with a budget of 12 your policy keeps positions {got}: the 4 sinks and the 8 newest, "
                              f"after every one of 10 decode steps.")
    if got == list(range(28, 40)):
        why = "it kept only the newest 12: the first 4 positions (the sinks) were evicted."
    elif got == list(range(12)):
        why = "it kept the oldest 12: the highest scores are kept, so newer positions need higher scores."
    elif got[:4] == [0, 1, 2, 3]:
        why = f"the sinks stay, but the rest ({got[4:]}) is not the newest 8 ({want[4:]})."
    else:
        why = f"it kept {got}, where sinks + window keeps {want}."
    return Feedback(False, f"Not yet: {why} Hint: {SINKS_HINTS[0]}")


def _budget_exercise() -> NumericExercise:
    s = preset("SmolLM2-135M").shape
    budget, fp32, pos = 256, 4, 4
    per = s.layers * s.kv_heads * budget
    answer = per * (2 * s.head_dim * fp32 + pos)
    working = (f"{s.layers} layers x {s.kv_heads} KV heads x {budget} positions x (2 x {s.head_dim} values x 4 B + "
               f"a 4-byte position)")
    mistakes = [
        (per * 2 * s.head_dim * fp32, "That is the keys and values only: each kept key also keeps its original position "
                                      "(int32, 4 bytes per KV head), which the cache needs to tell a sink from a recent token."),
        (s.layers * s.q_heads * budget * (2 * s.head_dim * fp32 + pos),
         f"Three times too much: only the {s.kv_heads} KV heads are cached, not the {s.q_heads} query heads."),
        (per * (s.head_dim * fp32 + pos), "Half the K/V bytes: either only keys were counted (each kept position stores "
                                          "a key and a value), or 2 bytes per value were used (bf16); the model runs in fp32."),
        (answer // s.layers, f"That is one layer; all {s.layers} layers keep their budget."),
        (answer // s.kv_heads, f"That is one KV head; the budget is per KV head, and there are {s.kv_heads}."),
        (answer / 2**20, "That is MiB; the answer is asked in bytes."),
    ]
    return NumericExercise(
        name="budget_bytes",
        question="SmolLM2-135M in fp32 with an EvictingCache of 256 positions per KV head: bytes held?",
        answer=answer, unit="bytes",
        explanation=f"{working} = {answer:,} bytes ({answer / 2**20:.2f} MiB), whatever the length of the context.",
        mistakes=mistakes, rel_tol=1e-9,
        hints=[
            "The budget is per KV head and per layer, and it does not depend on the context length.",
            "Each kept position holds a key and a value of head_dim values each, in fp32, plus its original position (int32).",
            f"{working} = {answer:,} bytes.",
        ],
    )


BUDGET_BYTES = _budget_exercise()


def check_budget_bytes(value) -> Feedback:
    """Exercise 10.2: the bytes SmolLM2's cache holds at a budget of 256 per KV head, in fp32."""
    return BUDGET_BYTES.check(value)
