import math

import pytest
import torch

from conftest import HEAD_LAYOUTS, feed_in_chunks, random_ids, small_model
from kvlessons.cache import ConcatCache
from kvlessons.fp4 import (
    E2M1_VALUES,
    QuantizedCache,
    QuantizedLayer,
    attention_drift,
    code_bits,
    compare_generation,
    decode_e2m1,
    dequantize,
    e2m1_value,
    encode_e2m1,
    fake_quantize,
    outlier_keys,
    pack_nibbles,
    quantize,
    quantize_fp8,
    relative_error,
    rope_order_error,
    unpack_nibbles,
)
from kvlessons.memory import measured_bytes, quantized_cache_bytes
from kvlessons.model import attention_inputs

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)

# Every positive E4M3 (torch.float8_e4m3fn) value as (value, mantissa bits): exponent bias 7,
# 3 mantissa bits; exponent 0 is subnormal (m/8 x 2^-6); the all-ones pattern is NaN, so the
# largest value is 1.75 x 2^8 = 448 and the smallest 2^-9.
E4M3_POSITIVE = [(m / 8 * 2.0**-6, m) for m in range(1, 8)] + [
    ((1 + m / 8) * 2.0 ** (e - 7), m) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)
]


def nearest(value: float, candidates) -> int:
    """Index of the candidate (value, mantissa) nearest to ``value``; a tie goes to the even mantissa."""
    dist = [abs(value - c) for c, _ in candidates]
    ties = [i for i, d in enumerate(dist) if d == min(dist)]
    return next((i for i in ties if candidates[i][1] % 2 == 0), ties[0])


def expected_tensor_scale(x: torch.Tensor, given) -> float:
    """The rule: a given scale as fp32, or amax(x) / (6 x 448) in fp32 (1 for all zeros)."""
    if given is not None:
        return float(torch.tensor(given, dtype=torch.float32))
    amax = torch.tensor(x.abs().max().item(), dtype=torch.float32)
    return float(amax / (6 * 448)) if amax > 0 else 1.0


def expected_block_scale(block_values, tensor_scale: float) -> float:
    """The rule: amax / 6 / tensor_scale rounded to the nearest positive E4M3 value (so at most 448 and at
    least 2^-9), ties to the even mantissa; 0 only for a block of zeros."""
    amax = max(abs(v) for v in block_values)
    return 0.0 if amax == 0 else E4M3_POSITIVE[nearest(amax / 6 / tensor_scale, E4M3_POSITIVE)][0]


def brute_force_codes(block_values, scale: float) -> list[int]:
    """Nearest of the block's 8 representable magnitudes (E2M1 x scale) for each value, ties to the even code."""
    magnitudes = [(g * scale, i) for i, g in enumerate(E2M1_VALUES)]  # index parity = mantissa bit
    if scale == 0:
        return [0] * len(block_values)
    return [nearest(abs(v), magnitudes) | (8 if math.copysign(1.0, v) < 0 else 0) for v in block_values]


def test_e2m1_values_and_codes():
    """Eight magnitudes 0..6; code = sign bit 3 + magnitude index; bits print as S EE M."""
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert [e2m1_value(c) for c in range(8, 16)] == [-v for v in E2M1_VALUES]
    assert code_bits(0b1011) == "1 01 1" and e2m1_value(0b1011) == -1.5


def test_all_16_codes_round_trip():
    """decode then encode returns every code, -0 included."""
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)


def test_ties_go_to_even():
    """Exactly halfway values pick the even index (mantissa bit 0)."""
    halfway = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert encode_e2m1(halfway).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert encode_e2m1(-halfway).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert encode_e2m1(torch.tensor([7.0, 1e9])).tolist() == [7, 7]  # saturates at 6


def test_packing_order():
    """Element 0 is the low nibble, element 1 the high nibble."""
    assert pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def adversarial_inputs():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randn(4, 64, generator=g)
    yield "zeros", torch.zeros(2, 32)
    outlier = torch.randn(2, 32, generator=g)
    outlier[0, 5] = 1e4
    yield "one huge outlier", outlier
    # With amax 6 x 0.5 = 3 and tensor scale 1, the scale is 0.5 exactly: x/scale hits every midpoint.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 0.5
    yield "halfway", torch.cat([mids, -mids]).view(1, 16)
    yield "subnormal-sized", torch.randn(2, 16, generator=g) * 1e-40
    yield "mixed magnitudes", torch.randn(8, 16, generator=g) * torch.logspace(-6, 6, 8).view(8, 1)


