"""A tiny decoder with no KV cache of its own, for you to give it one (lesson 01, "Write the cache yourself").

Everything is in this file, and it imports nothing from the rest of kvlessons, so it reads in
one sitting: a token embedding, ``layers`` blocks of grouped-query attention with rotary
positions and a SwiGLU MLP, a final norm and the output projection, with weights drawn from
``config.seed``.

Without a cache, ``model(ids)`` reads ``ids`` as the whole sequence, positions 0 .. T-1.
Given a cache, the model hands it the three jobs a cache has and does nothing else with it:

    once per pass, before the layers:   positions, mask = cache.positions_and_mask(t)
    in every layer:                      k, v = cache.update(index, k, v, cos, sin)
    once per pass, after the last layer: cache.advance(t)

``update`` receives this pass's keys before rotation, with the rotary tables of the new
tokens (Hugging Face's ``Cache.update`` is handed ``sin`` and ``cos`` the same way), and
returns every key and value the layer attends over. ``kvlessons.exercises.check_my_cache``
feeds a sequence through a cache in chunks and compares it with one uncached pass of this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ScaffoldConfig:
    """Sizes of :class:`TinyModel`: small enough that a forward pass takes about a millisecond on a CPU."""

    vocab_size: int = 96  # the course's character tokenizer
    hidden_size: int = 48
    layers: int = 3
    q_heads: int = 6
    kv_heads: int = 2  # grouped-query attention: 3 query heads read each KV head
    head_dim: int = 8
    mlp_hidden: int = 128
    rope_theta: float = 10000.0
    seed: int = 0


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """Return ``(cos, sin)``, each (T, head_dim), for integer ``positions`` (T,).

    Rotary position embeddings (Su et al. 2021, arXiv 2104.09864): dimensions j and
    j + head_dim/2 form a pair that turns by ``position * theta ** (-2j / head_dim)``.
    """
    speeds = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[:, None] * speeds[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D): both members of a pair turn by the same angle
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return ``x`` (B, H, T, D) with each pair of dimensions turned by its token's angle (RoPE)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Return softmax attention (B, H_q, T, D) of queries q (B, H_q, T, D) over keys and values (B, H_kv, S, D).

    ``mask`` (T, S) is True where a query may look; None lets every query see every key.
    (An additive float mask, 0 or -inf, is added to the scores instead.) Grouped-query
    attention: each KV head serves H_q / H_kv consecutive query heads.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H_q, S, D)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H_q, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(dim=-1) @ v


class Layer(nn.Module):
    """One decoder block: RMSNorm, attention (GQA with RoPE), residual; RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, config: ScaffoldConfig):
        super().__init__()
        c = self.config = config
        self.attn_norm = nn.RMSNorm(c.hidden_size, eps=1e-5)
        self.q_proj = nn.Linear(c.hidden_size, c.q_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.q_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(c.hidden_size, eps=1e-5)
        self.gate_proj = nn.Linear(c.hidden_size, c.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(c.mlp_hidden, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache=None, index=0):
        """Return x (B, T, hidden) after this block; ``index`` is the layer's number, which the cache is told."""
        c = self.config
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, c.q_heads, c.head_dim).transpose(1, 2)  # (B, H_q, T, D)
        k = self.k_proj(h).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)  # (B, H_kv, T, D), not rotated yet
        v = self.v_proj(h).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        q = rotate(q, cos, sin)
        if cache is None:
            k = rotate(k, cos, sin)  # no cache: this pass's keys are all the keys there are
        else:
            k, v = cache.update(index, k, v, cos, sin)
        out = attention(q, k, v, mask).transpose(1, 2).reshape(b, t, c.q_heads * c.head_dim)
        x = x + self.o_proj(out)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyModel(nn.Module):
    """A decoder that recomputes everything unless it is handed a cache; its weights depend only on ``config.seed``."""

    def __init__(self, config: ScaffoldConfig | None = None):
        super().__init__()
        c = self.config = config or ScaffoldConfig()
        # nn.Linear draws its default weights from the global generator: fork it, so building
        # a model does not shift the random numbers a notebook draws afterwards.
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
            self.norm = nn.RMSNorm(c.hidden_size, eps=1e-5)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self._draw_weights(c.seed)
        self.eval()

    @torch.no_grad()
    def _draw_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                continue  # RMSNorm gains start at 1
            fan_in = p.shape[1] if name != "embed.weight" else 1
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))

    def forward(self, ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Return logits (B, T, vocab) for ``ids`` (B, T): the whole sequence, or the tokens after those ``cache`` holds."""
        t = ids.shape[1]
        if cache is None:  # the whole sequence in one pass: token i sees tokens 0..i
            positions = torch.arange(t)
            mask = torch.ones(t, t, dtype=torch.bool).tril()
        else:
            positions, mask = cache.positions_and_mask(t)
        positions = torch.as_tensor(positions, device=ids.device).reshape(-1)
        mask = None if mask is None else torch.as_tensor(mask, device=ids.device)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed(ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, index)
        if cache is not None:
            cache.advance(t)
        return self.lm_head(self.norm(x))
