"""Latent attention (kvlessons.mla): the peer check against transformers' DeepSeek-V3, naive = absorbed,
bytes held = the latent formula, work counted = PyTorch's FLOP counter, bad configurations refused.

Cached = uncached for MLA (chunked appends into every kind of cache) runs in the shared
cache-variant suite: tests/conftest.py's CACHE_VARIANTS has the mla-* variants.
"""

import pytest
import torch

from conftest import MLA_SMALL, random_ids
from kvlessons.cache import ConcatCache, StaticCache, SlidingWindowLayer
from kvlessons.generate import generate
from kvlessons.memory import kv_cache_bytes, preset
from kvlessons.mla import (
    MLA_CONFIGS, MLAConfig, MLADecoder, attention_work, config_from_deepseek_v3, from_deepseek_v3, kv_rank_errors,
    attention_params, low_rank, low_rank_kv, measured_bytes_per_token, rank_sweep, tiny_deepseek_v3,
)
from kvlessons.model import TinyDecoder

transformers = pytest.importorskip("transformers")

# Two random DeepSeek-V3 shapes: one projection for the queries, and a low-rank query bottleneck.
PEER_CONFIGS = {
    "q_proj": dict(q_lora_rank=None, rope_interleave=True),
    "q_lora": dict(q_lora_rank=24, rope_interleave=True),
    "q_lora-half-split": dict(q_lora_rank=24, rope_interleave=False),
}


def deepseek_v3(q_lora_rank, rope_interleave, seed=0):
    """transformers' DeepseekV3ForCausalLM, small, dense, with order-1 random weights (the default init is nearly flat)."""
    return tiny_deepseek_v3(q_lora_rank=q_lora_rank, seed=seed, rope_interleave=rope_interleave)


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
@pytest.mark.parametrize("shape", sorted(PEER_CONFIGS))
def test_logits_and_tokens_equal_transformers(shape, decode):
    """Same random weights: kvlessons' MLA logits equal DeepseekV3ForCausalLM's, cached in chunks or not; greedy tokens too."""
    hf = deepseek_v3(**PEER_CONFIGS[shape])
    model = from_deepseek_v3(hf, decode=decode)
    ids = random_ids(2, 21, vocab=64, seed=1)
    with torch.inference_mode():
        reference = hf(ids).logits
        assert reference.std() > 0.5  # order-1 logits: an error cannot hide below the tolerance
        torch.testing.assert_close(model(ids), reference, atol=1e-4, rtol=1e-4)
        cache = StaticCache(21)
        chunks = [model(ids[:, a:b], cache=cache) for a, b in ((0, 8), (8, 9), (9, 15), (15, 21))]
        torch.testing.assert_close(torch.cat(chunks, dim=1), reference, atol=1e-4, rtol=1e-4)
        prompt = ids[:1, :6]
        hf_tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:]
    ours = generate(model, prompt, 12, cache=ConcatCache()).new_tokens[0]
    assert ours.tolist() == hf_tokens.tolist()


def test_loader_reorders_interleaved_rotary_rows():
    """With rope_interleave the loader must move the rotary rows: loading them unchanged gives other logits."""
    hf = deepseek_v3(q_lora_rank=None, rope_interleave=True)
    ids = random_ids(1, 12, vocab=64, seed=2)
    hf.config.rope_interleave = False  # read as half-split: the loader keeps the rows as they are
    wrong = from_deepseek_v3(hf)
    hf.config.rope_interleave = True
    with torch.inference_mode():
        assert not torch.allclose(wrong(ids), hf(ids).logits, atol=1e-2)