@pytest.mark.parametrize("name, x", list(adversarial_inputs()), ids=[n for n, _ in adversarial_inputs()])
def test_scales_and_codes_follow_the_rule(name, x):
    """Tensor scale, block scales and codes all equal what the NVFP4 rule gives, computed here by brute force."""
    for given in (None, 1.0):
        q = quantize(x, block=16, tensor_scale=given)
        tensor_scale = expected_tensor_scale(x, given)
        assert q.tensor_scale.item() == tensor_scale, name
        blocks = x.reshape(-1, 16).tolist()
        scales = [expected_block_scale(b, tensor_scale) for b in blocks]
        assert q.block_scales.float().flatten().tolist() == scales, name
        codes = [c for b, s in zip(blocks, scales) for c in brute_force_codes(b, s * tensor_scale)]
        assert q.codes().flatten().tolist() == codes, name
        assert torch.isfinite(q.dequantize()).all()


def test_a_small_block_keeps_a_nonzero_scale():
    """A block below E4M3's smallest scale gets that scale (2^-9), not 0: it reads back as values, not zeros."""
    x = torch.full((1, 16), 0.001)
    q = quantize(x, tensor_scale=1.0)  # 0.001 / 6 is far below 2^-9
    assert q.block_scales.float().item() == 2.0**-9
    assert q.dequantize().tolist() == [[2.0**-10] * 16]  # 0.001 / 2^-9 = 0.512 rounds to E2M1's 0.5
    assert quantize(torch.zeros(1, 16)).block_scales.float().item() == 0.0  # only zeros get a zero scale


