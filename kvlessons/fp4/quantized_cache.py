"""A KV cache stored as NVFP4 or FP8 codes and scales, dequantized when attention reads it (lesson 05)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cache import KVCache, LayerCache, _check_kv
from ..shape import require_positive_int
from .formats import FORMAT_MAX, QUANTIZERS, QuantizedTensor, _as_scale, _check_block, _check_fmt, _check_input, _tensor_scale, quantize

# A layer's K and V are (B, H_kv, T, D): tokens along dim 2, in the codes and block scales too.


def _append_tokens(held: QuantizedTensor | None, new: QuantizedTensor) -> QuantizedTensor:
    """``held`` followed by ``new`` along the token axis: a new QuantizedTensor, neither input changed."""
    if held is None:
        return new
    cat = lambda a, b: None if a is None else torch.cat([a, b], dim=2)  # noqa: E731
    b, h, t, d = held.shape
    return replace(held, data=cat(held.data, new.data), block_scales=cat(held.block_scales, new.block_scales),
                   shape=torch.Size((b, h, t + new.shape[2], d)))


def _first_tokens(held: QuantizedTensor, n: int) -> QuantizedTensor:
    """The first ``n`` tokens of ``held`` in tensors of their own (a slice would pin the whole storage)."""
    first = lambda a: None if a is None else a[:, :, :n].clone()  # noqa: E731
    b, h, _, d = held.shape
    return replace(held, data=first(held.data), block_scales=first(held.block_scales), shape=torch.Size((b, h, n, d)))


class QuantizedLayer(LayerCache):
    """K and V stored as codes and scales, dequantized each time attention reads them.

    What the layer keeps, and all that ``nbytes()`` measures:

    - per K and V, one QuantizedTensor (B, H_kv, tokens, D) that grows along the token
      axis: packed codes, E4M3 block scales (nvfp4), and the tensor scale;
    - the newest ``residual`` tokens in full precision (KIVI, Hugging Face's QuantizedCache),
      quantized as they age out of this tail.

    Keys arrive already rotated, so what is quantized is exactly what attention reads
    (quantization after RoPE). Each token's row is quantized on its own (a block never
    spans two tokens) with the layer's one tensor scale, so with fixed scales the codes
    do not depend on how the sequence was chunked. ``update`` returns every stored token
    dequantized, then the tail: with ``residual=0`` attention sees quantized keys only,
    its own included, as a kernel reading the cache would. Nothing dequantized is kept:
    every read pays for dequantizing the whole layer again, the price of storing 4.5 bits.

    Tensor scales (vLLM's ``k_scale`` / ``v_scale``): given, they are fixed constants.
    By default each is calibrated from the layer's first write (the prompt), as NVFP4
    practice does: amax / FORMAT_MAX[fmt], i.e. amax / (6 x 448) for nvfp4, so the
    prompt's largest block gets E4M3's largest scale, 448, and other blocks scales in
    proportion (E4M3 reaches down to 2^-9, about 230,000 times less). Later values larger
    than the calibrated amax are clipped to it (the block scale, or the E4M3 value, saturates).
    """

    def __init__(self, fmt: str = "nvfp4", residual: int = 0, k_scale: float | None = None, v_scale: float | None = None, block: int = 16):
        super().__init__()
        self.fmt = _check_fmt(fmt)
        self.block = _check_block(block)
        self.residual = require_positive_int("residual", residual, allow_zero=True)
        for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
            if given is not None:
                _as_scale(given, "cpu", name)  # refuse a bad scale now, not at the first write
        self.given_scales = (k_scale, v_scale)
        # All tensors, all replaced rather than written into (so a transaction's snapshot can undo a pass):
        self._scales: list[torch.Tensor | None] = [None, None]  # fp32 tensor scale of K, V (set by the first write)
        self._stored: list[QuantizedTensor | None] = [None, None]  # quantized K, V (B, H_kv, quantized_len, D)
        self._tail: list[torch.Tensor | None] = [None, None]  # full-precision K, V (B, H_kv, <= residual, D)

    @property
    def quantized_len(self) -> int:
        """Tokens held quantized (the rest, at most ``residual``, are in the full-precision tail)."""
        return 0 if self._stored[0] is None else self._stored[0].shape[2]

    def _read(self, which: int) -> torch.Tensor | None:
        """Held K (0) or V (1): the stored tokens dequantized, then the tail (B, H_kv, seq_len, D)."""
        parts = [] if self._stored[which] is None else [self._stored[which].dequantize()]
        if self._tail[which] is not None:
            parts.append(self._tail[which])
        if not parts:
            return None
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    @property
    def keys(self):
        return self._read(0)

    @property
    def values(self):
        return self._read(1)

    def _held_like(self) -> torch.Tensor | None:
        """A tensor with the held (batch, kv_heads, head_dim), dtype and device, for ``_check_kv``."""
        if self._tail[0] is not None:
            return self._tail[0]
        q = self._stored[0]  # (a keys-only layer, see update, holds nothing at index 1)
        return None if q is None else torch.empty(*q.shape[:2], 0, q.shape[3], dtype=q.dtype, device=q.data.device)

    def update(self, k, v):
        held_v = False if self.seq_len == 0 else (self._stored[1] if self._stored[1] is not None else self._tail[1])
        _check_kv(k, v, self._held_like(), held_v)
        parts = (k,) if v is None else (k, v)  # v=None: keys only, a latent (MLA) layer's one tensor
        block = self.block if self.fmt == "nvfp4" else 1
        for name, x in zip(("k", "v"), parts):
            _check_input(x, block, packed=self.fmt != "fp8", name=name)
        # Compute everything for K and V first and store it after, so a failure stores neither.
        scales = self._scales
        if scales[0] is None:  # the first write: calibrate, or put the given scales on its device
            scales = [_tensor_scale(x, given, FORMAT_MAX[self.fmt], name)
                      for x, given, name in zip(parts, self.given_scales, ("k_scale", "v_scale"))]
            scales += [None] * (2 - len(parts))
        stored, tail = list(self._stored), list(self._tail)
        for which, x in enumerate(parts):
            recent = x if tail[which] is None else torch.cat([tail[which], x], dim=2)
            spill = recent.shape[2] - self.residual
            if spill > 0:  # the oldest tokens leave the tail: quantize them
                stored[which] = _append_tokens(stored[which], self._quantize(recent[:, :, :spill], scales[which]))
                recent = recent[:, :, spill:]
            tail[which] = recent.clone() if recent.shape[2] else None  # clone: own storage, pins nothing bigger
        self._scales, self._stored, self._tail = scales, stored, tail
        self.seq_len += k.shape[2]
        return self.keys, self.values

    def _quantize(self, x: torch.Tensor, tensor_scale: torch.Tensor) -> QuantizedTensor:
        if self.fmt == "nvfp4":
            return quantize(x, self.block, tensor_scale)
        return QUANTIZERS[self.fmt](x, tensor_scale)

    def reset(self):
        """Forget every token and the calibrated scales: the layer behaves as a new one."""
        self._scales, self._stored, self._tail = [None, None], [None, None], [None, None]
        self.seq_len = 0

    def _keep_first(self, length):
        """Keep the first ``length`` tokens, in new tensors (the held ones are never written into)."""
        n_quantized = self.quantized_len
        if length <= n_quantized:
            self._stored = [None if q is None else _first_tokens(q, length) for q in self._stored]
            self._tail = [None, None]
        else:
            self._tail = [None if t is None else t[:, :, : length - n_quantized].clone() for t in self._tail]


class QuantizedCache(KVCache):
    """A cache whose layers store K and V in ``fmt`` ("nvfp4", "fp8" or "fp4_tensor"), newest ``residual`` tokens in full precision.

    Its memory is :func:`kvlessons.memory.quantized_cache_bytes` (block=16, after appends;
    a crop can leave less in the tail). ``k_scale`` / ``v_scale`` fix the tensor scales;
    by default every layer calibrates its own from its first write (see :class:`QuantizedLayer`).
    """

    def __init__(self, fmt: str = "nvfp4", residual: int = 0, k_scale: float | None = None, v_scale: float | None = None, block: int = 16):
        super().__init__()
        QuantizedLayer(fmt, residual, k_scale, v_scale, block)  # validates the arguments now
        self.fmt, self.residual, self._args = fmt, residual, (fmt, residual, k_scale, v_scale, block)

    def new_layer(self, window=None):
        if window is not None:
            raise ValueError("QuantizedCache stores full-attention layers only (window must be None)")
        return QuantizedLayer(*self._args)

    def __repr__(self):
        return f"QuantizedCache(fmt={self.fmt!r}, residual={self.residual}, seq_len={self.seq_len}, nbytes={self.nbytes()})"
