"""Lesson 08's exercises: SmolLM2's cache bytes per token from its config, the bandwidth bound of a decode step,
and the FLOPs and bytes of a batched decode step."""

from __future__ import annotations

import math

from ..memory import kv_bytes_per_token, preset
from ..shape import ModelShape
from .core import Feedback, NumericExercise, as_number, check_parts


__all__ = ["SMOLLM2_FP32", "SMOLLM2_BF16", "DECODE_BOUND_HINTS", "STEP_FLOPS", "STEP_BYTES", "check_smollm2_bytes",
           "check_decode_bound", "check_step_cost"]


SMOLLM2 = preset("SmolLM2-135M").shape  # 30 layers, 9 query heads, 3 KV heads, head_dim 64, hidden 576


def _bytes_exercise(dtype: str, size: int) -> NumericExercise:
    s = SMOLLM2
    answer = kv_bytes_per_token(s, dtype)
    mha = ModelShape(layers=s.layers, q_heads=s.q_heads, kv_heads=s.q_heads, head_dim=s.head_dim)
    working = f"2 (K and V) x {s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} x {size} B"
    if dtype == "fp32":
        half = ("Half the answer: either only keys were counted (each token stores a key and a value), "
                f"or 2 bytes per value were used (that is the bf16 figure); fp32 is {size} bytes.")
    else:
        half = "Half the answer: did you count only keys? Each token stores a key and a value (the leading 2)."
    mistakes = [
        (kv_bytes_per_token(mha, dtype),
         f"Three times too much: you used the {s.q_heads} query heads (or hidden_size {s.hidden_size} = "
         f"{s.q_heads} x {s.head_dim}). Only the {s.kv_heads} KV heads are cached; each serves "
         f"{s.q_heads // s.kv_heads} query heads (GQA)."),
        (answer / 2, half),
        (answer / s.layers, f"That is one layer's share. All {s.layers} layers keep their own K and V."),
        (answer * 8, f"Eight times too much: that counts bits. {dtype} is {size} bytes per value."),
        (answer / 1024, "That is KiB; the answer is asked in bytes."),
    ]
    if dtype == "bf16":
        fp32 = kv_bytes_per_token(s, "fp32")
        mistakes.append((fp32, "Twice too much: that is the fp32 figure. bf16 is 2 bytes per value."))
    return NumericExercise(
        name=f"smollm2_{dtype}",
        question=f"SmolLM2-135M (its config: {s.layers} layers, {s.q_heads} query heads, {s.kv_heads} KV heads, head_dim "
        f"{s.head_dim}): cache bytes per token in {dtype}?",
        answer=answer,
        unit="bytes",
        explanation=f"{working} = {answer:,} bytes ({answer / 1024:g} KiB) per token.",
        mistakes=mistakes,
        hints=[
            "Per token, every layer stores one key and one value vector for each KV head (not each query head).",
            f"Multiply: 2 x layers x kv_heads x head_dim x bytes per value; {dtype} is {size} bytes per value.",
            f"{working} = {answer:,} bytes.",
        ],
    )


SMOLLM2_FP32 = _bytes_exercise("fp32", 4)
SMOLLM2_BF16 = _bytes_exercise("bf16", 2)


def check_smollm2_bytes(fp32_bytes, bf16_bytes) -> Feedback:
    """Exercise 08.1: SmolLM2's cache bytes per token in fp32 and in bf16, from its config."""
    return check_parts(("fp32", SMOLLM2_FP32, fp32_bytes), ("bf16", SMOLLM2_BF16, bf16_bytes))


DECODE_BOUND_HINTS = [
    "If moving bytes were the only cost, a step would take (bytes it must read) / (bytes per second the memory delivers).",
    "A decode step reads every weight once and the whole cache once: weight_bytes + cache_bytes. bandwidth is in "
    "bytes per second, so the quotient is in seconds.",
    "cache_bytes = fp32_bytes * context  (exercise 1's bytes per token, times the tokens cached; or "
    "kv_cache_bytes(shape, context, dtype=dtype)), then bound_ms = 1e3 * (weight_bytes + cache_bytes) / bandwidth",
]


