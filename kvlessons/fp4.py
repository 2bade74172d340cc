"""4-bit floating-point storage (NVFP4-style) and FP8, built from the bits up.

E2M1: 1 sign bit, 2 exponent bits, 1 mantissa bit. Its 8 non-negative values are
0, 0.5, 1, 1.5, 2, 3, 4, 6: spaced 0.5 apart up to 2, then 1, then 2, because each
exponent step doubles the spacing. A code is ``sign << 3 | index`` into that list.

NVFP4 stores a tensor as E2M1 codes, one E4M3 (8-bit float) scale per block of 16
values along the last dimension, and one fp32 scale per tensor that keeps the block
scales inside E4M3's range: 4 + 8/16 = 4.5 bits per value, plus 4 bytes per tensor.

    value = E2M1[code] x block_scale (E4M3) x tensor_scale (fp32)

Rounding is to the nearest representable value, ties to the even code (the one
whose mantissa bit is 0), as torchao does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .shape import require_positive_int

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn
E4M3_MIN = 2.0**-9  # smallest positive torch.float8_e4m3fn (a subnormal: 1/8 x 2^-6)
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))  # 0.25, 0.75, ..., 5.0

# The largest magnitude each format stores with a tensor scale of 1. A tensor scale of
# amax / FORMAT_MAX[fmt] puts a tensor's largest value on it: for NVFP4 that is E2M1's 6
# times E4M3's largest block scale, 448, so every block scale lands in E4M3's range.
FORMAT_MAX = {"nvfp4": E2M1_MAX * E4M3_MAX, "fp8": E4M3_MAX, "fp4_tensor": E2M1_MAX}


def code_bits(code: int) -> str:
    """The 4 bits of an E2M1 code as 'S EE M' (sign, exponent, mantissa)."""
    if not 0 <= code < 16:
        raise ValueError(f"code must be in [0, 16), got {code}")
    b = f"{code:04b}"
    return f"{b[0]} {b[1:3]} {b[3]}"


def e2m1_value(code: int) -> float:
    """The value a 4-bit code stands for (sign bit 3, magnitude index bits 0-2)."""
    if not 0 <= code < 16:
        raise ValueError(f"code must be in [0, 16), got {code}")
    magnitude = E2M1_VALUES[code & 7]
    return -magnitude if code & 8 else magnitude


_E2M1_TABLE = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32)  # value of each code


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the E2M1 values nearest to ``x`` (already scaled), ties to even.

    Magnitudes beyond 6 saturate to 6. The sign bit is kept for -0.0 too.
    """
    a = x.abs().to(torch.float64).clamp(max=E2M1_MAX).contiguous()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=x.device)
    below = torch.searchsorted(mids, a, right=False)  # index if a is not past a midpoint
    above = torch.searchsorted(mids, a, right=True)  # index + 1 exactly at a midpoint
    index = torch.where((below == above) | (below % 2 == 0), below, above)  # a tie picks the even index
    sign = torch.signbit(x).to(torch.uint8) << 3
    return (sign | index.to(torch.uint8)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (0..15)."""
    # A table lookup; index_select, because plain indexing (table[codes]) is many times slower on CPU.
    return _E2M1_TABLE.to(codes.device).index_select(0, codes.flatten().long()).view(codes.shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension: element 0 in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1 (the number of values that share one scale), got {block!r}")
    return block


def _check_input(x: torch.Tensor, block: int = 1, packed: bool = False, name: str = "x") -> None:
    """Raise ValueError unless ``x`` can be stored: finite, last dimension split into blocks (and pairs, if packed)."""
    _check_block(block)
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension of {name} ({x.shape[-1]}) must be divisible by block ({block})")
    if packed and x.shape[-1] % 2:
        raise ValueError(f"the last dimension of {name} must be even to pack two codes per byte, got {x.shape[-1]}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite: NaN or Inf cannot be quantized")


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Cast to torch.float8_e4m3fn after clamping into [-448, 448].

    Clamping first matters: some PyTorch releases turn values at or above 480 into NaN
    instead of saturating (see :func:`fp8_cast_of`).
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_cast_of(value: float) -> float:
    """What this PyTorch build's plain cast to float8_e4m3fn makes of ``value`` (no clamping)."""
    return torch.tensor([value]).to(torch.float8_e4m3fn).float().item()


@dataclass
class QuantizedTensor:
    """A tensor stored as codes and scales; ``nbytes`` is what is actually held.

    fmt:          "nvfp4" (packed E2M1 codes + E4M3 block scales), "fp8" (E4M3 values)
                  or "fp4_tensor" (packed E2M1 codes, no block scales).
    data:         uint8 packed codes (nvfp4, fp4_tensor) or float8_e4m3fn values (fp8).
    block_scales: float8_e4m3fn, one per block of the last dimension (nvfp4), else None.
    tensor_scale: fp32 scalar tensor.
    """

    fmt: str
    data: torch.Tensor
    block_scales: torch.Tensor | None
    tensor_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block: int | None = None

    @property
    def nbytes(self) -> int:
        total = self.data.nbytes + self.tensor_scale.nbytes
        return total + (self.block_scales.nbytes if self.block_scales is not None else 0)

    def codes(self) -> torch.Tensor:
        """Unpacked 4-bit codes, one uint8 per value (nvfp4 only)."""
        if self.fmt != "nvfp4":
            raise ValueError("codes() is for nvfp4 tensors")
        return unpack_nibbles(self.data)

    def dequantize(self) -> torch.Tensor:
        """The stored values in the original shape and dtype.

        Computed in float32 without error until the last step: an E2M1 value times an
        E4M3 scale has at most 2 + 4 significant bits, so only the final multiplication
        by the fp32 tensor scale rounds.
        """
        if self.fmt == "fp8":
            values = self.data.to(torch.float32)
        elif self.fmt == "fp4_tensor":
            values = decode_e2m1(unpack_nibbles(self.data))
        else:
            blocks = decode_e2m1(unpack_nibbles(self.data)).unflatten(-1, (-1, self.block))  # (..., n_blocks, block)
            values = (blocks * self.block_scales.to(torch.float32)[..., None]).flatten(-2)
        return (values * self.tensor_scale).reshape(self.shape).to(self.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The stored values of ``q`` in its original shape and dtype."""
    return q.dequantize()


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp32 scale that maps the largest block scale to E4M3's maximum."""
    return _tensor_scale(x, None, FORMAT_MAX["nvfp4"])


def _as_scale(value, device, name: str = "tensor_scale") -> torch.Tensor:
    """``value`` as an fp32 scalar tensor on ``device``; ValueError naming ``name`` unless positive and finite."""
    scale = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    if not torch.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be positive and finite, got {scale.item()}")
    return scale


def _tensor_scale(x: torch.Tensor, given, divisor: float, name: str = "tensor_scale") -> torch.Tensor:
    """``given`` as a checked fp32 scalar, or by default amax(x) / divisor (1 for an all-zero tensor)."""
    if given is None:
        amax = x.detach().abs().max().to(torch.float32)
        given = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))  # all zeros: any scale works
    return _as_scale(given, x.device, name)


