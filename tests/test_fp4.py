import math

import pytest
import torch

from conftest import HEAD_LAYOUTS, random_ids, small_model
from kvlessons.cache import ConcatCache
from kvlessons.fp4 import (
    E2M1_VALUES,
    QuantizedCache,
    attention_drift,
    code_bits,
    compare_generation,
    decode_e2m1,
    dequantize,
    e2m1_value,
    encode_e2m1,
    outlier_keys,
    pack_nibbles,
    quantize,
    quantize_fp8,
    relative_error,
    rope_order_error,
    unpack_nibbles,
)
from kvlessons.memory import quantized_cache_bytes
from kvlessons.model import attention_inputs

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def brute_force_codes(x: torch.Tensor, q) -> torch.Tensor:
    """Nearest representable value for each element given its block's stored scale, ties to the even code."""
    eff = q.effective_scales()  # (..., n_blocks) float64
    xs = x.to(torch.float64).reshape(*x.shape[:-1], -1, q.block)
    cand = GRID.view(1, -1) * eff.reshape(-1, 1)  # (n_blocks_total, 8)
    flat = xs.reshape(-1, q.block)
    codes = []
    for row, c in zip(flat, cand):
        for value in row.tolist():
            dist = [abs(abs(value) - ci) for ci in c.tolist()]
            best = min(dist)
            ties = [i for i, d in enumerate(dist) if d == best]
            idx = next((i for i in ties if i % 2 == 0), ties[0]) if len(ties) > 1 else ties[0]
            codes.append(idx | (8 if math.copysign(1.0, value) < 0 else 0))
    return torch.tensor(codes, dtype=torch.uint8).reshape(x.shape)


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
def test_every_value_is_the_nearest_for_its_block_scale(name, x):
    """Codes equal a brute-force nearest search over the block's representable values, ties to even."""
    for tensor_scale in (None, 1.0):
        q = quantize(x, block=16, tensor_scale=tensor_scale)
        assert torch.equal(q.codes(), brute_force_codes(x, q)), name
        assert torch.isfinite(q.dequantize()).all()
        assert (q.block_scales.float() <= 448).all()


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


# --- the quantized cache -------------------------------------------------------------------------

CHUNKINGS = {"whole": [24], "uneven": [7, 1, 12, 4], "decode": [8] + [1] * 16}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp4_tensor"])
@pytest.mark.parametrize("residual", [0, 5])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_quantized_cache_bytes_equal_prediction(fmt, residual, chunking):
    """nbytes equals memory.quantized_cache_bytes for every format, residual and chunking."""
    model = small_model(q_heads=4, kv_heads=2, head_dim=16)
    ids = random_ids(2, 24)
    cache, start = QuantizedCache(fmt, residual), 0
    with torch.inference_mode():
        for size in CHUNKINGS[chunking]:
            model(ids[:, start : start + size], cache=cache)
            start += size
    assert cache.nbytes() == quantized_cache_bytes(model.shape, 24, 2, fmt, residual, "fp32")


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_quantized_cache_does_not_depend_on_chunking(fmt, layout):
    """With residual 0 every key is stored and read quantized: chunked feeding equals one pass."""
    model = small_model(*HEAD_LAYOUTS[layout], head_dim=16)
    ids = random_ids(2, 24)
    with torch.inference_mode():
        whole = model(ids, cache=QuantizedCache(fmt))
        for name, sizes in CHUNKINGS.items():
            cache, pieces, start = QuantizedCache(fmt), [], 0
            for size in sizes:
                pieces.append(model(ids[:, start : start + size], cache=cache))
                start += size
            torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


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


def test_quantized_cache_crop_and_reset():
    model = small_model(head_dim=16)
    ids = random_ids(1, 20)
    with torch.inference_mode():
        cache = QuantizedCache("nvfp4", residual=4)
        model(ids, cache=cache)
        cache.crop(10)
        assert cache.seq_len == 10 and cache.layer(0).keys.shape[2] == 10
        cache.reset()
        assert cache.nbytes() == 0 and cache.seq_len == 0
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
