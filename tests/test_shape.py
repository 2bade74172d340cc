import pytest

from kvlessons import ModelShape


def test_valid_shapes_and_defaults():
    """A valid shape keeps its fields; hidden_size defaults to q_heads * head_dim."""
    s = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)
    assert s.hidden_size == 4096
    assert s.group_size == 4
    assert s.window(0) is None
    g = ModelShape(layers=2, q_heads=16, kv_heads=8, head_dim=256, hidden_size=3584, windows=(4096, None))
    assert g.window(0) == 4096 and g.window(1) is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(layers=0, q_heads=4, kv_heads=2, head_dim=8), "layers"),
        (dict(layers=-1, q_heads=4, kv_heads=2, head_dim=8), "layers"),
        (dict(layers=2, q_heads=0, kv_heads=2, head_dim=8), "q_heads"),
        (dict(layers=2, q_heads=4, kv_heads=0, head_dim=8), "kv_heads"),
        (dict(layers=2, q_heads=4, kv_heads=-2, head_dim=8), "kv_heads"),
        (dict(layers=2, q_heads=4, kv_heads=2, head_dim=0), "head_dim"),
        (dict(layers=2, q_heads=6, kv_heads=4, head_dim=8), "multiple of kv_heads"),
        (dict(layers=2, q_heads=2, kv_heads=4, head_dim=8), "multiple of kv_heads"),
        (dict(layers=2.0, q_heads=4, kv_heads=2, head_dim=8), "layers"),
        (dict(layers=2, q_heads=True, kv_heads=1, head_dim=8), "q_heads"),
        (dict(layers=2, q_heads=4, kv_heads=2, head_dim=8, hidden_size=0), "hidden_size"),
        (dict(layers=2, q_heads=4, kv_heads=2, head_dim=8, windows=(16,)), "one entry per layer"),
        (dict(layers=2, q_heads=4, kv_heads=2, head_dim=8, windows=(16, 0)), "windows[1]"),
    ],
)
def test_invalid_shape_raises_naming_the_field(kwargs, field):
    """Every impossible shape raises ValueError, and the message names the field or rule."""
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelShape(**kwargs)


def test_window_index_is_checked():
    """Asking for a layer outside the model is an error, not a silent None."""
    with pytest.raises(ValueError, match="layer"):
        ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8).window(2)


def test_str_names_only_what_is_set():
    """str() leaves out empty windows/sharing/latent, so printed shapes stay short and stable."""
    plain = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8)
    assert str(plain) == "ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, hidden_size=32)"
    windowed = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, windows=(4, None), latent_dim=16)
    assert str(windowed).endswith("windows=(4, None), latent_dim=16)")
