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

from dataclasses import dataclass

import torch

from .shape import require_positive_int

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))  # 0.25, 0.75, ..., 5.0


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
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension: element 0 in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_input(x: torch.Tensor, block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be divisible by block ({block})")
    if not torch.isfinite(x).all():
        raise ValueError("x must be finite: NaN or Inf cannot be quantized")


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

    fmt:          "nvfp4" (packed E2M1 codes + E4M3 block scales) or "fp8" (E4M3 values).
    data:         uint8 packed codes (nvfp4) or float8_e4m3fn values (fp8).
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

    def effective_scales(self) -> torch.Tensor:
        """Per-block multiplier block_scale x tensor_scale, float64, shape (..., n_blocks)."""
        return self.block_scales.to(torch.float64) * self.tensor_scale.to(torch.float64)

    def dequantize(self) -> torch.Tensor:
        """The stored values in the original shape and dtype."""
        if self.fmt == "fp8":
            return (self.data.to(torch.float32) * self.tensor_scale).to(self.dtype)
        if self.fmt == "fp4_tensor":
            return (decode_e2m1(unpack_nibbles(self.data)) * self.tensor_scale).reshape(self.shape).to(self.dtype)
        values = decode_e2m1(self.codes()).to(torch.float64)
        blocks = values.view(*values.shape[:-1], -1, self.block) * self.effective_scales()[..., None]
        return blocks.reshape(self.shape).to(self.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The stored values of ``q`` in its original shape and dtype."""
    return q.dequantize()


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp32 scale that maps the largest block scale to E4M3's maximum."""
    return _tensor_scale(x, None, E2M1_MAX * E4M3_MAX)


def _tensor_scale(x: torch.Tensor, given, divisor: float) -> torch.Tensor:
    """``given`` as a checked fp32 scalar, or by default amax(x) / divisor (1 for an all-zero tensor)."""
    if given is None:
        amax = x.detach().abs().max().to(torch.float32)
        given = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))  # all zeros: any scale works
    scale = torch.as_tensor(given, dtype=torch.float32, device=x.device).reshape(())
    if not torch.isfinite(scale) or scale <= 0:
        raise ValueError(f"tensor_scale must be positive and finite, got {scale.item()}")
    return scale


