"""Lesson 03's exercises: which KV head a query head reads, what GQA and MQA save on a real model, and repeat_kv."""

from __future__ import annotations

from dataclasses import replace

from ..memory import kv_cache_bytes, preset
from .core import Feedback, NumericExercise, as_int, as_number, check_parts, raised


__all__ = [
    "KV_HEAD_HINTS", "check_kv_head_for",
    "LLAMA70B_MHA", "LLAMA70B_GQA8", "LLAMA70B_MQA", "check_70b_cache",
    "REPEAT_KV_HINTS", "check_repeat_kv",
]


GIB = 2**30




# --- 03.1: query head -> KV head ----------------------------------------------------------------

KV_HEAD_HINTS = [
    "Query heads are split into kv_heads groups of consecutive heads. How many heads are in one group?",
    "A group holds g = q_heads // kv_heads query heads: heads 0..g-1 read KV head 0, heads g..2g-1 read KV head 1, ...",
    "return query_head // (q_heads // kv_heads)",
]

# Shapes tried, GQA first (that is where the mistakes differ), then MQA and MHA, the two ends.
KV_HEAD_SHAPES = [(32, 8), (8, 2), (40, 8), (12, 3), (8, 1), (8, 8)]




def _kv_head_answers() -> dict[tuple[int, int, int], int]:
    """{(query_head, q_heads, kv_heads): KV head}, from kvlessons.gqa.query_groups."""
    from ..gqa import query_groups

    return {(h, q, kv): j for q, kv in KV_HEAD_SHAPES for j, heads in enumerate(query_groups(q, kv)) for h in heads}