def check_decode_bound(bound_ms, *, bandwidth, weight_bytes, cache_bytes) -> Feedback:
    """Exercise 08.2: the bandwidth bound of one decode step in ms, from this run's measured ``bandwidth`` (bytes/s).

    The answer is computed from the arguments (the notebook's measured bandwidth and
    counted bytes), so it holds on any machine. Known slips are recognised by
    computing them: the cache or the weights left out, the cache counted twice,
    seconds, bits, tokens per second, decimal and binary units mixed.
    """
    bandwidth, weight_bytes, cache_bytes = (as_number(v) for v in (bandwidth, weight_bytes, cache_bytes))
    if not all(v is not None and math.isfinite(v) and v > 0 for v in (bandwidth, weight_bytes, cache_bytes)):
        return Feedback(False, "Pass the measured numbers: check_decode_bound(bound_ms, bandwidth=bandwidth, "
                               "weight_bytes=weight_bytes, cache_bytes=...), each a positive number.")
    step_bytes = weight_bytes + cache_bytes
    answer = 1e3 * step_bytes / bandwidth
    share = cache_bytes / step_bytes
    exercise = NumericExercise(
        name="decode_bound",
        question="The fastest a decode step could be if reading memory were its only cost, in ms.",
        answer=answer,
        unit="ms",
        explanation=(f"{step_bytes / 1e6:,.2f} MB read per step / {bandwidth / 1e9:.2f} GB/s = {answer:.2f} ms. "
                     f"The weights are {1 - share:.1%} of it at this context: the cache matters once it is long."),
        mistakes=[
            (1e3 * weight_bytes / bandwidth,
             f"You left out the cache. At this short context it is only {share:.1%} of the bytes, but it is read at "
             f"every step too, and at thousands of tokens it rivals the weights (lesson 02)."),
            (1e3 * cache_bytes / bandwidth,
             "You counted only the cache. Every decode step also reads every weight once, and here the weights are "
             "most of the bytes."),
            (1e3 * (weight_bytes + 2 * cache_bytes) / bandwidth,
             "The cache is counted twice: its bytes already hold both K and V."),
            (step_bytes / bandwidth, "That is in seconds; the question asks for milliseconds (x 1000)."),
            (8e3 * step_bytes / bandwidth, "Eight times too much: bytes were counted as bits, or the bandwidth as bits."),
            (bandwidth / step_bytes, "That is the inverse: steps (tokens) per second at the bound. The time per step "
             "is bytes / bandwidth."),
            (1e3 * bandwidth / step_bytes, "That is the inverse (times 1000): the bound is bytes / bandwidth, not "
             "bandwidth / bytes."),
            (answer * 2**30 / 1e9, "GiB and GB mixed: the bandwidth is in bytes per second (GB/s = 10^9 B/s, "
             "not 2^30)."),
            (answer * 1e9 / 2**30, "GiB and GB mixed: the bandwidth is in bytes per second (GB/s = 10^9 B/s, "
             "not 2^30)."),
        ],
        hints=DECODE_BOUND_HINTS,
        rel_tol=1e-3,  # tight: leaving out the small cache must not pass for the answer
    )
    value = as_number(bound_ms)
    if value is not None and math.isfinite(value):
        # A learner who rounds (to 0.1 ms, or from the printed GB/s) is right if the answer is the nearest of all
        # the candidates and within 1%; the slips above sit close to the answer here, so nearest decides.
        nearest = min([answer] + [wrong for wrong, _ in exercise.mistakes], key=lambda c: abs(c - value))
        exact_slip = any(math.isclose(value, wrong, rel_tol=1e-4) for wrong, _ in exercise.mistakes)  # computed, not rounded
        if abs(value - answer) <= 0.01 * answer and not exact_slip:  # an exact slip is diagnosed as such below
            if nearest == answer:
                bound_ms = answer
            else:
                slip = next(diagnosis for wrong, diagnosis in exercise.mistakes if wrong == nearest)
                return Feedback(False, f"{value:g} ms is within 1% of the right answer ({answer:.2f} ms) but closer to "
                                       f"a known slip ({nearest:.2f} ms): {slip} If you did not make that slip, you "
                                       f"probably typed the rounded bandwidth printed above: compute with the variable "
                                       f"`bandwidth` instead.")
    feedback = exercise.check(bound_ms)
    value = as_number(bound_ms)
    if feedback.correct or value is None or not math.isfinite(value) or value <= 0:
        return feedback
    if any(exercise._close(value, wrong) for wrong, _ in exercise.mistakes):
        return feedback  # a named mistake
    power = math.log10(value / answer)
    if round(power) != 0 and abs(power - round(power)) < 1e-3:
        return Feedback(False, f"Not quite: {value:g} ms is 10^{round(power)} times the answer. Check the units: "
                               f"bytes over bytes per second gives seconds, and a second is 1000 ms.")
    return feedback


# Exercise 08.3: one fp32 decode step of SmolLM2 for a batch of 16 sequences, each attending over 256 tokens.
STEP_PARAMS = 134_479_872  # SmolLM2's matrix weights (its tied embedding counted once, as the output head)
STEP_BATCH, STEP_CONTEXT = 16, 256