def test_halfway_block_dequantizes_to_even_neighbours():
    """The halfway block round-trips to the even neighbours, times the scale 0.5."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 0.5
    q = quantize(mids.repeat(2).view(1, 16), tensor_scale=1.0)
    assert q.block_scales.float().item() == 0.5
    assert q.dequantize()[0, :8].tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0]


def test_nbytes_is_4_5_bits_per_value_plus_tensor_scale():
    """Codes n/2 bytes + one E4M3 byte per 16 values + 4 bytes of fp32 tensor scale."""
    x = torch.randn(3, 5, 64)
    q = quantize(x)
    assert q.nbytes == x.numel() * 4.5 / 8 + 4 == x.numel() // 2 + x.numel() // 16 + 4
    assert quantize_fp8(x).nbytes == x.numel() + 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_restores_shape_and_dtype(dtype):
    x = torch.randn(2, 3, 32).to(dtype)
    for q in (quantize(x), quantize_fp8(x)):
        out = dequantize(q)
        assert out.shape == x.shape and out.dtype == dtype


def test_block_scales_matter_on_outlier_channels():
    """One scale per 16 values beats one scale for the whole tensor on keys with outlier channels."""
    k = outlier_keys(64, 64)
    per_block = relative_error(k, quantize(k, 16).dequantize())
    per_tensor = relative_error(k, quantize(k.reshape(1, -1), block=k.numel()).dequantize().reshape(k.shape))
    assert per_block < 0.6 * per_tensor
    assert relative_error(k, quantize_fp8(k).dequantize()) < per_block


def test_huge_values_do_not_become_nan():
    """Clamping before the E4M3 cast: no NaN even where 448 x tensor scale is exceeded."""
    x = torch.tensor([[1e6, -5e5, 1.0, 2.0]])
    assert torch.isfinite(quantize_fp8(x, tensor_scale=1.0).dequantize()).all()
    assert quantize_fp8(x, tensor_scale=1.0).dequantize()[0, 0].item() == 448.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize(torch.randn(2, 20)), "divisible"),
        (lambda: quantize(torch.tensor([[float("nan")] * 16])), "finite"),
        (lambda: quantize(torch.tensor([[float("inf")] + [0.0] * 15])), "finite"),
        (lambda: quantize(torch.randn(2, 16), block=0), "block"),
        (lambda: quantize(torch.randn(2, 16), block=-4), "block"),
        (lambda: quantize(torch.randn(2, 3), block=1), "even"),
        (lambda: quantize(torch.randn(2, 16), tensor_scale=0.0), "tensor_scale"),
        (lambda: quantize_fp8(torch.tensor([float("nan")])), "finite"),
        (lambda: QuantizedCache("int3"), "fmt"),
        (lambda: QuantizedCache("nvfp4", residual=-1), "residual"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block": 0}, r"block must be (positive|an integer)"),
        ({"block": -16}, r"block must be (positive|an integer)"),
        ({"block": 2.5}, r"block must be (positive|an integer)"),
        ({"block": True}, r"block must be (positive|an integer)"),
        ({"fmt": "int3"}, r"fmt must be one of"),
        ({"fmt": "fp8", "block": 0}, r"block must be (positive|an integer)"),
        ({"k_scale": 0.0}, r"k_scale must be positive and finite"),
        ({"v_scale": float("nan")}, r"v_scale must be positive and finite"),
    ],
)
def test_quantized_cache_refuses_bad_arguments_when_built(kwargs, match):
    """Bad block sizes, formats and scales raise ValueError at construction, naming the argument and the rule."""
    with pytest.raises(ValueError, match=match):
        QuantizedCache(**kwargs)


# --- the quantized cache -------------------------------------------------------------------------

CHUNKINGS = {"whole": [24], "uneven": [7, 1, 12, 4], "decode": [8] + [1] * 16}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp4_tensor"])
@pytest.mark.parametrize("residual", [0, 5, 30])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_quantized_cache_holds_what_the_formula_predicts(fmt, residual, chunking, batch):
    """The bytes of every tensor the cache keeps (measured) equal memory.quantized_cache_bytes, and nbytes() says so."""
    model = small_model(q_heads=4, kv_heads=2, head_dim=16)
    cache = QuantizedCache(fmt, residual)
    feed_in_chunks(model, random_ids(batch, 24), CHUNKINGS[chunking], cache)
    predicted = quantized_cache_bytes(model.shape, 24, batch, fmt, residual, "fp32")
    assert measured_bytes(cache) == cache.nbytes() == predicted


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp4_tensor"])
def test_reading_returns_what_the_format_stores(fmt):
    """Keys and values read back (update's return, keys, values) are the inputs' round trip through the format."""
    k, v = torch.randn(2, 3, 5, 32), torch.randn(2, 3, 5, 32) * 3
    layer = QuantizedLayer(fmt)
    k_all, v_all = layer.update(k, v)
    # The default scales are calibrated from this first write, as fake_quantize calibrates from its input.
    assert torch.equal(k_all, fake_quantize(k, fmt)) and torch.equal(v_all, fake_quantize(v, fmt))
    fixed = QuantizedLayer(fmt, k_scale=0.01, v_scale=0.02)
    fixed.update(k, v)
    assert torch.equal(fixed.keys, fake_quantize(k, fmt, tensor_scale=0.01))
    assert torch.equal(fixed.values, fake_quantize(v, fmt, tensor_scale=0.02))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_quantized_cache_does_not_depend_on_chunking(fmt, layout):
    """With residual 0 and fixed scales each token's codes depend on that token only: chunked feeding equals one pass."""
    model = small_model(*HEAD_LAYOUTS[layout], head_dim=16)
    ids = random_ids(2, 24)
    scales = {"k_scale": 0.01, "v_scale": 0.01}
    with torch.inference_mode():
        whole = model(ids, cache=QuantizedCache(fmt, **scales))
    for sizes in CHUNKINGS.values():
        pieces = feed_in_chunks(model, ids, sizes, QuantizedCache(fmt, **scales))
        torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_default_scales_keep_small_values(fmt):
    """Keys of magnitude 0.001 survive the default cache about as well as quantize() alone (no flush to zero)."""
    k = torch.randn(1, 2, 8, 64) * 0.001
    layer = QuantizedCache(fmt).layer(0)
    layer.update(k, k)
    alone = relative_error(k, fake_quantize(k, fmt))
    assert alone < 0.12
    assert relative_error(k, layer.keys) == pytest.approx(alone)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp4_tensor"])
def test_values_beyond_the_calibrated_range_are_clipped(fmt):
    """After the first write calibrates the scale, a later, larger value reads back as the first write's largest."""
    k = torch.randn(1, 1, 4, 16)
    layer = QuantizedLayer(fmt)
    layer.update(k, k)
    layer.update(k[:, :, :1] * 4, k[:, :, :1] * 4)
    amax = k.abs().max().item()
    assert layer.keys[:, :, -1].abs().max().item() == pytest.approx(amax, rel=1e-6)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp4_tensor"])
@pytest.mark.parametrize("residual", [0, 4])
def test_reset_cache_behaves_as_a_new_one(fmt, residual):
    """After reset(), a second text gives bit for bit the logits and stored K/V of a fresh cache (no old calibration)."""
    model = small_model(head_dim=16)
    first, second = random_ids(2, 12, seed=1), random_ids(2, 10, seed=2)
    used, fresh = QuantizedCache(fmt, residual), QuantizedCache(fmt, residual)
    with torch.inference_mode():
        model(first, cache=used)
        used.reset()
        assert measured_bytes(used) == 0
        assert torch.equal(model(second, cache=used), model(second, cache=fresh))
    for a, b in zip(used.layers(), fresh.layers()):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("residual", [0, 4])
@pytest.mark.parametrize("bad", ["nan-in-v", "inf-in-k", "nan-in-v-first-write"])
def test_update_is_all_or_nothing(residual, bad):
    """A NaN or Inf in K or V is refused before either is stored: keys and values keep one length, no scale is set."""
    layer = QuantizedLayer("nvfp4", residual=residual)
    k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    if bad != "nan-in-v-first-write":
        layer.update(k, v)
    before = (layer.seq_len, layer.quantized_len, layer.keys, layer.values, measured_bytes(layer))
    new_k, new_v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    if bad == "inf-in-k":
        new_k[0, 1, 2, 5] = float("inf")
    else:
        new_v[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="k must be finite" if bad == "inf-in-k" else "v must be finite"):
        layer.update(new_k, new_v)
    after = (layer.seq_len, layer.quantized_len, layer.keys, layer.values, measured_bytes(layer))
    assert after[:2] == before[:2] and after[4] == before[4]
    for a, b in zip(after[2:4], before[2:4]):
        assert (a is None and b is None) or torch.equal(a, b)


def test_head_dim_that_blocks_cannot_split_is_refused_at_once():
    """A head_dim not divisible by block is refused at the first write, even when the tail would hold it for now."""
    layer = QuantizedLayer("nvfp4", residual=100)
    with pytest.raises(ValueError, match=r"divisible by block \(16\)"):
        layer.update(torch.randn(1, 1, 2, 24), torch.randn(1, 1, 2, 24))
    assert layer.seq_len == 0 and measured_bytes(layer) == 0


def test_failed_pass_with_a_short_tail_leaves_the_cache_as_it_was():
    """An exception in a middle layer, after that pass quantized tokens out of a short tail, changes nothing."""
    model = small_model(layers=4, head_dim=16)
    ids = random_ids(2, 16)
    cache, clean = QuantizedCache("nvfp4", residual=2), QuantizedCache("nvfp4", residual=2)
    with torch.inference_mode():
        model(ids[:, :9], cache=cache)
        model(ids[:, :9], cache=clean)
        assert [layer.quantized_len for layer in cache.layers()] == [7] * 4  # the next pass must quantize 3 more
        before = [(layer.seq_len, layer.quantized_len, layer.keys, layer.values) for layer in cache.layers()]
        held = measured_bytes(cache)

        def fail(*_):
            raise KeyboardInterrupt

        handle = model.blocks[2].register_forward_hook(fail)  # layers 0-2 have already written
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 9:12], cache=cache)
        handle.remove()
        assert cache.seq_len == 9 and measured_bytes(cache) == held
        for layer, (n, n_quantized, k, v) in zip(cache.layers(), before):
            assert (layer.seq_len, layer.quantized_len) == (n, n_quantized)
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        for size in (3, 1, 3):  # then the cache goes on exactly as one that never failed
            chunk = ids[:, cache.seq_len : cache.seq_len + size]
            assert torch.equal(model(chunk, cache=cache), model(chunk, cache=clean))


