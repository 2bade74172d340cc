import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from kvlessons.attention import attend, causal_mask, repeat_kv


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


def test_attend_rejects_heads_that_do_not_divide():
    """Query heads not a multiple of KV heads is a ValueError, not a broadcast error."""
    with pytest.raises(ValueError, match="multiple"):
        attend(torch.randn(1, 3, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