def quantize(x: torch.Tensor, block: int = 16, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as NVFP4: E2M1 codes, an E4M3 scale per ``block`` values, one fp32 tensor scale.

    Each block's scale is its absolute maximum / 6 (so the block's largest value maps
    to E2M1's 6), divided by the tensor scale and stored in E4M3; a block that is not
    all zeros never gets a scale below E4M3's smallest positive value, 2^-9 (rounding to
    0 would erase the whole block). Values are divided by the *stored* scale (as a
    decoder will multiply by it) and rounded to the nearest E2M1 value, ties to even.
    ``tensor_scale`` may be given (a calibrated constant, as a cache uses so every write
    shares it); by default it is amax(x) / (6 x 448), so the largest block scale is 448.
    """
    _check_input(x, block, packed=True)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["nvfp4"])
    blocks = x.detach().to(torch.float64).unflatten(-1, (-1, block))  # (..., n_blocks, block)
    amax = blocks.abs().amax(dim=-1)  # (..., n_blocks)
    wanted = amax / E2M1_MAX / tensor_scale.to(torch.float64)
    block_scales = to_e4m3(torch.where(amax > 0, wanted.clamp_min(E4M3_MIN), wanted))
    effective = (block_scales.to(torch.float64) * tensor_scale.to(torch.float64))[..., None]
    # Only an all-zero block has a stored scale of 0; its codes are 0 too.
    scaled = torch.where(effective > 0, blocks / effective.clamp_min(1e-300), blocks * 0)
    codes = encode_e2m1(scaled).reshape(x.shape)
    return QuantizedTensor("nvfp4", pack_nibbles(codes), block_scales, tensor_scale, x.shape, x.dtype, block)


def quantize_fp8(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as E4M3 values times one fp32 tensor scale (default amax / 448); 1 byte per value + 4."""
    _check_input(x)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["fp8"])
    data = to_e4m3(x.detach().to(torch.float32) / tensor_scale)
    return QuantizedTensor("fp8", data, None, tensor_scale, x.shape, x.dtype)