def quantize(x: torch.Tensor, block: int = 16, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as NVFP4: E2M1 codes, an E4M3 scale per ``block`` values, one fp32 tensor scale.

    Each block's scale is its absolute maximum / 6 (so the block's largest value maps
    to E2M1's 6), divided by the tensor scale and stored in E4M3. Values are divided by
    the *stored* scale (as a decoder will multiply by it) and rounded to the nearest
    E2M1 value, ties to even. ``tensor_scale`` may be given (a calibrated constant, as a
    cache uses so every write shares it); by default it is amax(x) / (6 x 448).
    """
    _check_input(x, block)
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {x.shape[-1]}")
    tensor_scale = _tensor_scale(x, tensor_scale, E2M1_MAX * E4M3_MAX)
    x64 = x.detach().to(torch.float64)
    blocks = x64.reshape(*x.shape[:-1], -1, block)  # (..., n_blocks, block)
    amax = blocks.abs().amax(dim=-1)  # (..., n_blocks)
    block_scales = to_e4m3(amax / E2M1_MAX / tensor_scale.to(torch.float64))
    effective = block_scales.to(torch.float64) * tensor_scale.to(torch.float64)
    # A block whose stored scale is 0 (all zeros, or underflow) can only hold zeros.
    scaled = torch.where(effective[..., None] > 0, blocks / effective[..., None].clamp_min(1e-300), blocks * 0)
    codes = encode_e2m1(scaled).reshape(x.shape)
    return QuantizedTensor("nvfp4", pack_nibbles(codes), block_scales, tensor_scale, x.shape, x.dtype, block)


def quantize_fp8(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as E4M3 values times one fp32 tensor scale (default amax / 448); 1 byte per value + 4."""
    _check_input(x, 1)
    tensor_scale = _tensor_scale(x, tensor_scale, E4M3_MAX)
    data = to_e4m3(x.detach().to(torch.float32) / tensor_scale)
    return QuantizedTensor("fp8", data, None, tensor_scale, x.shape, x.dtype)


def quantize_fp4_tensor(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """FP4 E2M1 codes with ONE scale for the whole tensor (default amax / 6), no block scales: 4 bits + 4 bytes.

    The format without the part that makes 4 bits usable, for comparison.
    """
    _check_input(x, 1)
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {x.shape[-1]}")
    tensor_scale = _tensor_scale(x, tensor_scale, E2M1_MAX)
    codes = encode_e2m1(x.detach().to(torch.float64) / tensor_scale.to(torch.float64))
    return QuantizedTensor("fp4_tensor", pack_nibbles(codes), None, tensor_scale, x.shape, x.dtype)


QUANTIZERS = {"nvfp4": quantize, "fp8": quantize_fp8, "fp4_tensor": quantize_fp4_tensor}


def fake_quantize(x: torch.Tensor, fmt: str = "nvfp4", **kwargs) -> torch.Tensor:
    """``x`` after a round trip through the format (what attention sees when reading the cache)."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt must be one of {tuple(QUANTIZERS)}, got {fmt!r}")
    return QUANTIZERS[fmt](x, **kwargs).dequantize()


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

from .cache import KVCache, LayerCache, _check_crop, _check_kv  # noqa: E402
from .memory import TENSOR_SCALE_BYTES  # noqa: E402


class QuantizedLayer(LayerCache):
    """K and V stored as NVFP4 or FP8 codes, the newest ``residual`` tokens kept in full precision.

    Keys arrive already rotated, so what is quantized is exactly what attention reads
    (quantization after RoPE). New tokens go into the full-precision tail; tokens that
    fall out of the tail are quantized row by row (a block never spans two tokens), so
    the stored codes do not depend on how the sequence was chunked. ``update`` returns
    every held key dequantized, followed by the tail: with ``residual=0`` attention sees
    quantized keys only, its own included, as a kernel reading the cache would.
    """

    def __init__(self, fmt: str = "nvfp4", residual: int = 0, k_scale: float | None = None, v_scale: float | None = None, block: int = 16):
        super().__init__()
        if fmt not in QUANTIZERS:
            raise ValueError(f"fmt must be one of {tuple(QUANTIZERS)}, got {fmt!r}")
        self.fmt, self.block = fmt, block
        self.residual = require_positive_int("residual", residual, allow_zero=True)
        # Per-layer tensor scales (vLLM calls them k_scale / v_scale), constant so every write
        # is quantized the same way. Default 1.0 for nvfp4/fp8 (their block scales or 8 bits
        # cover activations of order 1 to 1,000); fp4_tensor has nothing else, so by default
        # it calibrates once, from the first write's largest value.
        default = None if fmt == "fp4_tensor" else 1.0
        self.scales = [None if s is None and default is None else torch.tensor(float(default if s is None else s))
                       for s in (k_scale, v_scale)]
        self._stored: list[list[QuantizedTensor]] = [[], []]  # chunks of quantized K, V
        self._tail: list[torch.Tensor | None] = [None, None]  # (B, H, <= residual, D) full precision
        self._cache: list[torch.Tensor | None] = [None, None]  # dequantized stored part, kept to avoid redoing it

    def _quantize(self, x, which):
        if self.scales[which] is None:  # calibrate once, from the first block of tokens written
            self.scales[which] = _tensor_scale(x, None, E2M1_MAX).cpu()
        kwargs = {"tensor_scale": self.scales[which].to(x.device)}
        if self.fmt == "nvfp4":
            kwargs["block"] = self.block
        return QUANTIZERS[self.fmt](x, **kwargs)

    @property
    def quantized_len(self) -> int:
        return sum(q.shape[2] for q in self._stored[0])

    def _full(self, which):
        parts = [p for p in (self._cache[which], self._tail[which]) if p is not None]
        return torch.cat(parts, dim=2) if len(parts) > 1 else (parts[0] if parts else None)

    @property
    def keys(self):
        return self._full(0)

    @property
    def values(self):
        return self._full(1)

    def update(self, k, v):
        _check_kv(k, v, self._tail[0] if self._tail[0] is not None else self._cache[0])
        for which, x in enumerate((k, v)):
            tail = x if self._tail[which] is None else torch.cat([self._tail[which], x], dim=2)
            spill = tail.shape[2] - self.residual
            if spill > 0:  # the oldest tokens leave the tail: quantize them
                q = self._quantize(tail[:, :, :spill], which)
                self._stored[which].append(q)
                deq = q.dequantize()
                self._cache[which] = deq if self._cache[which] is None else torch.cat([self._cache[which], deq], dim=2)
                tail = tail[:, :, spill:]
            self._tail[which] = tail.clone() if tail.shape[2] else None  # clone: do not pin the bigger tensor
        self.seq_len += k.shape[2]
        return self.keys, self.values

    def nbytes(self):
        if self.seq_len == 0:
            return 0
        total = 2 * TENSOR_SCALE_BYTES  # one fp32 scale for K, one for V
        total += sum(q.nbytes - q.tensor_scale.nbytes for chunks in self._stored for q in chunks)  # scales counted once
        total += sum(t.nbytes for t in self._tail if t is not None)
        return total

    def reset(self):
        self._stored, self._tail, self._cache = [[], []], [None, None], [None, None]
        self.seq_len = 0

    def crop(self, length):
        _check_crop(length, self.seq_len)
        keys, values = self.keys, self.values
        n_q = self.quantized_len
        if length < n_q:
            # Rebuilding from dequantized values re-quantizes exactly (they are on the grid).
            self.reset()
            if length:
                self._restore(keys[:, :, :length], values[:, :, :length], quantized=length)
            return
        tail_k, tail_v = self._tail
        self._tail = [t[:, :, : length - n_q].clone() if t is not None and length > n_q else None for t in (tail_k, tail_v)]
        self.seq_len = length

    def _restore(self, k, v, quantized):
        for which, x in enumerate((k, v)):
            q = self._quantize(x, which)
            self._stored[which] = [q]
            self._cache[which] = q.dequantize()
        self.seq_len = quantized


class QuantizedCache(KVCache):
    """A cache whose layers store K and V in ``fmt`` ("nvfp4", "fp8" or "fp4_tensor"), newest ``residual`` tokens in full precision."""

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

from .attention import attend, causal_mask, repeat_kv  # noqa: E402
from .rope import apply_rope, rope_tables  # noqa: E402


def _heads_quantize(x, fmt):
    # Per-row scales (blocks along head_dim) with a tensor scale of 1, as the cache stores them.
    return fake_quantize(x, fmt, tensor_scale=1.0)


@torch.no_grad()
def attention_drift(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str = "nvfp4") -> dict:
    """Attention with K and V stored in ``fmt`` against full precision, causal, same queries.

    Returns the relative error of the attention output, the mean total-variation
    distance between the attention weights (0 = identical, 1 = disjoint), and the
    largest change of any single weight.
    """
    t, s = q.shape[2], k.shape[2]
    kq, vq = _heads_quantize(k, fmt), _heads_quantize(v, fmt)
    g = q.shape[1] // k.shape[1]
    mask = causal_mask(t, s, device=q.device)

    def weights(keys):
        scores = q @ repeat_kv(keys, g).transpose(-1, -2) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)

    w_full, w_quant = weights(k), weights(kq)
    return {
        "output_rel_error": relative_error(attend(q, k, v), attend(q, kq, vq)),
        "weight_tv": 0.5 * (w_full - w_quant).abs().sum(-1).mean().item(),
        "weight_max_change": (w_full - w_quant).abs().max().item(),
    }


def _teacher_forced(model, prefix: torch.Tensor, continuation: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Next-token logits (B, 1 + N, vocab) reading ``prefix`` in one pass, then ``continuation`` one token per step."""
    cache.reset()
    steps = [model(prefix, cache=cache, last_only=True)[:, -1]]
    for i in range(continuation.shape[1]):
        steps.append(model(continuation[:, i : i + 1], cache=cache)[:, -1])
    return torch.stack(steps, dim=1)


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