# Stated tolerance for the default tiny model: largest logit change against full precision
# (logits have a standard deviation of about 1 here).
TOLERANCE = {"fp8": 0.25, "nvfp4": 1.0}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quantized_cache_stays_within_tolerance_of_full_precision(fmt):
    """Cached-with-quantization vs uncached full precision: max logit difference within the stated bound."""
    from kvlessons.model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig()).eval()
    ids = random_ids(2, 64, vocab=96)
    with torch.inference_mode():
        diff = (model(ids, cache=QuantizedCache(fmt)) - model(ids)).abs().max().item()
    assert 0 < diff < TOLERANCE[fmt]


def test_fp4_generation_agreement_is_reported():
    """compare_generation reports free-running and teacher-forced agreement; FP8 agrees more than NVFP4."""
    from kvlessons.model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig()).eval()
    prompt = random_ids(1, 16, vocab=96)
    fp4 = compare_generation(model, prompt, 40, QuantizedCache("nvfp4"))
    fp8 = compare_generation(model, prompt, 40, QuantizedCache("fp8"))
    for r in (fp4, fp8):
        assert 0 <= r["free_running"] <= 1 and 0 < r["teacher_forced"] <= 1
    assert fp8["teacher_forced"] >= fp4["teacher_forced"] > 0.8
    assert fp8["max_logit_diff"] < fp4["max_logit_diff"]