def test_transformers_caches_per_head_keys_and_values_we_cache_the_latent():
    """Bytes held after a prefill: transformers' cache = heads x (d_nope + d_r + d_v) per layer per token; ours = r + d_r."""
    hf = deepseek_v3(q_lora_rank=None, rope_interleave=True)
    model = from_deepseek_v3(hf)
    ids = random_ids(1, 30, vocab=64, seed=3)
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        ours = ConcatCache()
        model(ids, cache=ours)
    theirs = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
    layers, heads, tokens, fp32 = 2, 4, 30, 4
    assert theirs == layers * heads * (12 + 8 + 10) * tokens * fp32 == 28_800
    assert ours.nbytes() == layers * (16 + 8) * tokens * fp32 == 5_760


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_naive_equals_absorbed(q_lora_rank):
    """The two ways of reading the latents give the same logits, prefill and cached decode, on one model."""
    model = MLADecoder(MLAConfig(**{**MLA_SMALL, "q_heads": 4, "q_lora_rank": q_lora_rank, "seed": 3})).eval()
    ids = random_ids(2, 17, seed=4)
    runs = {}
    with torch.inference_mode():
        for mode in ("naive", "absorbed"):
            model.decode = mode
            cache = ConcatCache()
            runs[mode] = torch.cat([model(ids[:, :9], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(9, 17)], 1)
    assert runs["naive"].std() > 0.3
    torch.testing.assert_close(runs["absorbed"], runs["naive"], atol=1e-5, rtol=1e-5)


def test_both_ways_read_the_same_cache():
    """A cache written in one mode serves the other: the stored latents do not depend on how they are read."""
    model = MLADecoder(MLAConfig(**{**MLA_SMALL, "q_heads": 4})).eval()
    ids = random_ids(1, 12, seed=5)
    with torch.inference_mode():
        reference = model(ids)
        model.decode = "naive"
        cache = StaticCache(12)
        model(ids[:, :8], cache=cache)
        model.decode = "absorbed"
        torch.testing.assert_close(model(ids[:, 8:], cache=cache), reference[:, 8:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_cache", [lambda n: ConcatCache(), lambda n: StaticCache(n)], ids=["concat", "static"])
def test_bytes_held_equal_the_latent_formula(make_cache):
    """nbytes() of an MLA cache = layers x (r + d_r) x tokens x batch x 4 (fp32), and kvlessons.memory says the same."""
    config = MLAConfig(**{**MLA_SMALL, "layers": 3})
    model = MLADecoder(config).eval()
    cache = make_cache(19)
    with torch.inference_mode():
        model(random_ids(2, 19, seed=6), cache=cache)
    written_out = 3 * (12 + 4) * 19 * 2 * 4
    assert cache.nbytes() == written_out == kv_cache_bytes(config.shape, 19, batch=2, dtype="fp32")


def test_keys_only_layers_refuse_a_mixed_write():
    """A layer holding latents (keys only) refuses values, and one holding K and V refuses a keys-only write; nothing changes."""
    latent = ConcatCache().layer(0)
    latent.update(torch.ones(1, 1, 2, 8), None)
    with pytest.raises(ValueError, match="keys only"):
        latent.update(torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8))
    assert latent.seq_len == 2 and latent.values is None
    full = StaticCache(4).layer(0)
    full.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    with pytest.raises(ValueError, match="keys and values"):
        full.update(torch.ones(1, 2, 1, 8), None)
    assert full.seq_len == 1
    with pytest.raises(ValueError, match="sliding-window"):
        SlidingWindowLayer(4).update(torch.ones(1, 1, 1, 8), None)


def test_attention_work_matches_pytorchs_flop_counter():
    """The FLOPs attention_work counts for a decode step are what torch.utils.flop_counter counts, less the shared projections."""
    from torch.utils.flop_counter import FlopCounterMode

    config = MLAConfig(vocab_size=50, hidden_size=40, layers=1, q_heads=3, kv_lora_rank=10, qk_rope_head_dim=4,
                       qk_nope_head_dim=6, v_head_dim=5, mlp_hidden=30)
    model = MLADecoder(config).eval()
    ids = random_ids(2, 12, seed=7)
    batch, hidden, h, qk, latent, dv = 2, 40, 3, 10, 14, 5
    shared = 2 * batch * (hidden * h * qk + hidden * latent + h * dv * hidden)  # q_proj, kv_a_proj, o_proj
    for mode in ("naive", "absorbed"):
        model.decode = mode
        cache = ConcatCache()
        with torch.inference_mode():
            model(ids, cache=cache)
            with FlopCounterMode(display=False) as counter:
                model.blocks[0].attn(torch.randn(batch, 1, hidden), torch.ones(1, 4), torch.zeros(1, 4), cache.layer(0))
        counted = attention_work(config, new_tokens=1, cached=12, batch=batch, dtype="fp32")[mode].flops
        assert counter.get_total_flops() - shared == counted


def test_attention_work_rules_written_out():
    """DeepSeek-V3, one decode step after 4,095 cached tokens, one layer, bf16: each figure from the rule."""
    v3 = MLA_CONFIGS["DeepSeek-V3"]
    work = attention_work(v3, new_tokens=1, cached=4095)
    s, h = 4096, 128
    assert work["naive"].flops == 2 * s * 512 * h * 256 + 2 * h * s * 192 + 2 * h * s * 128
    assert work["absorbed"].flops == 2 * h * 128 * 512 + 2 * h * s * 576 + 2 * h * s * 512 + 2 * h * 512 * 128
    assert work["cache K/V"].flops == 2 * 512 * h * 256 + 2 * h * s * 192 + 2 * h * s * 128
    assert work["absorbed"].cache_bytes == work["naive"].cache_bytes == 4095 * 576 * 2
    assert work["cache K/V"].cache_bytes == 4095 * h * 320 * 2
    assert work["cache K/V"].cached_per_token / work["absorbed"].cached_per_token == pytest.approx(71.1, abs=0.05)
    prefill = attention_work(v3, new_tokens=1024)  # no cache: the naive way wins (fewer FLOPs per pair)
    assert prefill["naive"].flops < prefill["absorbed"].flops
    with pytest.raises(ValueError, match="new_tokens"):
        attention_work(v3, new_tokens=0)
    with pytest.raises(ValueError, match="cached"):
        attention_work(v3, new_tokens=1, cached=-1)


def test_presets_and_configs_agree():
    """The DeepSeek presets in kvlessons.memory and mla.MLA_CONFIGS state the same layers and latent width."""
    for name, config in MLA_CONFIGS.items():
        p = preset(name)
        assert (p.shape.layers, p.shape.latent_dim, p.shape.q_heads) == (config.layers, config.latent_dim, config.q_heads)
    assert kv_cache_bytes(preset("DeepSeek-V2").shape, 1, dtype="bf16") == 60 * 576 * 2 == 69_120
    assert kv_cache_bytes(preset("DeepSeek-V3").shape, 1, dtype="bf16") == 61 * 576 * 2 == 70_272


@pytest.mark.parametrize("bad, match", [
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be positive"),
    (dict(kv_lora_rank=-4), "kv_lora_rank must be positive"),
    (dict(q_lora_rank=0), "q_lora_rank must be positive"),
    (dict(v_head_dim=2.5), "v_head_dim must be an integer"),
    (dict(decode="fast"), "decode must be one of"),
])
def test_bad_configurations_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig(**{**MLA_SMALL, **bad})


def test_bad_decode_mode_and_unsupported_peers_raise():
    model = MLADecoder(MLAConfig(**MLA_SMALL))
    with pytest.raises(ValueError, match="decode must be one of"):
        model.decode = "fast"
    assert model.decode == "absorbed"
    base = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, first_k_dense_replace=2)
    for change, match in ((dict(first_k_dense_replace=1), "first_k_dense_replace"),
                          (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1}), "rope_scaling"),
                          (dict(attention_bias=True), "attention_bias")):
        with pytest.raises(ValueError, match=match):
            config_from_deepseek_v3(transformers.DeepseekV3Config(**{**base, **change}))


