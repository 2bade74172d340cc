"""Attention over a cache: the one mask helper, the one attention call, and its written-out reference (lessons 01, 03, 07).

The model attends through :func:`attend` (PyTorch's scaled dot-product attention).
Lessons that show or measure the steps in between (scores, mask, softmax, weights)
call :func:`reference_attention`, the same computation written out; the tests hold
the two equal. Every mask comes from :func:`causal_mask`, so there is exactly one
place where "which keys may this query see" is decided.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .shape import require_positive_int


MASK_ALIGNMENTS = ("bottom_right", "top_left")


def causal_mask(
    q_len: int, kv_len: int, device=None, window: int | None = None, align: str = "bottom_right"
) -> torch.Tensor:
    """Return a bool mask ``(q_len, kv_len)``, True where a query may attend to a key.

    The queries are the *last* ``q_len`` of ``kv_len`` positions: query i sits at
    absolute position ``kv_len - q_len + i`` and sees every key at or before it
    (bottom-right alignment). That is what a cache needs: the keys hold the cached
    tokens first, then the new ones. ``is_causal=True`` in PyTorch aligns to the top
    left instead, which is only right when q_len == kv_len.

    With ``window`` set, a query also stops seeing keys ``window`` or more positions
    behind it (sliding-window attention).

    ``align="top_left"`` builds the ``is_causal=True`` mask instead (query i at position
    i), so lessons can show it beside the right one; nothing in the model uses it.
    """
    require_positive_int("q_len", q_len)
    require_positive_int("kv_len", kv_len)
    if q_len > kv_len:
        raise ValueError(
            f"q_len must be <= kv_len (the keys include the new tokens), got q_len={q_len}, kv_len={kv_len}"
        )
    if window is not None:
        require_positive_int("window", window)
    if align not in MASK_ALIGNMENTS:
        raise ValueError(f"align must be one of {MASK_ALIGNMENTS}, got {align!r}")
    first = kv_len - q_len if align == "bottom_right" else 0  # absolute position of query 0
    q_pos = torch.arange(first, first + q_len, device=device).unsqueeze(1)  # (T, 1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)  # (1, S)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def repeat_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return K or V ``(B, H_kv, S, D)`` with each head repeated ``group_size`` times: ``(B, H_kv*g, S, D)``."""
    require_positive_int("group_size", group_size)
    if group_size == 1:
        return x
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, group_size, s, d).reshape(b, h_kv * group_size, s, d)


def kv_group_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Return how many query heads read each KV head, after checking q, k, v are shaped for attention."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D (batch, heads, tokens, head_dim)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must hold the same (batch, heads, tokens), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    h_q, h_kv = q.shape[1], k.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    return h_q // h_kv


def _attention_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, window: int | None):
    """The mask both attention functions apply: the caller's, the default causal one, and the window."""
    t, s = q.shape[2], k.shape[2]
    if mask is None and (t > 1 or window is not None):
        return causal_mask(t, s, device=q.device, window=window)
    if mask is not None and window is not None:
        return mask & causal_mask(t, s, device=q.device, window=window)
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Return attention output ``(B, H_q, T, D_v)`` for new queries over all keys.

    q: (B, H_q, T, D), the new tokens' queries.
    k, v: (B, H_kv, S, D) and (B, H_kv, S, D_v), cached keys/values followed by the new
    ones (S >= T); D_v is D but for latent attention (:mod:`kvlessons.mla`).
    mask: optional bool mask broadcastable to (B, H_q, T, S). When omitted, the
    bottom-right causal mask is used for T > 1; a single query needs none, because
    the cache only holds positions at or before it (unless a window cuts it).
    scale: what scores are multiplied by; 1/sqrt(D) when omitted.
    """
    group_size = kv_group_size(q, k, v)
    mask = _attention_mask(q, k, mask, window)
    # enable_gqa lets SDPA read each KV head for its whole group of query heads.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group_size > 1, scale=scale)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    return_weights: bool = False,
    scale: float | None = None,
):
    """Return the attention output ``(B, H_q, T, D)``, written out step by step; with
    ``return_weights``, the pair (output, weights ``(B, H_q, T, S)``).

    The same arguments, mask defaults and result as :func:`attend`, computed as
    Vaswani et al. 2017 (arXiv 1706.03762) write it in equation 1:
    ``softmax(q k^T / sqrt(D))`` over the keys a query may see, then the weighted sum
    of the values. Each row of the weights sums to 1. ``scale`` replaces 1/sqrt(D), as in :func:`attend`.

    Grouped-query attention is done in the grouped layout: the g query heads that
    read one KV head are stacked along the query axis, so one matmul per KV head
    reads its keys once and K and V are never copied g times. Repeating each KV head
    g times first (:func:`repeat_kv`) and attending head by head is the same arithmetic.
    """
    group_size = kv_group_size(q, k, v)
    mask = _attention_mask(q, k, mask, window)
    b, h_q, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, h_kv, group_size * t, d)  # (B, H_kv, g*T, D): query head h is in group h // g
    scores = qg @ k.transpose(-1, -2)
    scores = (scores / d**0.5 if scale is None else scores * scale).view(b, h_kv, group_size, t, s)  # (B, H_kv, g, T, S)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, True where a query may attend, got {mask.dtype}")
        mask = mask[(None,) * (4 - mask.dim())]  # broadcastable to (B, H_q, T, S)
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.unflatten(1, (h_kv, group_size))
        scores = scores.masked_fill(~mask, float("-inf"))  # a hidden key gets weight exactly 0
    weights = scores.softmax(-1)  # (B, H_kv, g, T, S)
    out = (weights.view(b, h_kv, group_size * t, s) @ v).view(b, h_q, t, v.shape[-1])  # (B, H_q, T, D_v)
    return (out, weights.view(b, h_q, t, s)) if return_weights else out


def positions_from_padding(pad_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, S) for a left-padded batch: each row counts only its real tokens.

    ``pad_mask`` (B, S) is True for real tokens. The first real token of every row gets
    position 0 (cumsum - 1); pads get 0 too, and are never attended to.
    """
    if pad_mask.dim() != 2 or pad_mask.dtype != torch.bool:
        raise ValueError("pad_mask must be a bool tensor (batch, tokens), True for real tokens")
    return (pad_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_causal_mask(pad_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Mask (B, 1, q_len, S) for the last ``q_len`` of S positions: causal, and no query sees a pad.

    A pad query would then see nothing at all (a softmax over nothing is NaN), so it is
    allowed to see itself; its output is never read by a real token.
    """
    if pad_mask.dim() != 2 or pad_mask.dtype != torch.bool:
        raise ValueError("pad_mask must be a bool tensor (batch, tokens), True for real tokens")
    s = pad_mask.shape[1]
    causal = causal_mask(q_len, s, device=pad_mask.device)  # (T, S)
    itself = torch.zeros_like(causal)
    itself[torch.arange(q_len), torch.arange(s - q_len, s)] = True
    return causal & (pad_mask[:, None, None, :] | itself)  # (B, 1, T, S)
