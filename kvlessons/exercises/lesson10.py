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


class _PolicyMistake(Exception):
    """What is wrong with what the learner's policy returned, said for the learner."""


def _guarded(fn):
    """``fn`` called on a copy of each observation's positions, its result checked before the cache uses it."""
    import torch

    from ..eviction import Observation

    def policy(obs):
        positions = obs.positions.clone()
        out = fn(Observation(obs.keys, obs.values, positions, obs.queries))
        if not torch.equal(positions, obs.positions):
            raise _PolicyMistake("your policy wrote into obs.positions: the cache's own record of positions. "
                                 "Work on a copy: score = obs.positions.float() (or .clone()).")
        if not isinstance(out, torch.Tensor):
            raise _PolicyMistake(f"it returned {type(out).__name__}; return a torch tensor of float scores shaped like "
                                 f"obs.positions (B, H_kv, S) = {tuple(obs.positions.shape)}.")
        if out.dtype == torch.bool:
            raise _PolicyMistake("it returned a True/False mask; return numbers: the cache keeps the highest scores.")
        if tuple(out.shape) != tuple(obs.positions.shape):
            raise _PolicyMistake(f"it returned shape {tuple(out.shape)}; one score per held key is "
                                 f"{tuple(obs.positions.shape)}, the shape of obs.positions.")
        if out.is_floating_point() and bool(out.isnan().any()):
            raise _PolicyMistake("some scores are NaN, which no ranking can order: use float('inf') for the sinks.")
        return out

    return policy


def check_sinks_policy(fn) -> Feedback:
    """Exercise 10.1: ``fn(obs)`` scores positions so that a budget keeps the first 4 (the sinks) and then the newest."""
    import torch

    from ..eviction import EvictingCache, sinks_and_window
    from ..model import TinyConfig, TinyDecoder

    if not callable(fn):
        return Feedback(False, f"Expected your policy function (def my_sinks_policy(obs): ...), got {fn!r}.")
    model = TinyDecoder(TinyConfig(vocab_size=50, hidden_size=32, layers=2, q_heads=4, kv_heads=2, head_dim=8,
                                   mlp_hidden=48, seed=10)).eval()
    ids = torch.randint(50, (1, 40), generator=torch.Generator().manual_seed(10))
    caches = {"yours": EvictingCache(_guarded(fn), budget=12, when="decode"),
              "reference": EvictingCache(sinks_and_window, budget=12, when="decode")}
    call = "a cache scoring with your policy (a 30-token prompt, then 10 decode steps, budget 12)"
    with torch.inference_mode():
        for step, chunk in enumerate([ids[:, :30]] + [ids[:, i : i + 1] for i in range(30, 40)]):
            for name, cache in caches.items():
                try:
                    model(chunk, cache=cache)
                except _PolicyMistake as err:
                    return Feedback(False, f"Not yet: {err} Hint: {SINKS_HINTS[1]}")
                except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
                    if name == "yours":
                        return raised(call, err, SINKS_HINTS[1])
                    raise
            got, want = (caches[n].kept_positions() for n in ("yours", "reference"))
            if all(torch.equal(got[i], want[i]) for i in want):
                continue
            layer, head = next((i, h) for i in want for h in range(want[i].shape[1]) if not torch.equal(got[i][0, h], want[i][0, h]))
            mine, ref = got[layer][0, head].tolist(), want[layer][0, head].tolist()
            where = "after the prompt" if step == 0 else f"after decode step {step}"
            if mine == list(range(len(mine))):
                why = "it kept the oldest positions: the highest scores are kept, so newer positions need higher scores."
            elif mine == sorted(mine)[-12:] and mine[-1] == ref[-1] and mine[0] > 3:
                why = "it kept only the newest 12: the first 4 positions (the sinks) were evicted."
            elif mine[0] == 0 and mine[-1] < ref[-1] and mine[:4] != [0, 1, 2, 3]:
                why = "it kept the oldest positions: the highest scores are kept, so newer positions need higher scores."
            elif mine[:4] == [0, 1, 2, 3] and mine[-1] != ref[-1]:
                why = f"the sinks stay, but the rest ({mine[4:]}) is not the newest 8 ({ref[4:]})."
            elif mine[:4] == [0, 1, 2, 3]:
                why = f"it kept {mine}: check the number of sinks (the first 4: positions 0 to 3)."
            else:
                why = f"it kept {mine}, where sinks + window keeps {ref}."
            return Feedback(False, f"Not yet, {where} (layer {layer}, KV head {head}): {why} Hint: {SINKS_HINTS[0]}")
    kept = caches["yours"].kept_positions()[0][0, 0].tolist()
    return Feedback(True, f"Correct: with a budget of 12 your policy keeps positions {kept} (the 4 sinks and the 8 newest) "
                          f"in every layer and KV head, after the prompt and after each of 10 decode steps.")


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
        (answer * 8, "Eight times too much: that counts bits, not bytes."),
        (per * (2 * s.head_dim * fp32 + 8), "That stores 8-byte positions (int64). The cache keeps them as int32: 4 bytes."),
        (per * 2 * s.head_dim * fp32 + s.layers * budget * pos,
         "One position per layer: each KV head keeps its own positions (policies choose per head), so 4 bytes per head."),
        (s.layers * s.q_heads * budget * 2 * s.head_dim * fp32,
         f"Query heads, and no positions: only the {s.kv_heads} KV heads are cached, each key with a 4-byte position."),
        (per * s.head_dim * fp32, "Half the K/V bytes and no positions: a kept position stores a key, a value (fp32) and "
                                  "its position."),
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
    from .core import as_number

    number = as_number(value)
    answer = BUDGET_BYTES.answer
    for unit, size in (("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("kB", 10**3)):
        if number is not None and abs(number - answer / size) <= 0.005 * answer / size:  # a rounded figure in that unit
            return Feedback(False, f"Not quite: {number:g} is the answer in {unit}; it is asked in bytes, exactly.")
    return BUDGET_BYTES.check(value)