# Wrong mappings met in practice, each with what it means. h: query head; g: group size.
_KV_HEAD_MISTAKES = [
    (lambda h, q, kv: h % kv,
     "you dealt the query heads out round robin (query_head % kv_heads). The groups are consecutive: "
     "query heads 0..g-1 share KV head 0, which is how repeat_kv and enable_gqa lay them out, so modulo "
     "pairs a query with a KV head it was never trained with."),
    (lambda h, q, kv: h // kv,
     "you divided by kv_heads. Divide by the group size g = q_heads // kv_heads, the number of query "
     "heads that share one KV head (they coincide only when q_heads = kv_heads**2)."),
    (lambda h, q, kv: h * (q // kv),
     "you multiplied by the group size. Each KV head serves g query heads, so the KV head index is "
     "query_head // g, never larger than the query head."),
    (lambda h, q, kv: h % (q // kv),
     "that is the query head's place inside its group (query_head % g). Which group it is in is query_head // g."),
    (lambda h, q, kv: h // (q // kv) + 1,
     "off by one: KV heads are numbered from 0, so query head 0 reads KV head 0."),
    (lambda h, q, kv: h,
     "you returned the query head itself, which is right only for MHA (one KV head per query head)."),
]


def check_kv_head_for(fn) -> Feedback:
    """Exercise 03.1: ``fn(query_head, q_heads, kv_heads)`` must return the KV head that query head reads."""
    answers = _kv_head_answers()
    got = {}
    for case in answers:
        h, q, kv = case
        try:
            got[case] = fn(h, q, kv)
        except ZeroDivisionError as err:
            return Feedback(False, f"kv_head_for({h}, {q}, {kv}) divided by zero ({err}). Most often that is "
                                   f"kv_heads // q_heads, which is 0 whenever there are fewer KV heads than query heads: "
                                   f"the group size is the other way round, q_heads // kv_heads = {q // kv}.")
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            return raised(f"kv_head_for({h}, {q}, {kv})", err, KV_HEAD_HINTS[0])
    indices = {case: as_int(value) for case, value in got.items()}
    if any(i is None for i in indices.values()):
        if all(as_number(got[(h, q, kv)]) == h / (q // kv) for h, q, kv in answers):
            return Feedback(False, "You divided with / and got fractions (query head 5 of 8 over 2 KV heads gives 1.25). "
                                   "A head index is a whole number: floor division, query_head // group_size.")
        case = next(c for c, i in indices.items() if i is None)
        return Feedback(False, f"kv_head_for{case} returned {got[case]!r}; expected an integer KV head index "
                               f"(0 .. kv_heads - 1). Hint: {KV_HEAD_HINTS[0]}")
    wrong = [case for case in answers if indices[case] != answers[case]]
    if not wrong:
        return Feedback(True, f"Correct: every query head of {len(KV_HEAD_SHAPES)} shapes (GQA, MQA and MHA) reads "
                              f"KV head query_head // (q_heads // kv_heads).")
    for rule, diagnosis in _KV_HEAD_MISTAKES:
        if all(indices[(h, q, kv)] == rule(h, q, kv) for h, q, kv in answers):
            h, q, kv = wrong[0]
            return Feedback(False, f"Not quite: kv_head_for({h}, {q}, {kv}) = {indices[wrong[0]]}, expected "
                                   f"{answers[wrong[0]]}: {diagnosis}")
    h, q, kv = wrong[0]
    g = q // kv
    group = answers[wrong[0]]
    return Feedback(False, f"kv_head_for({h}, {q}, {kv}) = {indices[wrong[0]]}, expected {group}: with groups of "
                           f"{g}, query heads {group * g}..{group * g + g - 1} read KV head {group}. Hint: {KV_HEAD_HINTS[1]}")


# --- 03.2: Llama-3-70B as MHA, as shipped (GQA-8), as MQA ---------------------------------------

LLAMA70B_SHAPE = preset("Llama-3-70B").shape  # 80 layers, 64 query heads, 8 KV heads of width 128
LLAMA70B_TOKENS = 8192  # its supported context


def _llama70b_gib(kv_heads: int, dtype: str = "bf16") -> float:
    return kv_cache_bytes(replace(LLAMA70B_SHAPE, kv_heads=kv_heads), LLAMA70B_TOKENS, 1, dtype) / GIB


def _llama70b_exercises() -> tuple[NumericExercise, NumericExercise, NumericExercise]:
    mha, gqa8, mqa = _llama70b_gib(64), _llama70b_gib(8), _llama70b_gib(1)
    gb = GIB / 10**9  # GiB -> GB
    question = "Llama-3-70B (80 layers, 64 query heads, head_dim 128), one sequence of 8,192 tokens in bf16, in GiB"
    only_k = "Half the answer: you counted only keys. Every cached token has a key and a value (the leading 2)."
    as_gb = "That is GB (10^9 bytes); the question asks for GiB: divide bytes by 1024^3 = 2^30."
    as_fp32 = "Twice too much: bf16 is 2 bytes per value, not 4."
    mha_exercise = NumericExercise(
        name="llama70b_mha",
        question=f"{question}, if it were MHA (64 KV heads)?",
        answer=mha,
        unit="GiB",
        explanation="2 x 80 x 64 x 128 x 2 B = 2.5 MiB per token; x 8,192 tokens = 20 GiB.",
        mistakes=[
            (mha / 2, only_k),
            (mha * gb, as_gb),
            (_llama70b_gib(64, "fp32"), as_fp32),
            (mha * 8, "Eight times too much: that counts bits. bf16 is 2 bytes per value."),
            (mha / 80, "That is one layer's share. Every one of the 80 layers keeps its own cache."),
            (gqa8, "That is the model as shipped, with 8 KV heads. As MHA it would have one KV head per query head: 64."),
        ],
        hints=[
            "Bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per value. MHA: KV heads = query heads.",
            "2 x 80 x 64 x 128 x 2 = 2,621,440 B = 2.5 MiB per token. Multiply by the tokens, then divide by 2^30.",
            "2.5 MiB x 8,192 tokens = 20,480 MiB = 20 GiB.",
        ],
    )
    gqa8_exercise = NumericExercise(
        name="llama70b_gqa8",
        question=f"{question}, as shipped (GQA, 8 KV heads)?",
        answer=gqa8,
        unit="GiB",
        explanation="8 KV heads instead of 64: 64 / 8 = 8x less than MHA, 20 GiB / 8 = 2.5 GiB.",
        mistakes=[
            (mha, "That is the MHA figure: you counted the 64 query heads. Only the 8 KV heads are cached."),
            (mha * 64 / 8, "The ratio is inverted: you multiplied MHA by 64 / 8. Fewer KV heads shrink the cache: divide."),
            (mqa, "You divided MHA by the 64 query heads: that is one KV head, MQA. GQA-8 keeps 8, so divide by 64 / 8 = 8."),
            (gqa8 / 2, only_k),
            (gqa8 * gb, as_gb),
            (_llama70b_gib(8, "fp32"), as_fp32),
        ],
        hints=[
            "The cache is proportional to the KV heads. MHA has 64, this model 8.",
            "GQA-8 / MHA = 8 / 64 = 1/8. Or from scratch: 2 x 80 x 8 x 128 x 2 B per token.",
            "2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB per token; x 8,192 tokens = 2.5 GiB.",
        ],
    )
    mqa_exercise = NumericExercise(
        name="llama70b_mqa",
        question=f"{question}, as MQA (1 KV head)?",
        answer=mqa,
        unit="GiB",
        explanation="one KV head: 64x less than MHA, 8x less than GQA-8: 20 GiB / 64 = 0.3125 GiB = 320 MiB.",
        mistakes=[
            (gqa8, "That is the GQA-8 figure (8 KV heads). MQA keeps a single KV head per layer."),
            (mha * 64, "The ratio is inverted: you multiplied by 64. One KV head instead of 64 divides the cache by 64."),
            (0, "MQA still caches one key head and one value head in every layer; only the count of heads drops to 1."),
            (mqa / 2, only_k),
            (mqa * gb, as_gb),
            (_llama70b_gib(1, "fp32"), as_fp32),
            (mqa / 80, "That is one layer's share. Every one of the 80 layers keeps its own single KV head."),
        ],
        hints=[
            "MQA is GQA with one KV head: the same formula with KV heads = 1.",
            "MQA / MHA = 1 / 64. Per token: 2 x 80 x 1 x 128 x 2 B.",
            "2 x 80 x 1 x 128 x 2 = 40,960 B = 40 KiB per token; x 8,192 tokens = 320 MiB = 0.3125 GiB.",
        ],
    )
    return mha_exercise, gqa8_exercise, mqa_exercise


LLAMA70B_MHA, LLAMA70B_GQA8, LLAMA70B_MQA = _llama70b_exercises()


def check_70b_cache(mha_gib, gqa8_gib, mqa_gib) -> Feedback:
    """Exercise 03.2: Llama-3-70B's cache for one 8,192-token sequence in bf16 as MHA, GQA-8 and MQA, in GiB."""
    parts = [("MHA (64 KV heads)", LLAMA70B_MHA, mha_gib), ("GQA-8 (as shipped)", LLAMA70B_GQA8, gqa8_gib),
             ("MQA (1 KV head)", LLAMA70B_MQA, mqa_gib)]
    return check_parts(*parts)


# --- 03.3: repeat_kv ----------------------------------------------------------------------------

REPEAT_KV_HINTS = [
    "Output head j must be a copy of KV head j // group_size: copies of one KV head sit next to each other.",
    "Repeat along dim 1 (heads), each head group_size times in place: (0, 0, 1, 1), not (0, 1, 0, 1).",
    "return x.repeat_interleave(group_size, dim=1)   # or x[:, :, None].expand(B, H_kv, g, S, D).reshape(B, H_kv * g, S, D)",
]

# (B, H_kv, S, D) and group size: GQA, MQA (one head for 8), and g = 1 (MHA: nothing to repeat).
REPEAT_KV_CASES = [((2, 3, 5, 4), 2), ((1, 2, 3, 4), 4), ((1, 1, 6, 4), 8), ((2, 4, 3, 2), 1)]


def _source_heads(out, x) -> list[int | None]:
    """For each head of ``out``, the head of ``x`` it is an exact copy of (None if none)."""
    import torch

    return [next((i for i in range(x.shape[1]) if torch.equal(out[:, j], x[:, i])), None) for j in range(out.shape[1])]


def check_repeat_kv(fn) -> Feedback:
    """Exercise 03.3: ``fn(x, group_size)`` must return K or V ``(B, H_kv, S, D)`` as ``(B, H_kv * g, S, D)``,
    each KV head repeated for its group of query heads, in the order enable_gqa reads them."""
    import torch

    from ..attention import repeat_kv

    g = torch.Generator().manual_seed(3)
    for shape, group_size in REPEAT_KV_CASES:
        x = torch.randn(*shape, generator=g)  # (B, H_kv, S, D): distinct values, so every head can be told apart
        b, h_kv, s, d = shape
        call = f"repeat_kv(x of shape {shape}, {group_size})"
        try:
            out = fn(x.clone(), group_size)
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            return raised(call, err, REPEAT_KV_HINTS[0])
        if not isinstance(out, torch.Tensor):
            what = "None" if out is None else f"a {type(out).__name__}"
            return Feedback(False, f"{call} returned {what}; expected a torch tensor of shape "
                                   f"{(b, h_kv * group_size, s, d)}.")
        out = out.detach().cpu()  # a learner may have moved it to the GPU
        want = repeat_kv(x, group_size)  # (B, H_kv * g, S, D)
        got_shape = tuple(out.shape)
        if got_shape != tuple(want.shape):
            if got_shape == (b, h_kv, group_size, s, d):
                why = "the group axis is still separate: merge it with the heads, .reshape(B, H_kv * g, S, D)."
            elif got_shape == (b, h_kv, s * group_size, d):
                why = "you repeated along the sequence (dim 2). The heads are dim 1."
            elif got_shape == (b * group_size, h_kv, s, d):
                why = "you repeated along the batch (dim 0). The heads are dim 1."
            elif got_shape == (b, h_kv, s, d * group_size):
                why = "you repeated along head_dim (dim 3). The heads are dim 1."
            elif got_shape == shape:
                why = "that is the input's shape: each KV head must appear group_size times."
            else:
                why = f"expected (B, H_kv * group_size, S, D) = {tuple(want.shape)}."
            return Feedback(False, f"{call} has shape {got_shape}: {why}")
        if torch.equal(out.to(want.dtype), want):
            continue
        sources = _source_heads(out.to(want.dtype), x)
        expected = [j // group_size for j in range(h_kv * group_size)]
        if sources == [j % h_kv for j in range(h_kv * group_size)]:
            return Feedback(False, f"Your heads are tiled: {call} gives KV heads in the order {sources}, the order of "
                                   f"x.repeat(1, g, 1, 1) or torch.tile. Query head j reads KV head j // g, so the copies "
                                   f"of one head must be adjacent: {expected}. Hint: {REPEAT_KV_HINTS[1]}")
        if None in sources:
            j = sources.index(None)
            return Feedback(False, f"{call}: output head {j} is not a copy of any KV head of x; the values must be "
                                   f"copied unchanged. Hint: {REPEAT_KV_HINTS[0]}")
        return Feedback(False, f"{call} gives KV heads in the order {sources}; query head j reads KV head j // g: "
                               f"{expected}. Hint: {REPEAT_KV_HINTS[0]}")
    return Feedback(True, "Correct: each KV head repeated for its group, in order, for GQA, MQA and group size 1; "
                          "attention over it equals enable_gqa=True.")
