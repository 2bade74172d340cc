import pytest
import torch
import torch.nn.functional as F

from conftest import random_ids, small_model
from kvlessons.attention import causal_mask
from kvlessons.cache import ConcatCache
from kvlessons.gqa import convert_to_gqa, count_flops, distill, explicit_attention, output_drift, query_groups


def test_query_groups():
    """Query head h reads KV head h // group: consecutive query heads share a KV head."""
    assert query_groups(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert query_groups(4, 4) == [[0], [1], [2], [3]]
    assert query_groups(3, 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="multiple"):
        query_groups(6, 4)


@pytest.mark.parametrize("h_kv", [8, 4, 2, 1])
def test_explicit_attention_equals_sdpa_with_enable_gqa(h_kv):
    """Repeat-then-attend, grouped attend, and SDPA's enable_gqa all give the same output."""
    g = torch.Generator().manual_seed(h_kv)
    q = torch.randn(2, 8, 5, 16, generator=g)
    k, v = torch.randn(2, h_kv, 12, 16, generator=g), torch.randn(2, h_kv, 12, 16, generator=g)
    mask = causal_mask(5, 12)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(explicit_attention(q, k, v, mask), ref)
    torch.testing.assert_close(explicit_attention(q, k, v, mask, grouped=True), ref)


def test_attention_arithmetic_does_not_shrink():
    """Counted FLOPs are the same for MHA, GQA and MQA: the saving is in storage, not arithmetic."""
    q = torch.randn(1, 8, 4, 16)
    flops = {h: count_flops(explicit_attention, q, torch.randn(1, h, 32, 16), torch.randn(1, h, 32, 16)) for h in (8, 2, 1)}
    assert flops[8] == flops[2] == flops[1] == 2 * 2 * 8 * 4 * 32 * 16  # two matmuls, 2 FLOPs per MAC
    grouped = count_flops(explicit_attention, q, torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), grouped=True)
    assert grouped == flops[2]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_bytes_shrink_by_the_group_size(kv_heads):
    """Measured cache bytes fall by exactly q_heads / kv_heads against MHA."""
    ids = random_ids(2, 9)
    sizes = []
    for h in (4, kv_heads):
        cache = ConcatCache()
        with torch.inference_mode():
            small_model(q_heads=4, kv_heads=h)(ids, cache=cache)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] * (4 // kv_heads)


def test_mean_pooling_identical_heads_is_exact():
    """If every head in a group had the same K/V weights, mean pooling loses nothing: outputs unchanged."""
    mha = small_model(q_heads=4, kv_heads=4)
    with torch.no_grad():
        for block in mha.blocks:
            for name in ("k_proj", "v_proj"):
                w = getattr(block.attn, name).weight.view(4, 8, -1)
                w[1], w[3] = w[0].clone(), w[2].clone()  # heads (0,1) and (2,3) identical
    gqa = convert_to_gqa(mha, 2)
    ids = random_ids(1, 10)
    torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)
    assert gqa.config.kv_heads == 2


def test_conversion_keeps_other_weights_and_moves_outputs():
    """Queries, MLPs and embeddings are copied; the pooled model's outputs move but not wildly."""
    mha = small_model(q_heads=4, kv_heads=4)
    gqa = convert_to_gqa(mha, 1)
    assert torch.equal(gqa.blocks[0].attn.q_proj.weight, mha.blocks[0].attn.q_proj.weight)
    assert torch.equal(gqa.embed.weight, mha.embed.weight)
    drift = output_drift(mha, gqa, random_ids(2, 16))
    assert drift["kl"] > 0 and 0 <= drift["top1_agreement"] <= 1


def test_distillation_reduces_drift():
    """A short distillation from the MHA teacher lowers the converted model's KL."""
    mha = small_model(q_heads=4, kv_heads=4)
    gqa = convert_to_gqa(mha, 1)
    ids = random_ids(4, 16, seed=9)
    before = output_drift(mha, gqa, ids)["kl"]
    losses = distill(gqa, mha, steps=30, batch=4, seq_len=16)
    assert losses[-1] < losses[0]
    assert output_drift(mha, gqa, ids)["kl"] < before


@pytest.mark.parametrize("kv_heads, method, match", [(3, "mean", "divide"), (0, "mean", "kv_heads"), (2, "median", "method")])
def test_convert_rejects_bad_arguments(kv_heads, method, match):
    with pytest.raises(ValueError, match=match):
        convert_to_gqa(small_model(q_heads=4, kv_heads=4), kv_heads, method)


def test_first_and_random_conversions():
    mha = small_model(q_heads=4, kv_heads=4)
    first = convert_to_gqa(mha, 2, "first")
    w_old = mha.blocks[0].attn.k_proj.weight.view(4, 8, -1)
    assert torch.equal(first.blocks[0].attn.k_proj.weight.view(2, 8, -1), w_old[[0, 2]])
    rand = convert_to_gqa(mha, 2, "random")
    assert not torch.equal(rand.blocks[0].attn.k_proj.weight.view(2, 8, -1), w_old[[0, 2]])
