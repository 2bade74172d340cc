"""The cache-relevant shape of a decoder, validated once, used everywhere (lesson 02 first), and the one check for sizes."""

from __future__ import annotations

from dataclasses import dataclass, field


def require_positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    """Return ``value`` if it is an int > 0 (or >= 0); else raise ValueError naming ``name``."""
    # bool is an int subclass; True as a head count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        rule = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def require_even(name: str, value: int, why: str = "") -> int:
    """Return ``value`` if it is even; else raise ValueError naming ``name`` (and ``why`` it must be)."""
    if value % 2:
        raise ValueError(f"{name} must be even{' ' + why if why else ''}, got {value}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """What a decoder's KV cache depends on.

    layers:      decoder layers, each with its own attention.
    q_heads:     query heads per layer.
    kv_heads:    key/value heads per layer; q_heads must be a multiple of it
                 (q_heads == kv_heads is MHA, kv_heads == 1 is MQA, between is GQA).
    head_dim:    width of one head. Not always hidden_size / q_heads (Gemma-2 is not).
    hidden_size: width of the residual stream; defaults to q_heads * head_dim.
    windows:     per-layer sliding window in tokens, ``None`` for full attention.
                 Empty means every layer attends to the full context.
    kv_owners:   per-layer index of the layer whose cache it reads. A layer that owns
                 its cache maps to itself; cross-layer sharing (CLA, YOCO) maps several
                 layers to one owner, and only owners store anything. Empty: every layer
                 owns its own.
    latent_dim:  width of a latent cache (MLA): each owning layer stores one vector of
                 this width per token instead of K and V per KV head.
    """

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    windows: tuple[int | None, ...] = field(default=())
    kv_owners: tuple[int, ...] = field(default=())
    latent_dim: int | None = None

    def __post_init__(self):
        for name in ("layers", "q_heads", "kv_heads", "head_dim"):
            require_positive_int(name, getattr(self, name))
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads must be a multiple of kv_heads (each KV head serves a whole group "
                f"of query heads), got q_heads={self.q_heads}, kv_heads={self.kv_heads}"
            )
        if self.hidden_size is None:
            object.__setattr__(self, "hidden_size", self.q_heads * self.head_dim)
        require_positive_int("hidden_size", self.hidden_size)
        windows = tuple(self.windows)
        if windows and len(windows) != self.layers:
            raise ValueError(
                f"windows must give one entry per layer ({self.layers}), got {len(windows)}"
            )
        for i, w in enumerate(windows):
            if w is not None:
                require_positive_int(f"windows[{i}]", w)
        object.__setattr__(self, "windows", windows)
        owners = tuple(self.kv_owners)
        if owners and len(owners) != self.layers:
            raise ValueError(
                f"kv_owners must give one entry per layer ({self.layers}), got {len(owners)}"
            )
        for i, owner in enumerate(owners):
            require_positive_int(f"kv_owners[{i}]", owner, allow_zero=True)
            if owner > i:
                raise ValueError(
                    f"kv_owners[{i}] must be <= {i}: a layer can only read a cache written by "
                    f"itself or an earlier layer, got {owner}"
                )
            if owners[owner] != owner:
                raise ValueError(
                    f"kv_owners[{i}] = {owner}, but layer {owner} reads layer {owners[owner]}'s cache: "
                    f"an owner must own its own cache"
                )
            if windows and windows[i] != windows[owner]:
                raise ValueError(
                    f"windows[{i}] must equal windows[{owner}]: layer {i} reads layer {owner}'s cache"
                )
        object.__setattr__(self, "kv_owners", owners)
        if self.latent_dim is not None:
            require_positive_int("latent_dim", self.latent_dim)

    def __str__(self) -> str:
        # Only the fields that say something: defaults (no windows, no sharing) are left out.
        parts = [f"layers={self.layers}", f"q_heads={self.q_heads}", f"kv_heads={self.kv_heads}",
                 f"head_dim={self.head_dim}", f"hidden_size={self.hidden_size}"]
        if self.windows:
            parts.append(f"windows={self.windows}")
        if self.kv_owners:
            parts.append(f"kv_owners={self.kv_owners}")
        if self.latent_dim is not None:
            parts.append(f"latent_dim={self.latent_dim}")
        return f"ModelShape({', '.join(parts)})"

    @property
    def group_size(self) -> int:
        """Query heads that read each KV head (1 for MHA, q_heads for MQA)."""
        return self.q_heads // self.kv_heads

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens, or None for full attention."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in [0, {self.layers}), got {layer}")
        return self.windows[layer] if self.windows else None

    def owner(self, layer: int) -> int:
        """Index of the layer whose cache ``layer`` reads (itself unless caches are shared)."""
        self.window(layer)  # validates the index
        return self.kv_owners[layer] if self.kv_owners else layer

    @property
    def cache_layers(self) -> list[int]:
        """Layers that store a cache of their own, in order."""
        return [i for i in range(self.layers) if self.owner(i) == i]


def alternating_windows(layers: int, window: int, local_first: bool = True) -> tuple[int | None, ...]:
    """Per-layer windows alternating local (``window``) and global (None), as Gemma-2 does."""
    require_positive_int("layers", layers)
    require_positive_int("window", window)
    first = 0 if local_first else 1
    return tuple(window if i % 2 == first else None for i in range(layers))


def cross_layer_owners(layers: int, factor: int) -> tuple[int, ...]:
    """kv_owners for cross-layer attention (CLA): each group of ``factor`` adjacent layers shares the first's cache."""
    require_positive_int("layers", layers)
    require_positive_int("factor", factor)
    if layers % factor:
        raise ValueError(f"factor must divide layers ({layers}) so every group has {factor} layers, got {factor}")
    return tuple(i - i % factor for i in range(layers))
