"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864), Llama's half-split layout (lessons 01 and 07)."""

from __future__ import annotations

import torch

from .shape import require_even


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """Return ``(cos, sin)`` for integer ``positions`` (T,) or (B, T): each (…, T, head_dim).

    Dimension pair (j, j + head_dim/2) rotates by ``position * theta**(-2j/head_dim)``,
    the layout Hugging Face's Llama uses, so real checkpoints load unchanged.
    """
    require_even("head_dim", head_dim, "for rotary embeddings")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return ``x`` (B, H, T, D) rotated by the tables from :func:`rope_tables`."""
    if cos.dim() == 3:  # per-row positions (B, T, D): broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
