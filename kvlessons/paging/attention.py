"""Attention through a block table (lesson 06): gather a sequence's blocks, or visit them one by one."""

from __future__ import annotations

import math

import torch

from ..attention import attend


def slot_indices(block_table: list[int] | torch.Tensor, seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Flat pool slot of every position 0..seq_len-1: table[p // block_size] * block_size + p % block_size."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=device)
    pos = torch.arange(seq_len, device=table.device)
    return table[pos // block_size] * block_size + pos % block_size


def gather_rows(pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """A sequence's rows (seq_len, H_kv, D) from a pool (num_blocks, block_size, H_kv, D), whole blocks at a time."""
    num_blocks, block_size, h, d = pool.shape
    n = -(-seq_len // block_size)
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)[:n]
    return pool.index_select(0, table).view(n * block_size, h, d)[:seq_len]


def gather_kv(pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """One sequence's K or V (1, H_kv, seq_len, D), laid out as contiguous attention expects."""
    return gather_rows(pool, block_table, seq_len).transpose(0, 1).unsqueeze(0)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """Attention (1, H_q, T, D) of a sequence's last T queries over its keys, read through the block table.

    The blocks are gathered whole (one index per block, not per token) and seen, through
    a transposed view, in the (1, H_kv, S, D) layout attention expects; then
    :func:`~kvlessons.attention.attend` runs on them as it does on a contiguous cache,
    with the bottom-right causal mask for T > 1. The only difference from contiguous
    attention is the gather and the strided layout it leaves the keys in.
    """
    k, v = gather_kv(k_pool, block_table, seq_len), gather_kv(v_pool, block_table, seq_len)  # (1, H_kv, S, D)
    return attend(q, k, v)


def paged_attention_blockwise(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
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
    _, block_size, h_kv, d = k_pool.shape
    g = q.shape[1] // h_kv
    qg = q[0, :, 0].view(h_kv, g, d).to(torch.float32) / d**0.5  # (H_kv, g, D)
    running_max = torch.full((h_kv, g), float("-inf"), device=q.device)
    denom = torch.zeros(h_kv, g, device=q.device)
    acc = torch.zeros(h_kv, g, d, device=q.device)
    for i, block in enumerate(block_table[: math.ceil(seq_len / block_size)]):
        n = min(block_size, seq_len - i * block_size)
        k = k_pool[block, :n].transpose(0, 1).to(torch.float32)  # (H_kv, n, D)
        v = v_pool[block, :n].transpose(0, 1).to(torch.float32)
        scores = qg @ k.transpose(-1, -2)  # (H_kv, g, n)
        new_max = torch.maximum(running_max, scores.amax(-1))
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + p @ v
        running_max = new_max
    return (acc / denom[..., None]).reshape(1, h_kv * g, 1, d).to(q.dtype)
