"""Attention through a block table (lesson 06): gather a sequence's blocks, or visit them one by one.

The pool's layout. One tensor per cache layer holds the keys and values of every block:
``(2, H_kv, num_blocks, block_size, D)``, K then V, and for each of them every KV head's
blocks one after another (head-major). Block ``b`` is ``pool[:, :, b]``; position ``p``
of a sequence is slot ``p % block_size`` of block ``block_table[p // block_size]``.

Why head-major: attention reads each KV head's keys as one run of rows,
``(1, H_kv, S, D)``. Picking a sequence's blocks along the block axis of this pool (one
``index_select`` for K and V of every head together) yields exactly that: within each
head the chosen blocks land one after another, so the gathered keys are laid out as a
contiguous cache's, and attention reads them as it reads a contiguous cache. With the
block axis first instead (``(num_blocks, block_size, H_kv, D)``, one row per slot, the
layout of lesson 06's exercise) the same gather interleaves the heads row by row, and
either a second copy or a strided read is needed before attention. FlashInfer's
"HND" paged layout orders each block head-major for the same reason.
"""

from __future__ import annotations

import math

import torch

from ..attention import attend


def slot_indices(block_table: list[int] | torch.Tensor, seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Flat slot of every position 0..seq_len-1: table[p // block_size] * block_size + p % block_size."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=device)
    pos = torch.arange(seq_len, device=table.device)
    return table[pos // block_size] * block_size + pos % block_size


def gather_kv(pool: torch.Tensor, block_table, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence's keys and values, each (1, H_kv, seq_len, D), from a pool (2, H_kv, num_blocks, block_size, D).

    A latent (MLA) pool, (1, 1, num_blocks, block_size, latent_dim), holds keys only: its values are None.

    One index per block (not per token), for K and V and every head at once: the
    sequence's blocks, in table order, become one run of rows per head, and the slots of
    the last block past ``seq_len`` are left out. The two results are views of one new
    tensor, already in the layout attention reads (see the module's docstring).
    """
    parts, h_kv, _, block_size, d = pool.shape
    n = -(-seq_len // block_size)  # the blocks holding positions 0 .. seq_len - 1
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)
    if len(table) < n:
        raise ValueError(f"{seq_len} positions need {n} blocks of {block_size}; the block table holds {len(table)}")
    k, *v = pool.index_select(2, table[:n]).view(parts, 1, h_kv, n * block_size, d)[..., :seq_len, :].unbind(0)
    return k, (v[0] if v else None)


def paged_attention(q: torch.Tensor, pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """Attention (1, H_q, T, D) of a sequence's last T queries over its keys, read through the block table.

    The blocks are gathered whole (:func:`gather_kv`) into the (1, H_kv, S, D) layout of
    a contiguous cache; then :func:`~kvlessons.attention.attend` runs on them exactly as it
    does on a contiguous cache (grouped-query heads read their KV head in place; the
    bottom-right causal mask for T > 1). The only difference from contiguous attention is
    the gather: one copy of the sequence's keys and values per call.
    """
    k, v = gather_kv(pool, block_table, seq_len)
    return attend(q, k, v)


def paged_attention_blockwise(q: torch.Tensor, pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The same result, one block at a time with a running softmax, as a paged kernel computes it.

    Never materialises the whole sequence's K/V: each block's scores update a running
    maximum, denominator and weighted sum (the online softmax of FlashAttention, Dao et
    al. 2022, arXiv 2205.14135; Milakov and Gimelshein 2018, arXiv 1805.02867).
    Decode form: one query per sequence (T = 1).

    This is a different algorithm from the package's one attention, kept on purpose
    because lesson 06 teaches it: the softmax is never taken over all the scores at
    once. The tests hold it equal to
    :func:`~kvlessons.attention.reference_attention` over the gathered keys.
    """
    if q.shape[2] != 1:
        raise ValueError("paged_attention_blockwise is the decode form: q must hold one token (T = 1)")
    _, h_kv, _, block_size, d = pool.shape
    g = q.shape[1] // h_kv
    qg = q[0, :, 0].view(h_kv, g, d).to(torch.float32) / d**0.5  # (H_kv, g, D)
    running_max = torch.full((h_kv, g), float("-inf"), device=q.device)
    denom = torch.zeros(h_kv, g, device=q.device)
    acc = torch.zeros(h_kv, g, d, device=q.device)
    for i, block in enumerate(block_table[: math.ceil(seq_len / block_size)]):
        n = min(block_size, seq_len - i * block_size)
        k, v = pool[:, :, block, :n].to(torch.float32)  # each (H_kv, n, D)
        scores = qg @ k.transpose(-1, -2)  # (H_kv, g, n)
        new_max = torch.maximum(running_max, scores.amax(-1))
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + p @ v
        running_max = new_max
    return (acc / denom[..., None]).reshape(1, h_kv * g, 1, d).to(q.dtype)