def _step_exercises() -> tuple[NumericExercise, NumericExercise]:
    s, p, b, n = SMOLLM2, STEP_PARAMS, STEP_BATCH, STEP_CONTEXT
    matmul = 2 * p * b  # a multiply and an add per weight, per sequence
    attention = b * s.layers * 4 * s.q_heads * s.head_dim * n  # scores and weighted sum, per query head and key
    weights = 4 * p  # read once per step, whatever the batch
    per_token = kv_bytes_per_token(s, "fp32")
    cache = per_token * n * b  # every sequence reads its own cache
    flops = NumericExercise(
        name="step_flops",
        question=f"FLOPs of one fp32 decode step of SmolLM2, batch {b}, context {n}.",
        answer=matmul + attention,
        unit="FLOPs",
        explanation=f"2 x {p:,} weights x {b} sequences = {matmul:,} for the matrix products, plus "
                    f"{b} x {s.layers} layers x 4 x {s.q_heads} query heads x {s.head_dim} x {n} keys = {attention:,} "
                    f"for attention: {matmul + attention:,}.",
        mistakes=[
            (matmul, "Only the matrix products: attention over the cache costs FLOPs too (a score and a weighted "
                     "value per query head and key, 2 x head_dim each)."),
            (2 * p + attention / b, "That is one sequence's work: every sequence in the batch multiplies by every weight."),
            (p * b + attention, "A weight costs two FLOPs per sequence, a multiply and an add."),
            (matmul + attention * s.kv_heads / s.q_heads,
             f"Attention runs per *query* head ({s.q_heads}), not per KV head: GQA shares keys, not the arithmetic."),
            (matmul + attention / 2, "Attention does two things per key: the score q.k and the weighted sum of the "
                                     "value, 2 x head_dim FLOPs each."),
            (matmul + attention / s.layers, f"Attention runs in every one of the {s.layers} layers."),
            (matmul + attention / s.head_dim, f"Each score and each weighted value is a {s.head_dim}-wide dot "
                                              f"product: 2 x head_dim FLOPs, not 2."),
            ((matmul + attention) / 1e9, "That is in GFLOPs; the question asks for FLOPs."),
        ],
        hints=[
            "Two parts: the matrix products (weights x sequences) and attention (query heads x keys, per layer).",
            "Matrix products: 2 FLOPs per weight per sequence. Attention: per layer, sequence, query head and key, "
            "2 x head_dim for the score and 2 x head_dim for the weighted value.",
            f"flops = 2 * {p} * {b} + {b} * {s.layers} * 4 * {s.q_heads} * {s.head_dim} * {n}",
        ],
        rel_tol=1e-3,
    )
    bytes_read = NumericExercise(
        name="step_bytes",
        question=f"Bytes one fp32 decode step of SmolLM2 reads, batch {b}, context {n}.",
        answer=weights + cache,
        unit="bytes",
        explanation=f"4 x {p:,} weight bytes, once for the whole batch = {weights:,}, plus {per_token:,} cache bytes per "
                    f"token x {n} tokens x {b} sequences = {cache:,}: {weights + cache:,}.",
        mistakes=[
            (weights * b + cache, "The weights are read once per step and serve every sequence in the batch: "
                                  "that sharing is the whole point of batching."),
            (weights, "The cache is read at every step too: each sequence attends over all its keys and values."),
            (weights + per_token * n, "Every sequence has its own cache, and all of them are read: times the batch."),
            ((weights + cache) / 2, "That is bf16 (2 bytes a value); this step is fp32, 4 bytes."),
            (weights + cache * s.q_heads // s.kv_heads, f"The cache holds {s.kv_heads} KV heads, not {s.q_heads}."),
            (weights + cache / 2, "Each token caches a key *and* a value: the cache part is twice that."),
            ((weights + cache) / 2**20, "That is in MiB; the question asks for bytes."),
            ((weights + cache) / 1e9, "That is in GB; the question asks for bytes."),
            ((weights + cache) / 1e6, "That is in MB; the question asks for bytes."),
            ((weights + cache) * 8, "Eight times too much: that counts bits, not bytes."),
        ],
        hints=[
            "Two parts: the weights, and the caches.",
            f"Weights: 4 bytes each, read once per step. Cache: {per_token:,} bytes per token (exercise 1), per "
            "sequence, and each sequence's is read.",
            f"bytes_read = 4 * {p} + {per_token} * {n} * {b}",
        ],
        rel_tol=1e-3,
    )
    return flops, bytes_read


STEP_FLOPS, STEP_BYTES = _step_exercises()


def _exact(exercise: NumericExercise, value) -> Feedback:
    """The exercise's verdict, except that an answer within 1% but not exact is told it is close (rounded)."""
    feedback = exercise.check(value)
    number = as_number(value)
    if feedback.correct or number is None or not math.isfinite(number) or feedback.message.startswith("Not quite"):
        return feedback
    if abs(number - exercise.answer) <= 0.01 * exercise.answer:
        return Feedback(False, f"Close ({number:g}, {abs(number / exercise.answer - 1):.1%} off): that looks rounded. "
                               f"Compute it exactly from the formula; the count is an integer.")
    return feedback


def check_step_cost(flops, bytes_read) -> Feedback:
    """Exercise 08.3: FLOPs and bytes of one fp32 SmolLM2 decode step, batch 16, context 256."""
    verdicts = [("flops", _exact(STEP_FLOPS, flops)), ("bytes_read", _exact(STEP_BYTES, bytes_read))]
    return Feedback(all(fb.correct for _, fb in verdicts), "\n".join(f"{label}: {fb.message}" for label, fb in verdicts))