def test_low_rank_is_the_best_approximation():
    """Eckart-Young, written out: the rank-r error is the discarded singular values' share; full rank is exact."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(12, 20, generator=g, dtype=torch.float64)
    sigma = torch.linalg.svdvals(w)
    for r in (1, 5, 12):
        up, down = low_rank(w, r)
        assert up.shape == (12, r) and down.shape == (r, 20)
        share = float((sigma[r:] ** 2).sum().sqrt() / (sigma**2).sum().sqrt())
        assert float((w - up @ down).norm() / w.norm()) == pytest.approx(share, abs=1e-9)
    points = kv_rank_errors(w, torch.randn(30, 20, generator=g, dtype=torch.float64), [12, 6, 3])
    assert points[0].output_error < 1e-9
    assert points[0].output_error < points[1].output_error < points[2].output_error
    with pytest.raises(ValueError, match="rank must be <="):
        low_rank(w, 13)


def test_low_rank_kv_restores_the_model_even_after_an_interrupt():
    """low_rank_kv changes every layer's K/V weights inside the block only; a Ctrl-C inside leaves the model as before."""
    model = TinyDecoder().eval()
    ids = random_ids(1, 10, vocab=96, seed=9)
    with torch.inference_mode():
        before = model(ids)
        with low_rank_kv(model, 64):  # the joint K/V weight is 64 x 128: rank 64 is exact
            torch.testing.assert_close(model(ids), before, atol=1e-4, rtol=1e-4)
        with low_rank_kv(model, 4):
            assert not torch.allclose(model(ids), before, atol=1e-2)
        with pytest.raises(KeyboardInterrupt), low_rank_kv(model, 4):
            raise KeyboardInterrupt
        assert torch.equal(model(ids), before)


