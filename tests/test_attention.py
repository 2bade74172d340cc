import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from kvlessons.attention import attend, causal_mask, padded_causal_mask, reference_attention, repeat_kv

LAYOUTS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # (query heads, KV heads)


def random_qkv(h_q, h_kv, q_len, kv_len, batch=2, head_dim=8, seed=0):
    """Seeded q (B, H_q, T, D) and k, v (B, H_kv, S, D)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, h_q, q_len, head_dim, generator=g)
    k, v = (torch.randn(batch, h_kv, kv_len, head_dim, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (1, 9), (3, 3), (3, 7), (5, 12), (8, 8), (2, 33), (16, 17)])
def test_causal_mask_matches_pytorch_lower_right(q_len, kv_len):
    """causal_mask equals PyTorch's bottom-right causal bias, materialised."""
    expected = causal_lower_right(q_len, kv_len)._materialize(torch.device("cpu"))
    assert torch.equal(causal_mask(q_len, kv_len), expected)


def test_causal_mask_sweep():
    """Over every shape up to 12 x 12, the newest query sees all keys and query i sees kv_len - q_len + i + 1."""
    for kv_len in range(1, 13):
        for q_len in range(1, kv_len + 1):
            m = causal_mask(q_len, kv_len)
            assert m.dtype == torch.bool and m.shape == (q_len, kv_len)
            assert m.sum(1).tolist() == [kv_len - q_len + i + 1 for i in range(q_len)]
            assert torch.equal(m, causal_lower_right(q_len, kv_len)._materialize(torch.device("cpu")))


def test_window_limits_how_far_back():
    """With a window W, a query sees at most W keys: itself and W - 1 before it."""
    m = causal_mask(4, 10, window=3)
    assert m.sum(1).tolist() == [3, 3, 3, 3]
    assert m[0].nonzero().flatten().tolist() == [4, 5, 6]


@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (1, 9), (3, 7), (8, 8), (16, 17)])
def test_top_left_mask_matches_pytorch_is_causal(q_len, kv_len):
    """align="top_left" equals PyTorch's is_causal=True mask, and equals the bottom-right one only without a cache."""
    top_left = causal_mask(q_len, kv_len, align="top_left")
    assert torch.equal(top_left, causal_upper_left(q_len, kv_len)._materialize(torch.device("cpu")))
    assert torch.equal(top_left, causal_mask(q_len, kv_len)) == (q_len == kv_len)


def test_causal_mask_rejects_an_unknown_alignment():
    """An alignment other than bottom_right or top_left is a ValueError naming the choices."""
    with pytest.raises(ValueError, match="bottom_right"):
        causal_mask(2, 4, align="bottom-right")


@pytest.mark.parametrize("q_len, kv_len, name", [(0, 4, "q_len"), (2, 0, "kv_len"), (-1, 4, "q_len"), (5, 4, "q_len must be <= kv_len")])
def test_causal_mask_rejects_bad_lengths(q_len, kv_len, name):
    """Impossible lengths raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=name):
        causal_mask(q_len, kv_len)


@pytest.mark.parametrize("h_q, h_kv", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_attend_gqa_equals_explicit_repeat(h_q, h_kv):
    """attend with fewer KV heads equals plain attention over K/V heads repeated per group."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, h_q, 5, 8, generator=g)
    k = torch.randn(2, h_kv, 9, 8, generator=g)
    v = torch.randn(2, h_kv, 9, 8, generator=g)
    out = attend(q, k, v)
    reps = h_q // h_kv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, reps), repeat_kv(v, reps), attn_mask=causal_mask(5, 9)
    )
    torch.testing.assert_close(out, ref)


def test_attend_matches_a_written_out_softmax():
    """attend computes softmax(q k^T / sqrt(d) + mask) v, with the bottom-right mask."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g) for n in (3, 6, 6))
    scores = q @ k.transpose(-1, -2) / 2.0
    scores = scores.masked_fill(~causal_mask(3, 6), float("-inf"))
    torch.testing.assert_close(attend(q, k, v), scores.softmax(-1) @ v)


def test_repeat_kv_order():
    """repeat_kv puts each KV head's copies next to each other (query heads 0..g-1 read KV head 0)."""
    x = torch.arange(2.0).view(1, 2, 1, 1)
    assert repeat_kv(x, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("attention", [attend, reference_attention])
def test_attention_rejects_heads_that_do_not_divide(attention):
    """Query heads not a multiple of KV heads is a ValueError, not a broadcast error."""
    with pytest.raises(ValueError, match="multiple"):
        attention(torch.randn(1, 3, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))


# --- the written-out reference against the attention the model runs ----------------------------

@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_attention_equals_attend(layout, q_len, window):
    """The written-out reference and SDPA give the same output: MHA/GQA/MQA, decode and append, with and without a window."""
    q, k, v = random_qkv(*LAYOUTS[layout], q_len, 9)
    torch.testing.assert_close(reference_attention(q, k, v, window=window), attend(q, k, v, window=window))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_attention_equals_attend_with_padding(layout):
    """With a left-padded batch's mask (B, 1, T, S), reference and SDPA agree, windowed or not."""
    q, k, v = random_qkv(*LAYOUTS[layout], 4, 10, seed=1)
    pad_mask = torch.ones(2, 10, dtype=torch.bool)
    pad_mask[1, :3] = False  # row 1 has three pads on the left
    mask = padded_causal_mask(pad_mask, 4)
    torch.testing.assert_close(reference_attention(q, k, v, mask), attend(q, k, v, mask))
    torch.testing.assert_close(reference_attention(q, k, v, mask, window=2), attend(q, k, v, mask, window=2))


def test_reference_attention_equals_attend_with_a_mask_per_query_head():
    """A mask with one slice per query head (B, H_q, T, S) reaches the right heads in the grouped layout."""
    q, k, v = random_qkv(4, 2, 3, 8, seed=2)
    mask = torch.rand(2, 4, 3, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[..., -1] = True  # every query sees at least one key
    torch.testing.assert_close(reference_attention(q, k, v, mask), attend(q, k, v, mask))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_attention_weights(layout):
    """The weights (B, H_q, T, S) sum to 1 per query, are 0 on hidden keys, and weight the values into the output."""
    h_q, h_kv = LAYOUTS[layout]
    q, k, v = random_qkv(h_q, h_kv, 5, 9, seed=3)
    out, weights = reference_attention(q, k, v, window=4, return_weights=True)
    assert weights.shape == (2, h_q, 5, 9)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, h_q, 5))
    hidden = ~causal_mask(5, 9, window=4)
    assert (weights[..., hidden] == 0).all() and (weights[..., ~hidden] > 0).all()
    torch.testing.assert_close(out, weights @ repeat_kv(v, h_q // h_kv))


def test_reference_attention_rejects_a_float_mask():
    """An additive float mask is refused with a ValueError: masks here are bool, True = may attend."""
    q, k, v = random_qkv(2, 2, 2, 4)
    with pytest.raises(ValueError, match="bool"):
        reference_attention(q, k, v, torch.zeros(2, 4))
