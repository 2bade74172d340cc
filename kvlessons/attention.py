"""Attention over a cache: the one mask helper and the one attention call.

Every attention call in the package goes through :func:`attend`, and every mask
comes from :func:`causal_mask`, so there is exactly one place where "which keys
may this query see" is decided.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .shape import require_positive_int


def causal_mask(q_len: int, kv_len: int, device=None, window: int | None = None) -> torch.Tensor:
    """Return a bool mask ``(q_len, kv_len)``, True where a query may attend to a key.

    The queries are the *last* ``q_len`` of ``kv_len`` positions: query i sits at
    absolute position ``kv_len - q_len + i`` and sees every key at or before it
    (bottom-right alignment). That is what a cache needs: the keys hold the cached
    tokens first, then the new ones. ``is_causal=True`` in PyTorch aligns to the top
    left instead, which is only right when q_len == kv_len.

    With ``window`` set, a query also stops seeing keys ``window`` or more positions
    behind it (sliding-window attention).
    """
    require_positive_int("q_len", q_len)
    require_positive_int("kv_len", kv_len)
    if q_len > kv_len:
        raise ValueError(
            f"q_len must be <= kv_len (the keys include the new tokens), got q_len={q_len}, kv_len={kv_len}"
        )
    if window is not None:
        require_positive_int("window", window)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)  # (T, 1)
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Return attention output ``(B, H_q, T, D)`` for new queries over all keys.

    q: (B, H_q, T, D), the new tokens' queries.
    k, v: (B, H_kv, S, D), cached keys/values followed by the new ones (S >= T).
    mask: optional bool mask broadcastable to (B, H_q, T, S). When omitted, the
    bottom-right causal mask is used for T > 1; a single query needs none, because
    the cache only holds positions at or before it (unless a window cuts it).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D (batch, heads, tokens, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h_q, t, h_kv, s = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if mask is None and (t > 1 or window is not None):
        mask = causal_mask(t, s, device=q.device, window=window)
    elif mask is not None and window is not None:
        mask = mask & causal_mask(t, s, device=q.device, window=window)
    # enable_gqa lets SDPA read each KV head for its whole group of query heads.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h_q != h_kv)


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