def test_rank_sweep_full_rank_changes_nothing_and_low_rank_does():
    model = TinyDecoder().eval()
    ids = random_ids(1, 16, vocab=96, seed=10)
    full, low = rank_sweep(model, ids, [64, 2])
    assert full == {"rank": 64, "kv_values": 64, "top1": 1.0, "kl": pytest.approx(0.0, abs=1e-6)}
    assert low["top1"] < 1.0 and low["kl"] > 1e-3


def test_attention_params_and_bytes_per_token_written_out():
    """Counted from the rule: MHA 2 layers x 4 matrices of 128 x 128; MLA q 128x256, kv_a 128x48, norm 32, kv_b 32x256, o 128x128."""
    from kvlessons.model import TinyConfig

    mha = TinyDecoder(TinyConfig(kv_heads=8)).eval()
    assert attention_params(mha) == 2 * 4 * 128 * 128
    assert measured_bytes_per_token(mha) == 2 * 2 * 8 * 16 * 4  # layers x K,V x heads x head_dim x fp32
    mla = MLADecoder().eval()
    assert attention_params(mla) == 2 * (128 * 256 + 128 * 48 + 32 + 32 * 256 + 128 * 128)
    assert measured_bytes_per_token(mla) == 2 * 48 * 4


def test_quantized_latent_cache_bytes_equal_the_formula():
    """An NVFP4 latent cache with a full-precision tail: one row of codes and block scales per token, one tensor scale per layer."""
    from kvlessons.fp4 import QuantizedCache
    from kvlessons.memory import quantized_cache_bytes

    config = MLAConfig(**MLA_SMALL)  # latent 12 + 4 = 16 values: one NVFP4 block per token per layer
    model = MLADecoder(config).eval()
    cache = QuantizedCache("nvfp4", residual=4)
    with torch.inference_mode():
        model(random_ids(1, 19, seed=11), cache=cache)
    # written out: 2 layers x (15 tokens x (8 B of codes + 1 B scale) + 4 tokens x 16 x 4 B + 4 B tensor scale)
    assert cache.nbytes() == 2 * (15 * 9 + 4 * 16 * 4 + 4) == quantized_cache_bytes(config.shape, 19, dtype="nvfp4", residual=4)