def quantize_fp4_tensor(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """FP4 E2M1 codes with ONE scale for the whole tensor (default amax / 6), no block scales: 4 bits + 4 bytes.

    The format without the part that makes 4 bits usable, for comparison.
    """
    _check_input(x, packed=True)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["fp4_tensor"])
    codes = encode_e2m1(x.detach().to(torch.float64) / tensor_scale.to(torch.float64))
    return QuantizedTensor("fp4_tensor", pack_nibbles(codes), None, tensor_scale, x.shape, x.dtype)


QUANTIZERS = {"nvfp4": quantize, "fp8": quantize_fp8, "fp4_tensor": quantize_fp4_tensor}


def _check_fmt(fmt) -> str:
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt must be one of {tuple(QUANTIZERS)}, got {fmt!r}")
    return fmt


def fake_quantize(x: torch.Tensor, fmt: str = "nvfp4", **kwargs) -> torch.Tensor:
    """``x`` after a round trip through the format (what attention sees when reading the cache)."""
    return QUANTIZERS[_check_fmt(fmt)](x, **kwargs).dequantize()


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


# ---------------------------------------------------------------------------------------------
# A quantized KV cache on the foundation's interface
# ---------------------------------------------------------------------------------------------

from .cache import KVCache, LayerCache, _check_kv  # noqa: E402

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
        q = self._stored[0]
        return None if q is None else torch.empty(*q.shape[:2], 0, q.shape[3], dtype=q.dtype, device=q.data.device)

    def update(self, k, v):
        _check_kv(k, v, self._held_like())
        block = self.block if self.fmt == "nvfp4" else 1
        for name, x in (("k", k), ("v", v)):
            _check_input(x, block, packed=self.fmt != "fp8", name=name)
        # Compute everything for K and V first and store it after, so a failure stores neither.
        scales = self._scales
        if scales[0] is None:  # the first write: calibrate, or put the given scales on its device
            scales = [_tensor_scale(x, given, FORMAT_MAX[self.fmt], name)
                      for x, given, name in zip((k, v), self.given_scales, ("k_scale", "v_scale"))]
        stored, tail = list(self._stored), list(self._tail)
        for which, x in enumerate((k, v)):
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

    def crop(self, length):
        """Keep the first ``length`` tokens, in new tensors (the held ones are never written into)."""
        self.check_crop(length)
        if length == 0:
            self.reset()
            return
        n_quantized = self.quantized_len
        if length <= n_quantized:
            self._stored = [_first_tokens(q, length) for q in self._stored]
            self._tail = [None, None]
        else:
            self._tail = [t[:, :, : length - n_quantized].clone() for t in self._tail]
        self.seq_len = length


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


# ---------------------------------------------------------------------------------------------
# What quantization does to attention and to generated text
# ---------------------------------------------------------------------------------------------

from .attention import attend, reference_attention  # noqa: E402
from .rope import apply_rope, rope_tables  # noqa: E402


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
    from .generate import feed_in_chunks

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
    from .cache import ConcatCache
    from .generate import generate

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
    kl = torch.nn.functional.kl_div(cand.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    kl = kl.clamp_min(0)  # KL is never negative; rounding can make an exact match print as -0.0000
    return {
        "top1": (cand.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "kl": kl.mean().item(),
        "max_logit_diff": (cand - reference).abs().max().item(),
    }