def test_residual_keeps_recent_tokens_exact():
    """The newest `residual` tokens come back bit-exact; older ones quantized."""
    cache = QuantizedCache("nvfp4", residual=3)
    layer = cache.layer(0)
    k = torch.randn(1, 2, 10, 16)
    layer.update(k, k)
    assert torch.equal(layer.keys[:, :, -3:], k[:, :, -3:])
    assert not torch.equal(layer.keys[:, :, :7], k[:, :, :7])
    assert layer.quantized_len == 7


@pytest.mark.parametrize("length", [18, 10, 0])  # inside the tail, inside the quantized part, everything
def test_quantized_cache_crop_keeps_the_prefix(length):
    """crop keeps exactly the first tokens, in tensors of their own; crop(0) leaves a cache as new."""
    model = small_model(head_dim=16)
    ids = random_ids(1, 20)
    with torch.inference_mode():
        cache = QuantizedCache("nvfp4", residual=4)  # 16 tokens quantized, 4 in the tail
        model(ids, cache=cache)
        before = [(layer.keys, layer.values) for layer in cache.layers()]
        cache.crop(length)
    assert cache.seq_len == length
    for layer, (k, v) in zip(cache.layers(), before):
        if length:
            assert torch.equal(layer.keys, k[:, :, :length]) and torch.equal(layer.values, v[:, :, :length])
        else:
            assert layer.keys is None and layer.values is None
    if length <= 16:  # all quantized: nothing left pins the cropped tokens
        expected = quantized_cache_bytes(model.shape, length, 1, "nvfp4", 0) if length else 0
        assert measured_bytes(cache) == expected
    with pytest.raises(ValueError, match="window"):
        QuantizedCache().layer(0, window=4)


def test_attention_drift_and_rope_order_on_the_tiny_model():
    """Attention error is small and ordered FP8 < NVFP4; both RoPE orders are measured."""
    from kvlessons.model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig()).eval()
    q, k, v, k_raw = attention_inputs(model, random_ids(1, 48, vocab=96), layer=0)
    fp4, fp8 = attention_drift(q, k, v, "nvfp4"), attention_drift(q, k, v, "fp8")
    assert 0 < fp8["output_rel_error"] < fp4["output_rel_error"] < 0.3
    assert 0 <= fp4["weight_tv"] < 0.2
    order = rope_order_error(k_raw)
    assert set(order) == {"after_rope", "before_rope"} and all(0 < e < 0.3 for e in order.values())


def test_fp4_per_tensor_is_worse_than_block_scales():
    """One scale per tensor (fp4_tensor): 4 bits per value, and far more error on outlier keys than per-16 blocks."""
    from kvlessons.fp4 import quantize_fp4_tensor

    k = outlier_keys(64, 64)
    q = quantize_fp4_tensor(k)
    assert q.nbytes == k.numel() // 2 + 4
    assert relative_error(k, q.dequantize()) > 2 * relative_error(k, quantize(k).dequantize())
    with pytest.raises(ValueError, match="finite"):
        quantize_fp4_tensor(torch.tensor([float("nan"), 1.0]))


def test_passage_agreement_reports_top1_and_kl():
    from kvlessons.fp4 import passage_agreement
    from kvlessons.model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig()).eval()
    ids = random_ids(1, 40, vocab=96)
    full = passage_agreement(model, ids, 20, ConcatCache())
    assert full["top1"] == 1.0 and full["kl"] < 1e-6
    fp4 = passage_agreement(model, ids, 20, QuantizedCache("nvfp4"))
    assert 0 < fp4["kl"] and 0.5 < fp4["top1"] <= 1
    with pytest.raises(ValueError, match="prefill"):
        passage_agreement(model, ids, 40, ConcatCache())
