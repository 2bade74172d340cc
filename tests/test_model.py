import pytest
import torch

from conftest import random_ids, small_model
from kvlessons.model import CharTokenizer, TinyConfig, TinyDecoder
from kvlessons.rope import apply_rope, rope_tables


def test_weights_depend_only_on_the_seed():
    """Two models with the same seed are identical, whatever the global RNG did in between."""
    a = TinyDecoder(TinyConfig(seed=5))
    torch.manual_seed(123)
    torch.rand(100)
    b = TinyDecoder(TinyConfig(seed=5))
    c = TinyDecoder(TinyConfig(seed=6))
    for (_, pa), (_, pb), (name, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_building_a_model_leaves_the_global_rng_alone():
    """Model construction uses a private generator, so notebook seeds stay meaningful."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    TinyDecoder()
    assert torch.equal(torch.rand(3), expected)


def test_logits_shape(dev):
    """forward returns (B, T, vocab)."""
    model = small_model(dev=dev)
    assert model(random_ids(3, 7, dev=dev)).shape == (3, 7, 50)


def test_forward_rejects_bad_ids():
    """ids must be 2-D and non-empty."""
    model = small_model()
    with pytest.raises(ValueError, match="batch, tokens"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one"):
        model(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(q_heads=6, kv_heads=4), "multiple of kv_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(head_dim=7), "head_dim"),
        (dict(layers=-1), "layers"),
        (dict(mlp_hidden=0), "mlp_hidden"),
    ],
)
def test_config_validates(kwargs, name):
    """An impossible TinyConfig raises ValueError naming the field."""
    with pytest.raises(ValueError, match=name):
        TinyConfig(**kwargs)


def test_rope_scores_depend_only_on_relative_position():
    """After RoPE, q.k for positions (m, n) equals q.k at (m + s, n + s): attention sees distances."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(m, n):
        cq, sq = rope_tables(torch.tensor([m]), 16)
        ck, sk = rope_tables(torch.tensor([n]), 16)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_rope_at_position_zero_is_identity():
    """Position 0 rotates by angle 0."""
    x = torch.randn(2, 3, 1, 8)
    cos, sin = rope_tables(torch.tensor([0]), 8)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


def test_tokenizer_round_trip():
    """Printable text survives encode/decode; unknown characters become '?'."""
    tok = CharTokenizer()
    assert tok.vocab_size == TinyConfig().vocab_size
    text = "The cat sat on\nthe mat!"
    assert tok.decode(tok.encode(text)[0]) == text
    assert tok.decode(tok.encode("café")[0]) == "caf?"
    assert tok.token_str(tok.encode(" ")[0, 0].item()) == "\u2423"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_projection_equals_the_matrix_product(dtype):
    """A decode step of one sequence goes through torch.mv; it must give x @ W.T, as every other shape does."""
    from kvlessons.model import Linear

    g = torch.Generator().manual_seed(0)
    layer = Linear(6, 5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(5, 6, generator=g))
    layer = layer.to(dtype)
    for shape in [(1, 1, 6), (1, 6), (2, 3, 6)]:
        x = torch.randn(shape, generator=g).to(dtype)
        expected = (x.double() @ layer.weight.double().T).to(dtype)
        got = layer(x)
        assert got.shape == (*shape[:-1], 5)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
