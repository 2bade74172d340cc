"""What limits decode (lesson 08): the counts against the rule written out, the roofline, fused projections."""

import copy

import pytest
import torch

from conftest import random_ids, small_model
from kvlessons.memory import PRESETS, kv_cache_bytes
from kvlessons.model import TinyConfig, TinyDecoder, fuse_projections
from kvlessons.pretrained import SMOLLM2_CONFIG
from kvlessons.roofline import (
    ACCELERATORS, StepCost, attention_flops, cache_overtakes_weights, decode_step_cost, filled_cache, intensity_grid, limit,
    matmul_params, measure_ceilings, measure_decode_steps, predicted_seconds, ridge_point,
)
from kvlessons.shape import ModelShape

SMOL = SMOLLM2_CONFIG.shape  # 30 layers, 9 query heads, 3 KV heads, head_dim 64


def test_step_cost_of_smollm2_by_the_rule():
    """Written out: 2 FLOPs per weight per sequence; 4 x 9 heads x 64 per key per layer; 46,080 cache bytes a token in fp32."""
    params, batch, context = 134_479_872, 8, 100
    cost = decode_step_cost(SMOL, params, batch, context, "fp32")
    assert cost.matmul_flops == 2 * 134_479_872 * 8
    assert cost.attention_flops == 8 * 30 * 4 * 9 * 64 * 100
    assert cost.weight_bytes == 4 * 134_479_872  # read once, whatever the batch
    assert cost.cache_bytes == 8 * 100 * 2 * 30 * 3 * 64 * 4
    assert cost.flops == cost.matmul_flops + cost.attention_flops
    assert cost.bytes == cost.weight_bytes + cost.cache_bytes
    assert cost.intensity == pytest.approx(cost.flops / cost.bytes)
    # bf16 weights, fp8 cache: half the weight bytes, a quarter of the cache bytes
    mixed = decode_step_cost(SMOL, params, batch, context, "bf16", cache_dtype="fp8")
    assert (mixed.weight_bytes, mixed.cache_bytes) == (2 * 134_479_872, 8 * 100 * 2 * 30 * 3 * 64)


def test_batch_raises_intensity_but_the_cache_caps_it():
    """At batch 1 a step does about 1 FLOP per byte of bf16 weights; a batch raises that only while weights dominate."""
    params = 7_504_924_672  # Llama-3-8B's matrices
    shape = PRESETS["Llama-3-8B"].shape
    one = decode_step_cost(shape, params, 1, 16)
    assert one.intensity == pytest.approx(1.0, rel=0.01)  # 2 FLOPs per 2-byte weight
    short = [decode_step_cost(shape, params, b, 16).intensity for b in (1, 8, 64)]
    assert short[0] < short[1] < short[2] and short[2] > 50
    long = decode_step_cost(shape, params, 64, 32_768)
    # Attention over a GQA cache: 4 x 32 heads x 128 FLOPs per key against 2 x 8 KV heads x 128 x 2 bytes: 4 per byte
    assert long.attention_flops / long.cache_bytes == 4
    assert long.intensity < short[2] / 8  # the cache (18x the weights here) pulls the step back towards memory


def test_windows_and_shared_layers_in_the_attention_count():
    shape = ModelShape(layers=3, q_heads=4, kv_heads=2, head_dim=8, windows=(4, None, 2))
    assert attention_flops(shape, 10, batch=2) == 2 * 4 * 4 * 8 * (4 + 10 + 2)
    shared = ModelShape(layers=4, q_heads=4, kv_heads=2, head_dim=8, kv_owners=(0, 0, 2, 2))
    assert attention_flops(shared, 10) == 4 * 4 * 4 * 8 * 10  # every layer attends
    cost = decode_step_cost(shared, 1000, 1, 10, "fp32")
    assert cost.cache_bytes == 2 * 2 * 2 * 8 * 4 * 10  # only the two owners store


@pytest.mark.parametrize("kwargs, name", [
    ({"params": 0}, "params"), ({"batch": 0}, "batch"), ({"context": -1}, "context"), ({"weight_dtype": "fp7"}, "dtype"),
])
def test_step_cost_refuses_impossible_inputs(kwargs, name):
    args = {"params": 10, "batch": 1, "context": 1, **kwargs}
    with pytest.raises(ValueError, match=name):
        decode_step_cost(SMOL, **args)


