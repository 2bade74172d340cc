"""Lesson 04's exercises: the kv_owners of cross-layer attention, and what CLA-3 and YOCO store for a real model."""

from __future__ import annotations

from dataclasses import replace

from ..memory import kv_cache_bytes, preset
from ..shape import ModelShape, cross_layer_owners
from .core import Feedback, NumericExercise, as_ints, check_parts, raised


__all__ = ["CLA_OWNERS_HINTS", "check_cla_owners", "SMOLLM_CLA3", "SMOLLM_YOCO", "check_sharing_bytes"]


MIB = 2**20




# --- 04.1: kv_owners for CLA with factor k ------------------------------------------------------

CLA_OWNERS_HINTS = [
    "kv_owners has one entry per layer: the index of the layer whose cache it reads. Which layer of a group writes the cache?",
    "The first layer of each group of `factor` owns it: layers 0..k-1 read layer 0, layers k..2k-1 read layer k, ...",
    "return tuple(i - i % factor for i in range(layers))   # the same as (i // factor) * factor",
]

# (layers, factor): pairs and triples as in the CLA paper, a wider group, no sharing, and one group for all.
CLA_OWNERS_CASES = [(6, 2), (6, 3), (12, 4), (4, 1), (5, 5)]

# Wrong tables met in practice, each with what it means. i: layer; k: factor.
_CLA_MISTAKES = [
    (lambda n, k: [i // k for i in range(n)],
     "those are group numbers (i // factor). kv_owners holds the layer index of the group's owner: group 2 of CLA-2 "
     "is layers 4 and 5, and its owner is layer 4, not 2."),
    (lambda n, k: [i % k for i in range(n)],
     "that is each layer's place inside its group (i % factor). The owner is the group's first layer, i - i % factor."),
    (lambda n, k: [i - i % k + k - 1 for i in range(n)],
     "you made the last layer of each group the owner. In one forward pass layer i runs before layer i + 1, so a "
     "layer can only read a cache its own layer or an earlier one has written: the owner is the first of the group."),
    (lambda n, k: list(range(n)),
     "every layer owns its own cache: that is no sharing at all (CLA-1)."),
    (lambda n, k: [0] * n,
     "every layer reads layer 0: one cache for the whole model. CLA shares within groups of `factor` adjacent layers."),
    (lambda n, k: list(range(0, n, k)),
     "you listed only the owners (shape.cache_layers gives those). kv_owners needs one entry for every layer, "
     "owners and readers alike."),
]


def check_cla_owners(fn) -> Feedback:
    """Exercise 04.1: ``fn(layers, factor)`` must return kv_owners for CLA-``factor``: each layer's group owner."""
    for layers, factor in CLA_OWNERS_CASES:
        call = f"cla_owners({layers}, {factor})"
        try:
            got = fn(layers, factor)
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            return raised(call, err, CLA_OWNERS_HINTS[0])
        owners = as_ints(got)
        if owners is None:
            return Feedback(False, f"{call} returned {got!r:.60}; expected a tuple (or list) of {layers} integers, "
                                   f"one layer index per layer.")
        want = list(cross_layer_owners(layers, factor))
        if owners == want:
            continue
        for rule, diagnosis in _CLA_MISTAKES:
            if all(as_ints(_safe(fn, n, k)) == rule(n, k) for n, k in CLA_OWNERS_CASES):
                return Feedback(False, f"Not quite: {call} = {tuple(owners)}, expected {tuple(want)}: {diagnosis}")
        if len(owners) != layers:
            return Feedback(False, f"{call} has {len(owners)} entries; kv_owners has one per layer ({layers}).")
        try:  # the package's own rules for a valid sharing table
            ModelShape(layers=layers, q_heads=1, kv_heads=1, head_dim=1, kv_owners=tuple(owners))
        except ValueError as err:
            return Feedback(False, f"{call} = {tuple(owners)} is not a valid sharing table: {err}. Hint: {CLA_OWNERS_HINTS[1]}")
        i = next(i for i in range(layers) if owners[i] != want[i])
        return Feedback(False, f"{call} = {tuple(owners)}, expected {tuple(want)}: layer {i} is in the group of "
                               f"layers {want[i]}..{want[i] + factor - 1}, whose cache layer {want[i]} writes. "
                               f"Hint: {CLA_OWNERS_HINTS[1]}")
    return Feedback(True, "Correct: every layer reads the first layer of its group, i - i % factor, "
                          "for pairs, triples, groups of 4, no sharing and a single group.")


def _safe(fn, *args):
    """``fn(*args)``, or None if it raises (used only to test a whole table against a known mistake)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return None


# --- 04.2: SmolLM2-135M under CLA-3 and YOCO ----------------------------------------------------

SMOLLM = preset("SmolLM2-135M").shape  # 30 layers, 9 query heads, 3 KV heads of width 64
SMOLLM_TOKENS = 8192  # its supported context
SMOLLM_WINDOW = 1024  # the YOCO variant's sliding window in the lower half


def _smollm_mib(shape: ModelShape, tokens: int = SMOLLM_TOKENS, dtype: str = "bf16") -> float:
    return kv_cache_bytes(shape, tokens, 1, dtype) / MIB


def _smollm_exercises() -> tuple[NumericExercise, NumericExercise]:
    from ..crosslayer import yoco_shape

    layers, half = SMOLLM.layers, SMOLLM.layers // 2
    base = _smollm_mib(SMOLLM)
    cla3 = _smollm_mib(replace(SMOLLM, kv_owners=cross_layer_owners(layers, 3)))
    yoco = _smollm_mib(yoco_shape(layers, SMOLLM.q_heads, SMOLLM.kv_heads, SMOLLM.head_dim, SMOLLM_WINDOW, SMOLLM.hidden_size))
    one_layer_full = base / layers  # one layer holding all 8,192 tokens
    one_layer_window = _smollm_mib(replace(SMOLLM, layers=1), SMOLLM_WINDOW)
    mb = MIB / 10**6
    only_k = "Half the answer: you counted only keys. Each cached token has a key and a value (the leading 2)."
    as_mb = "That is MB (10^6 bytes); the question asks for MiB: divide bytes by 1024^2 = 2^20."
    cla3_exercise = NumericExercise(
        name="smollm_cla3",
        question="SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16) with CLA-3: the cache of one 8,192-token sequence, in MiB?",
        answer=cla3,
        unit="MiB",
        explanation="30 / 3 = 10 owning layers x 2 x 3 x 64 x 2 B = 7.5 KiB per token; x 8,192 tokens = 60 MiB (180 / 3).",
        mistakes=[
            (base, "That is 3x too much, and two slips give it: the model without sharing (all 30 layers store; with "
                   "CLA-3 only the first layer of each group of 3 does), or the 9 query heads counted instead of the "
                   "3 KV heads (9 / 3 happens to equal the factor 3). Check both."),
            (base / 2, "That is CLA-2 (15 owners). CLA-3 groups 3 layers: 10 owners."),
            (base * 3, "The ratio is inverted: sharing divides the cache by 3, it does not multiply it."),
            (base * 2 / 3, "You counted the layers that read a cache (20), not the ones that store it (10)."),
            (cla3 / 2, only_k),
            (cla3 * mb, as_mb),
            (one_layer_full, "That is one owning layer's cache. There are 10 owners, one per group of 3."),
        ],
        hints=[
            "Only owners store. How many groups of 3 are there in 30 layers?",
            "10 owners, each 2 x 3 x 64 x 2 B = 768 B per token. Multiply by owners, tokens, and divide by 2^20.",
            "10 x 768 B = 7,680 B per token; x 8,192 tokens = 62,914,560 B = 60 MiB.",
        ],
    )
    yoco_exercise = NumericExercise(
        name="smollm_yoco",
        question="The same model as YOCO: 15 lower layers with a 1,024-token window, one global K/V (3 KV heads, "
                 "head_dim 64) for the 15 upper layers. The cache of one 8,192-token sequence, in MiB?",
        answer=yoco,
        unit="MiB",
        explanation="lower half 15 layers x 1,024 tokens x 768 B = 11.25 MiB, plus the global cache 8,192 tokens x 768 B "
                    "= 6 MiB: 17.25 MiB, about a tenth of the 180 MiB without sharing.",
        mistakes=[
            (base / 2, "You halved every layer (that is CLA-2). YOCO does more: the lower half is windowed, and the "
                       "upper half stores one cache between all its layers."),
            ((half + 1) * one_layer_full, "You forgot the window: the 15 lower layers keep only their last 1,024 "
                                          "tokens, not all 8,192."),
            (half * one_layer_window + half * one_layer_full, "You gave every upper layer its own cache. They have no K/V "
                                                              "projections: all 15 read one global cache, stored once."),
            (half * one_layer_window, "That is the lower half alone. The global K/V is cached too, once, for every token."),
            (one_layer_full, "That is the global cache alone. The 15 lower layers also keep their windows of 1,024 tokens."),
            ((half + 1) * one_layer_window, "You capped the global cache at the window too. Only the lower half is "
                                            "windowed; the global K/V keeps every token."),
            (yoco / 2, only_k),
            (yoco * mb, as_mb),
            (base, "That is the model without sharing. YOCO windows the lower half and caches the upper half once."),
        ],
        hints=[
            "Two parts: the lower half's windowed caches, and one global cache. How many tokens does each hold at 8,192?",
            "Each layer's K/V costs 2 x 3 x 64 x 2 = 768 B per token. The lower 15 hold 1,024 tokens each; the global "
            "cache holds all 8,192.",
            "15 x 1,024 x 768 B = 11.25 MiB, plus 8,192 x 768 B = 6 MiB: 17.25 MiB.",
        ],
    )
    return cla3_exercise, yoco_exercise


SMOLLM_CLA3, SMOLLM_YOCO = _smollm_exercises()


def check_sharing_bytes(cla3_mib, yoco_mib) -> Feedback:
    """Exercise 04.2: SmolLM2-135M's cache for one 8,192-token sequence in bf16, under CLA-3 and as YOCO, in MiB."""
    return check_parts(("CLA-3", SMOLLM_CLA3, cla3_mib), ("YOCO", SMOLLM_YOCO, yoco_mib))
