"""Caches shared across layers (lesson 04): cross-layer attention (CLA) and a YOCO-style decoder-decoder.

CLA (Brandon et al. 2024, arXiv 2405.12981): in each group of ``factor`` adjacent layers
only the first projects and caches K/V; the others attend to that cache with their own
queries. In kvlessons it is a TinyConfig with ``kv_owners``: the forward pass and the
cache interface are unchanged, and only owners create cache layers.

YOCO (Sun et al. 2024, arXiv 2405.05254): the lower half is a self-decoder whose layers
use sliding-window attention (their caches stop growing at the window); the lower
half's output is projected once into one global K/V, cached once, that every upper
layer cross-attends to. During prefill the upper half only has to run for the last
prompt token, because no upper layer keeps a cache of its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from .model import TinyConfig, TinyDecoder
from .shape import ModelShape, cross_layer_owners, require_positive_int


def cla_config(config: TinyConfig, factor: int) -> TinyConfig:
    """``config`` with cross-layer attention: groups of ``factor`` adjacent layers share one cache."""
    require_positive_int("factor", factor)
    return replace(config, kv_owners=cross_layer_owners(config.layers, factor))


def yoco_shape(layers: int, q_heads: int, kv_heads: int, head_dim: int, window: int, hidden_size: int | None = None) -> ModelShape:
    """The cache shape of a YOCO decoder: windowed lower half, one global cache for the upper half.

    Layer ``layers // 2`` is taken as the owner of the global cache, and every upper
    layer reads it; kvlessons.memory then counts the lower layers up to their window
    and the global cache once.
    """
    require_positive_int("layers", layers)
    require_positive_int("window", window)
    if layers % 2 or layers < 2:
        raise ValueError(f"layers must be even (a lower and an upper half), got {layers}")
    half = layers // 2
    return ModelShape(
        layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden_size,
        windows=(window,) * half + (None,) * half,
        kv_owners=tuple(range(half)) + (half,) * half,
    )


def yoco_config(config: TinyConfig, window: int) -> TinyConfig:
    """``config`` as a YOCO decoder-decoder: windowed lower half, one global K/V for the upper half.

    Nothing here is a second forward pass: the windows and ``kv_owners`` come from
    :func:`yoco_shape`, and ``global_kv_layer`` marks the first upper layer, whose K/V
    (projected from the self-decoder's output through a norm of their own) every upper
    layer reads, and after which a prefill carries only the last position.
    """
    shape = yoco_shape(config.layers, config.q_heads, config.kv_heads, config.head_dim, window, config.hidden_size)
    return replace(config, windows=shape.windows, kv_owners=shape.kv_owners, global_kv_layer=config.layers // 2)


class YOCODecoder(TinyDecoder):
    """A TinyDecoder with :func:`yoco_config`: ``layers // 2`` sliding-window self-decoder layers, then
    cross-decoder layers that read one global K/V, cached once, in ``cache.layer(layers // 2)``."""

    def __init__(self, config: TinyConfig | None = None, window: int = 8):
        require_positive_int("window", window)
        self.window = window
        super().__init__(yoco_config(config or TinyConfig(), window))


@contextmanager
def count_layer_tokens(model):
    """Count, per block, the token-positions it processes: ``with count_layer_tokens(m) as counts: ...``."""
    counts = [0] * len(model.blocks)
    handles = []
    for i, block in enumerate(model.blocks):
        def hook(_module, args, i=i):
            x = args[0]  # (B, T, hidden): the positions this block carries on (YOCO's prefill: 1 in the upper half)
            counts[i] += x.shape[0] * x.shape[1]
        handles.append(block.mlp.register_forward_pre_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


# DeepSeek-V4.1-Flash as the source text relays its technical report. These are the report's
# figures; none can be checked here (no weights, no config, no per-layer pattern is given).
DEEPSEEK_V41_FLASH = {
    "layers": 40,
    "split": (20, 20),  # causal encoder / decoder halves, after YOCO
    "global_kv_from_layer": 20,  # decoder layers project their global K/V from the hidden state at layer 20
    "layer_kinds": {
        "Full": "computes its own compressed K/V, sparse-attention indexer keys and top-k selection",
        "Reindex": "reuses a neighbour's K/V but picks its own top-k",
        "Reuse": "reuses both the K/V and the top-k selection",
    },
    "main_cache": "nvfp4",  # FP4 E2M1 values, one E4M3 scale per 16 channels, after RoPE, trained with QAT
    "window_cache": "fp8",
    "global_kv_bytes_per_token": 890,  # 'about 890 bytes', a quarter of its predecessor's
    "predecessor_ratio": 4,
}


def variant_shapes(layers: int = 32, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128, window: int = 4096, factor: int = 2) -> dict[str, ModelShape]:
    """Cache shapes of one model size under each trick and their combinations (for comparison plots)."""
    base = dict(layers=layers, q_heads=q_heads, head_dim=head_dim)
    return {
        "MHA": ModelShape(kv_heads=q_heads, **base),
        f"GQA-{kv_heads}": ModelShape(kv_heads=kv_heads, **base),
        f"MHA + CLA-{factor}": ModelShape(kv_heads=q_heads, kv_owners=cross_layer_owners(layers, factor), **base),
        f"GQA-{kv_heads} + CLA-{factor}": ModelShape(kv_heads=kv_heads, kv_owners=cross_layer_owners(layers, factor), **base),
        "YOCO (MHA)": yoco_shape(layers, q_heads, q_heads, head_dim, window),
        f"YOCO + GQA-{kv_heads}": yoco_shape(layers, q_heads, kv_heads, head_dim, window),
    }


def describe_layers(shape: ModelShape) -> list[dict]:
    """One row per layer: whether it stores a cache, whose cache it reads, and its window."""
    rows = []
    for i in range(shape.layers):
        owner = shape.owner(i)
        rows.append({
            "layer": i,
            "stores": owner == i,
            "reads": owner,
            "window": shape.window(i),
        })
    return rows


def format_layers(shape: ModelShape, global_from: int | None = None) -> str:
    """The rows of :func:`describe_layers` as text.

    ``global_from``: for a YOCO shape, the layer index under which the global K/V is
    stored (``layers // 2``); the layers reading it are shown as cross-attending.
    """
    lines = [f"{'layer':>5}  {'attention':<22} {'cache':<34}"]
    for r in describe_layers(shape):
        attention = "full" if r["window"] is None else f"sliding window {r['window']}"
        if r["reads"] == global_from:
            cache = "cross-attends to the global K/V"
        elif r["stores"]:
            cache = "own K/V"
        else:
            cache = f"reads layer {r['reads']}'s K/V"
        lines.append(f"{r['layer']:>5}  {attention:<22} {cache:<34}")
    return "\n".join(lines)