def test_where_the_cache_overtakes_the_weights():
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2, fp32
    assert cache_overtakes_weights(SMOL, 10 * per_token, cache_dtype="fp32") == 11  # more than the weights: 11 tokens
    assert cache_overtakes_weights(SMOL, 10 * per_token + 1, cache_dtype="fp32") == 11
    assert cache_overtakes_weights(SMOL, 10 * per_token, batch=5, cache_dtype="fp32") == 3
    # Llama-3-8B in bf16: 128 KiB a token, 15.0 GB of matrices: past 114,496 tokens for one sequence
    llama = PRESETS["Llama-3-8B"]
    weight_bytes = 2 * llama.matmul_params()
    assert cache_overtakes_weights(llama.shape, weight_bytes) == weight_bytes // 131_072 + 1
    windowed = ModelShape(layers=2, q_heads=2, kv_heads=1, head_dim=8, windows=(16, 16))
    assert cache_overtakes_weights(windowed, 10**6, cache_dtype="fp32") is None  # never grows past 16 tokens
    with pytest.raises(ValueError, match="weight_bytes"):
        cache_overtakes_weights(SMOL, 0)


def test_roofline_takes_the_longer_of_reading_and_computing():
    cost = StepCost(matmul_flops=900, attention_flops=100, weight_bytes=60, cache_bytes=40)  # 10 FLOPs per byte
    assert ridge_point(10.0, 50.0) == 5.0
    assert predicted_seconds(cost, bandwidth=10.0, flops=50.0) == 20.0  # compute: 1000 / 50 > 100 / 10
    assert limit(cost, 10.0, 50.0) == "compute"
    assert predicted_seconds(cost, bandwidth=10.0, flops=1000.0) == 10.0  # memory: 100 / 10
    assert limit(cost, 10.0, 1000.0) == "memory"
    with pytest.raises(ValueError, match="positive"):
        predicted_seconds(cost, 0.0, 1.0)


def test_published_figures_give_the_known_ridge_points():
    """H100 SXM: 989 dense bf16 TFLOP/s over 3.35 TB/s is about 295 FLOPs per byte."""
    h100 = next(a for a in ACCELERATORS if a.name == "H100 SXM")
    assert ridge_point(h100.bandwidth, h100.bf16_flops) == pytest.approx(295, abs=1)
    for a in ACCELERATORS:
        assert a.bandwidth > 1e11 and a.bf16_flops > 1e13 and a.source


def test_matmul_params_counts_each_matrix_once():
    c = TinyConfig()
    per_layer = c.hidden_size * (c.q_heads + 2 * c.kv_heads) * c.head_dim + c.q_heads * c.head_dim * c.hidden_size
    per_layer += 3 * c.hidden_size * c.mlp_hidden
    model = TinyDecoder(c)
    assert matmul_params(model) == c.layers * per_layer + c.vocab_size * c.hidden_size  # the head; not the lookup
    model.lm_head.weight = model.embed.weight  # tied, as SmolLM2: still one matrix
    assert matmul_params(model) == c.layers * per_layer + c.vocab_size * c.hidden_size
    assert matmul_params(fuse_projections(model)) == c.layers * per_layer + c.vocab_size * c.hidden_size


def test_preset_matmul_params():
    assert PRESETS["Llama-3-8B"].matmul_params() == 8_030_261_248 - 128_256 * 4_096  # the input embedding is looked up
    assert PRESETS["SmolLM2-135M"].matmul_params() == 134_515_008  # tied: the head reads the embedding
    with pytest.raises(ValueError, match="experts"):
        PRESETS["DeepSeek-V3"].matmul_params()


@pytest.mark.parametrize("overrides", [{}, {"layers": 4, "kv_owners": (0, 0, 2, 2)}, {"layers": 3, "windows": (4, None, 3)}])
def test_fused_projections_give_the_same_logits(overrides):
    """Prefill, then a 3-token append to the non-empty cache: the fused model agrees with the unfused one."""
    from kvlessons.cache import StaticCache

    plain = small_model(**overrides)
    fused = fuse_projections(copy.deepcopy(plain))
    assert not hasattr(fused.blocks[0].attn, "q_proj") and fused.blocks[0].attn.qkv_proj is not None
    ids = random_ids(2, 9)
    caches = StaticCache(9), StaticCache(9)
    for part in (ids[:, :6], ids[:, 6:]):
        expected, got = (m(part, cache=c) for m, c in zip((plain, fused), caches))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(*(c.layers() for c in caches)):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_fused_yoco_model_agrees():
    from kvlessons.crosslayer import YOCODecoder

    plain = YOCODecoder(TinyConfig(layers=4, q_heads=4, kv_heads=2, seed=0), window=3).eval()
    fused = fuse_projections(copy.deepcopy(plain))
    ids = random_ids(1, 7)
    torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=1e-5)


def test_filled_cache_holds_what_the_formula_says():
    model = small_model(layers=3, windows=(4, None, 3))
    cache = filled_cache(model, batch=2, context=10, room=2)
    assert cache.seq_len == 10
    assert cache.nbytes() == kv_cache_bytes(model.shape, 12, 2, "fp32")  # preallocated for 12
    logits = model(random_ids(2, 1), cache=cache)  # a decode step runs on it
    assert logits.shape == (2, 1, model.config.vocab_size) and cache.seq_len == 11


