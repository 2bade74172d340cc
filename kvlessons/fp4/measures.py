"""What storing K and V in a format does (lessons 05 and 08): to keys, to attention, to generated text."""

from __future__ import annotations

import torch

from ..attention import attend, reference_attention
from ..cache import KVCache
from ..generate import next_token_agreement
from ..rope import apply_rope, rope_tables
from ..shape import require_positive_int
from .formats import fake_quantize


def relative_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """||x - approx|| / ||x|| (Frobenius), a scale-free error measure."""
    return ((x.float() - approx.float()).norm() / x.float().norm().clamp_min(1e-30)).item()


def outlier_keys(tokens: int = 64, head_dim: int = 64, outlier_channels=(3, 17), outlier_scale: float = 20.0, seed: int = 0) -> torch.Tensor:
    """Synthetic keys (tokens, head_dim): unit noise plus a few channels ``outlier_scale`` times larger.

    Real models' keys look like this: a handful of channels carry much larger values in
    every token (KVQuant, KIVI), which is what breaks a single scale for a whole tensor.
    """
    require_positive_int("tokens", tokens)
    require_positive_int("head_dim", head_dim)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, head_dim, generator=g)
    for c in outlier_channels:
        if not 0 <= c < head_dim:
            raise ValueError(f"outlier channel {c} is outside head_dim {head_dim}")
        k[:, c] = k[:, c] * outlier_scale + outlier_scale
    return k


def _heads_quantize(x, fmt):
    # Blocks along head_dim, tensor scale calibrated from x itself: what a cache stores after writing x.
    return fake_quantize(x, fmt)


@torch.no_grad()
def attention_drift(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str = "nvfp4") -> dict:
    """Attention with K and V stored in ``fmt`` against full precision, causal, same queries.

    Returns the relative error of the attention output, the mean total-variation
    distance between the attention weights (0 = identical, 1 = disjoint), and the
    largest change of any single weight.
    """
    kq, vq = _heads_quantize(k, fmt), _heads_quantize(v, fmt)
    _, w_full = reference_attention(q, k, v, return_weights=True)  # (B, H_q, T, S)
    _, w_quant = reference_attention(q, kq, vq, return_weights=True)
    return {
        "output_rel_error": relative_error(attend(q, k, v), attend(q, kq, vq)),
        "weight_tv": 0.5 * (w_full - w_quant).abs().sum(-1).mean().item(),
        "weight_max_change": (w_full - w_quant).abs().max().item(),
    }


def _teacher_forced(model, prefix: torch.Tensor, continuation: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Next-token logits (B, 1 + N, vocab) reading ``prefix`` in one pass, then ``continuation`` one token per step."""
    from ..generate import feed_in_chunks

    cache.reset()
    ids = torch.cat([prefix, continuation], dim=1)
    return feed_in_chunks(model, ids, [prefix.shape[1]] + [1] * continuation.shape[1], cache, last_only=True)


@torch.no_grad()
def compare_generation(model, prompt_ids: torch.Tensor, max_new_tokens: int, cache: KVCache) -> dict:
    """Greedy generation with ``cache`` against a full-precision ConcatCache run.

    free_running: fraction of generated tokens equal position by position (after the
    first divergence the two continue from different text, so this drops fast);
    first_divergence: index of the first different token (None if none);
    teacher_forced: fraction of decode steps at which ``cache`` would pick the same next
    token as full precision when both read the full-precision text, fed one token per
    step as in decoding (free of compounding);
    max_logit_diff: largest logit difference over those teacher-forced steps.
    """
    from ..cache import ConcatCache
    from ..generate import generate

    reference = generate(model, prompt_ids, max_new_tokens, cache=ConcatCache())
    cache.reset()
    candidate = generate(model, prompt_ids, max_new_tokens, cache=cache)
    same = (reference.new_tokens == candidate.new_tokens)[0]
    diverged = (~same).nonzero()
    forced = _teacher_forced(model, prompt_ids, reference.new_tokens[:, :-1], cache)  # same decisions as reference.logits
    return {
        "free_running": same.float().mean().item(),
        "first_divergence": int(diverged[0]) if len(diverged) else None,
        "teacher_forced": (forced.argmax(-1) == reference.new_tokens).float().mean().item(),
        "max_logit_diff": (forced - reference.logits).abs().max().item(),
    }


@torch.no_grad()
def rope_order_error(k_before_rope: torch.Tensor, fmt: str = "nvfp4", theta: float = 10000.0) -> dict:
    """Error of the rotated keys attention reads, quantizing after RoPE versus before it.

    ``k_before_rope``: (B, H, T, D) keys as projected, positions 0..T-1. After: rotate,
    then quantize (what is stored is ready to use). Before: quantize the raw keys, and
    rotate on every read (what is stored keeps the raw channels' structure; KVQuant
    does this so outlier channels stay in fixed places).
    """
    t, d = k_before_rope.shape[-2], k_before_rope.shape[-1]
    cos, sin = rope_tables(torch.arange(t, device=k_before_rope.device), d, theta)
    rotated = apply_rope(k_before_rope, cos, sin)
    after = _heads_quantize(rotated, fmt)
    before = apply_rope(_heads_quantize(k_before_rope, fmt), cos, sin)
    return {"after_rope": relative_error(rotated, after), "before_rope": relative_error(rotated, before)}



@torch.no_grad()
def passage_agreement(model, ids: torch.Tensor, prefill: int, cache: KVCache) -> dict:
    """Read a passage through ``cache`` (prefill, then one token per step) against full precision.

    At every position after the prefill, compares the next-token distribution with an
    uncached full-precision pass: top-1 agreement, mean KL(full || cached) in nats, and
    the largest logit difference. Teacher-forced: both read the same text.
    """
    require_positive_int("prefill", prefill)
    t = ids.shape[1]
    if not 0 < prefill < t:
        raise ValueError(f"prefill must be between 1 and {t - 1}, got {prefill}")
    reference = model(ids)[:, prefill - 1 : t - 1]  # predictions for tokens prefill .. t-1
    cand = _teacher_forced(model, ids[:, :prefill], ids[:, prefill : t - 1], cache)
    return next_token_agreement(reference, cand)