def test_measured_decode_points_are_counted_and_leave_their_caches_alone():
    model = small_model()
    points = measure_decode_steps({"fp32": model}, batches=(1, 2), contexts=(4, 8), repeats=2)
    assert [(p.dtype, p.batch, p.context) for p in points] == [("fp32", b, c) for b in (1, 2) for c in (4, 8)]
    for p in points:
        assert p.cost == decode_step_cost(model.shape, matmul_params(model), p.batch, p.context, "fp32")
        assert len(p.seconds.values) == 2 and all(s > 0 for s in p.seconds.values)
    with pytest.raises(ValueError, match="contexts"):
        measure_decode_steps({"fp32": model}, contexts=(1,))
    with pytest.raises(ValueError, match="dtype"):
        measure_decode_steps({"fp64": model}, contexts=(4,))


def test_measured_ceilings_have_the_asked_shape():
    c = measure_ceilings(dtypes=("fp32",), read_bytes=2**20, matmul_size=64, repeats=3, device="cpu")
    assert len(c.bandwidth.values) == 3 and set(c.flops) == {"fp32"}
    low, high = c.flops["fp32"].spread
    assert low <= c.flops["fp32"].median <= high
    assert c.ridge("fp32") == c.flops["fp32"].median / c.bandwidth.median
    with pytest.raises(ValueError, match="dtype"):
        measure_ceilings(dtypes=("int3",), read_bytes=2**20, matmul_size=8, repeats=1, device="cpu")


def test_generate_comparison_says_the_ratio_and_the_roofline_fraction():
    from kvlessons.bench import format_generate_comparison

    result = {"seconds": {"kvlessons generate": [0.020, 0.021, 0.019], "transformers generate": [0.030, 0.031, 0.029]},
              "same_tokens": True, "step_bytes": 400 * 2**20, "step_seconds": [0.04, 0.04, 0.04], "prompt_len": 9}
    text = format_generate_comparison(result, bandwidth=20e9)
    assert "kvlessons generate is faster than transformers generate by 1.50x" in text
    # 400 MiB at 20 GB/s is 20.97 ms; a 40 ms step runs at 52% of that roofline
    assert "21.0 ms to read its 400 MiB" in text and "at 52% of that roofline" in text
    assert "both sides wrote the same tokens" in text
    result["same_tokens"] = False
    assert "warning" in format_generate_comparison(result, bandwidth=20e9)


def test_roofline_figures_draw_every_measured_point():
    import matplotlib

    matplotlib.use("Agg")
    from kvlessons import plots

    model = small_model()
    points = measure_decode_steps({"fp32": model}, batches=(1, 2), contexts=(4, 8), repeats=1)
    ceilings = measure_ceilings(dtypes=("fp32",), read_bytes=2**20, matmul_size=64, repeats=1, device="cpu")
    fig = plots.plot_roofline(ceilings, points, title="t")
    ax = fig.axes[0]
    assert len(ax.containers) == len(points)  # one error bar per measured step
    fig = plots.plot_intensity(intensity_grid(SMOL, 1000, [1, 2, 4], (16, 64)), [1, 2, 4], {"ridge": 5.0})
    assert len(fig.axes[0].lines) == 3  # two contexts and the ridge line


def test_dtype_comparison_pairs_each_setting_by_round():
    from kvlessons.roofline import DecodePoint, Measured, dtype_comparison

    cost = StepCost(1, 1, 1, 1)
    points = [DecodePoint("fp32", 1, 16, cost, Measured((0.030, 0.031, 0.029))),
              DecodePoint("bf16", 1, 16, cost, Measured((0.015, 0.0155, 0.0145))),
              DecodePoint("fp32", 4, 16, cost, Measured((0.030, 0.031, 0.029))),
              DecodePoint("bf16", 4, 16, cost, Measured((0.031, 0.029, 0.030)))]
    first, second = dtype_comparison(points)
    assert first.startswith("batch 1, context 16: bf16 is faster than fp32 by 2.00x")
    assert second.startswith("batch 4, context 16: bf16 vs fp32: no difference within noise")


@pytest.mark.parametrize("kwargs, name", [
    ({"matmul_size": 0}, "matmul_size"), ({"read_bytes": 3}, "read_bytes"), ({"read_bytes": -1}, "read_bytes"),
    ({"dtypes": ()}, "dtypes"),
])
def test_measured_ceilings_refuse_impossible_sizes(kwargs, name):
    args = {"dtypes": ("fp32",), "read_bytes": 2**20, "matmul_size": 8, "repeats": 1, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=name):
        measure_ceilings(**args)


def test_decode_steps_refuse_empty_settings():
    with pytest.raises(ValueError, match="at least one"):
        measure_decode_steps({"fp32": small_model()}, batches=(), contexts=(4,))
