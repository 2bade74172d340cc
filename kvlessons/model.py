"""A small Llama-style decoder, written to be read (lesson 01; every lesson runs it).

    ids (B, T) -> embed -> [RMSNorm -> attention(GQA, RoPE, cache) -> + ; RMSNorm -> SwiGLU -> +] x layers
               -> RMSNorm -> logits (B, T, vocab)

The same forward pass serves prefill, decode and "no cache": with ``cache=None`` it
runs on a throw-away empty cache, so there is one attention code path, not two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .attention import attend, padded_causal_mask, positions_from_padding
from .cache import ConcatCache, KVCache, LayerCache
from .rope import apply_rope, rope_tables
from .shape import ModelShape, require_even, require_positive_int


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of a :class:`TinyDecoder`. The defaults run every lesson on a laptop CPU in seconds."""

    vocab_size: int = 96
    hidden_size: int = 128
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 344
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 2
    windows: tuple[int | None, ...] = ()  # per-layer sliding window (None: full attention)
    kv_owners: tuple[int, ...] = ()  # per-layer owner of the cache it reads (cross-layer sharing)
    # YOCO's cross-decoder starts at this layer: it projects one global K/V from the residual
    # stream (with a norm of its own) that it and every later layer read; with last_only, only
    # the last position runs through these layers. None: an ordinary decoder.
    global_kv_layer: int | None = None

    def __post_init__(self):
        shape = self.shape  # validates layers, heads, head_dim, windows and owners with ModelShape's rules
        require_positive_int("vocab_size", self.vocab_size)
        require_positive_int("mlp_hidden", self.mlp_hidden)
        require_even("head_dim", self.head_dim, "for rotary embeddings")
        g = self.global_kv_layer
        if g is not None:
            require_positive_int("global_kv_layer", g, allow_zero=True)
            if g >= self.layers or any(shape.owner(i) != g or shape.window(i) is not None for i in range(g, self.layers)):
                raise ValueError(
                    f"global_kv_layer must be a layer index whose full-attention cache every later layer reads "
                    f"(kv_owners[i] == {g} and windows[i] is None for i >= {g}), got {g} for {shape}"
                )

    @property
    def rope_dim(self) -> int:
        """Width of what RoPE rotates: every query and key dimension."""
        return self.head_dim

    @property
    def shape(self) -> ModelShape:
        """The cache-relevant shape of this model."""
        return ModelShape(
            layers=self.layers,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            windows=self.windows,
            kv_owners=self.kv_owners,
        )


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose one-row case (a decode step of one sequence) is a matrix-vector product.

    Same result; CPU BLAS streams a weight matrix through ``torch.mv`` faster than through
    a one-row matrix product (about 2x in bf16, a few percent in fp32, measured by
    ``python -m kvlessons.bench``), and a decode step at batch 1 is little else.
    """

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__(in_features, out_features, bias=False, device=device)

    def forward(self, x):
        return project_rows(x, self.weight)


def project_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x (..., in); a single row goes through ``torch.mv``."""
    if x.shape[:-1].numel() == 1:
        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    return nn.functional.linear(x, weight)


@torch.no_grad()
def stacked(*linears: Linear) -> Linear:
    """One :class:`Linear` whose rows are those of ``linears``, in order: x through it = the outputs concatenated."""
    weight = torch.cat([lin.weight for lin in linears])
    fused = Linear(weight.shape[1], weight.shape[0], device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=linears[0].weight.requires_grad)
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 (as Llama does) so low-precision runs stay stable.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over one layer of a cache.

    A layer that owns its cache projects K and V, rotates K, writes both to its cache
    and attends over everything held. A layer that reads another layer's cache
    (cross-layer sharing) has no K/V projections: it attends with its own queries over
    the K/V its owner produced in this same forward pass.
    """

    def __init__(self, config: TinyConfig, window: int | None = None, projects_kv: bool = True):
        super().__init__()
        c = config
        self.q_heads, self.kv_heads, self.head_dim = c.q_heads, c.kv_heads, c.head_dim
        self.window = window  # sliding window in tokens, or None for full attention
        self.q_proj = Linear(c.hidden_size, c.q_heads * c.head_dim)
        if projects_kv:
            self.k_proj = Linear(c.hidden_size, c.kv_heads * c.head_dim)
            self.v_proj = Linear(c.hidden_size, c.kv_heads * c.head_dim)
        self.projects_kv = projects_kv
        self.o_proj = Linear(c.q_heads * c.head_dim, c.hidden_size)
        self.qkv_proj = None  # set by fuse(): q_proj, k_proj and v_proj stacked into one matrix

    @torch.no_grad()
    def fuse(self) -> None:
        """Stack q_proj, k_proj and v_proj into one matrix ``qkv_proj`` (rows: queries, keys, values).

        The outputs are the same numbers; a step runs one matrix product instead of
        three, reading the same weight bytes in one pass over a larger matrix. A layer
        without K/V projections (it reads another layer's cache) has nothing to fuse.
        """
        if self.qkv_proj is not None or not self.projects_kv:
            return
        fused = stacked(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused

    @property
    def _split(self) -> list[int]:
        """Rows of the fused matrix that project queries, keys and values, in that order."""
        return [self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def _rows(self, x, part: str):
        """``x`` projected to the queries, keys or values (B, T, heads * D), by its own matrix or its rows of the fused one."""
        if self.qkv_proj is None:
            return getattr(self, f"{part}_proj")(x)
        weights = dict(zip("qkv", self.qkv_proj.weight.split(self._split)))
        return project_rows(x, weights[part])

    def _heads(self, x, heads: int):
        """(B, T, heads * D) -> (B, heads, T, D)."""
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def queries(self, x, cos, sin):
        """Rotated queries (B, H_q, T, D)."""
        return apply_rope(self._heads(self._rows(x, "q"), self.q_heads), cos, sin)

    def keys_values(self, x, cos, sin):
        """Rotated keys and values (B, H_kv, T, D): rotate before caching, so the cache holds rotated keys."""
        k, v = (self._heads(self._rows(x, part), self.kv_heads) for part in "kv")
        return apply_rope(k, cos, sin), v

    def project(self, x, cos, sin):
        """Rotated queries and, for an owning layer, rotated keys and values (None otherwise)."""
        if self.qkv_proj is None:
            q = self.queries(x, cos, sin)
            return (q, *self.keys_values(x, cos, sin)) if self.projects_kv else (q, None, None)
        q, k, v = self.qkv_proj(x).split(self._split, dim=-1)  # one product for all three
        q, k, v = self._heads(q, self.q_heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    attend_fn = staticmethod(attend)  # the one attention call (lesson 07 swaps in broken ones)

    def forward(self, x, cos, sin, layer_cache: LayerCache | None = None, kv=None, mask=None, kv_input=None):
        """Return (output (B, T, hidden), (k_all, v_all)).

        ``kv`` is the owner's K/V for a layer that reads another layer's cache. ``kv_input``
        (x, cos, sin) is what K and V are projected from when that differs from the
        queries' input (YOCO's global K/V: every position, from a norm of its own).
        """
        b, t, _ = x.shape
        if kv is None and kv_input is None:  # the usual layer: queries, keys and values from x
            q, k, v = self.project(x, cos, sin)
            layer_cache.observe(q)  # a cache that keeps what attention reads (kvlessons.eviction) looks at the queries
            kv = layer_cache.update(k, v)  # (B, H_kv, S, D), S = cached + T
        else:
            q = self.queries(x, cos, sin)
            if kv is None:
                kv = layer_cache.update(*self.keys_values(*kv_input))
        if mask is not None and mask.shape[-1] > kv[0].shape[2]:
            mask = mask[..., -kv[0].shape[2]:]  # a sliding-window layer returns only the newest keys
        out = self.attend_fn(q, *kv, mask=mask, window=self.window)  # bottom-right causal mask when T > 1
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), kv


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.mlp_hidden)
        self.up_proj = Linear(config.hidden_size, config.mlp_hidden)
        self.down_proj = Linear(config.mlp_hidden, config.hidden_size)
        self.gate_up_proj = None  # set by fuse(): gate_proj and up_proj stacked into one matrix

    @torch.no_grad()
    def fuse(self) -> None:
        """Stack gate_proj and up_proj into one matrix ``gate_up_proj``: one product instead of two, same outputs."""
        if self.gate_up_proj is not None:
            return
        fused = stacked(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = fused

    def forward(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each added to the residual stream.

    ``global_kv``: this block is YOCO's first cross-decoder layer. Its K/V (the global
    K/V every later layer reads) are projected from its input through a norm of their
    own, for every position; with ``last_only`` only the last position goes on through
    its queries, MLP and the later blocks.
    """

    def __init__(self, config: TinyConfig, window: int | None = None, projects_kv: bool = True, global_kv: bool = False,
                 attention: nn.Module | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.kv_norm = RMSNorm(config.hidden_size, config.norm_eps) if global_kv else None
        # ``attention``: another kind of attention with the same call (kvlessons.mla's latent attention)
        self.attn = Attention(config, window, projects_kv) if attention is None else attention
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, layer_cache=None, kv=None, mask=None, last_only=False):
        """Return (new x, the K/V this layer attended over); with ``last_only``, x keeps its last position only."""
        kv_input = None
        if self.kv_norm is not None and kv is None:
            kv_input = (self.kv_norm(x), cos, sin)  # every position: all of them join the global cache
        if last_only:  # nothing after this layer keeps a cache of its own: only the last query matters
            x, cos, sin = x[:, -1:], cos[..., -1:, :], sin[..., -1:, :]
            mask = None if mask is None else mask[..., -1:, :]
        h, kv = self.attn(self.attn_norm(x), cos, sin, layer_cache, kv, mask, kv_input)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), kv


class TinyDecoder(nn.Module):
    """A Llama-style decoder whose weights depend only on ``config.seed``."""

    def __init__(self, config: TinyConfig | None = None):
        super().__init__()
        self.config = config = config or TinyConfig()
        # Build under a forked RNG: nn.Linear's default init would otherwise consume
        # the global generator and shift every random number a notebook draws later.
        with torch.random.fork_rng(devices=[]):
            self._build(config)
        self._init_weights(config.seed)

    def _build(self, config: TinyConfig) -> None:
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        shape = config.shape
        self.blocks = nn.ModuleList(
            Block(config, shape.window(i), projects_kv=shape.owner(i) == i, global_kv=i == config.global_kv_layer)
            for i in range(config.layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # A private generator: the weights do not depend on (or disturb) the global RNG.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue  # RMSNorm gains start at 1
            fan_in = 1 if p.dim() == 1 or name == "embed.weight" else p.shape[1]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))

    @property
    def shape(self) -> ModelShape:
        return self.config.shape

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False,
                pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits (B, T, vocab) for ``ids`` (B, T), appended after what ``cache`` holds.

        The new tokens take positions ``cache.seq_len .. cache.seq_len + T - 1``; their
        keys and values are added to the cache, and the cache advances by T. With
        ``cache=None`` the tokens are the whole sequence (positions from 0) and
        nothing is kept. ``last_only`` returns logits for the last position only
        (B, 1, vocab), all generation needs. ``pad_mask`` (B, cache.seq_len + T), True
        for real tokens, serves left-padded batches: positions count real tokens only
        and no token attends to a pad.
        """
        cache, cos, sin, x, mask = self.begin(ids, cache, pad_mask)
        with cache.transaction(ids):  # all or nothing: if anything below raises, the cache is as it was
            x = self.run_blocks(range(len(self.blocks)), x, cos, sin, cache, mask=mask, last_only=last_only)
            logits = self.head(x[:, -1:] if last_only else x)
            cache.advance(ids.shape[1])  # once per forward pass, never once per layer
        return logits

    def positions(self, start: int, new_tokens: int, device=None) -> torch.Tensor:
        """Positions of ``new_tokens`` tokens appended after ``start`` cached ones: start .. start + T - 1."""
        return torch.arange(start, start + new_tokens, device=device)

    def begin(self, ids: torch.Tensor, cache: KVCache | None, pad_mask: torch.Tensor | None = None):
        """Check the inputs, changing nothing; return (cache, cos, sin, embeddings, attention mask or None)."""
        if ids.dim() != 2:
            raise ValueError(f"ids must be (batch, tokens), got shape {tuple(ids.shape)}")
        t = ids.shape[1]
        if t == 0:
            raise ValueError("ids must hold at least one token")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"ids must be integer token ids, got dtype {ids.dtype}")
        lowest, highest = (int(v) for v in ids.aminmax())
        if lowest < 0 or highest >= self.config.vocab_size:
            raise ValueError(f"ids must be in [0, vocab_size={self.config.vocab_size}), got values from {lowest} to {highest}")
        cache = ConcatCache() if cache is None else cache
        start = cache.seq_len  # the one place positions come from
        mask = None
        if pad_mask is None:
            positions = self.positions(start, t, ids.device)
        else:
            if not cache.supports_padding:
                raise ValueError(f"pad_mask cannot be used with {type(cache).__name__}: its layers keep scattered "
                                 f"positions, so the mask's columns no longer line up with the keys; run sequences one by one")
            if pad_mask.shape != (ids.shape[0], start + t):
                raise ValueError(
                    f"pad_mask must be (batch, cached + new tokens) = {(ids.shape[0], start + t)}, got {tuple(pad_mask.shape)}"
                )
            positions = positions_from_padding(pad_mask)[:, start:]  # (B, T): real tokens only
            mask = padded_causal_mask(pad_mask, t)
        cos, sin = rope_tables(positions, self.config.rope_dim, self.config.rope_theta)
        dtype = self.embed.weight.dtype
        return cache, cos.to(dtype), sin.to(dtype), self.embed(ids), mask

    def run_blocks(self, indices, x, cos, sin, cache: KVCache, mask=None, last_only: bool = False):
        """Run the blocks at ``indices``; a layer that shares a cache reuses its owner's K/V of this pass.

        With ``last_only``, from the model's ``global_kv_layer`` on (YOCO's cross-decoder)
        only the last position is carried: those layers keep no cache that would need the rest.
        """
        shared = {}  # owner index -> (k_all, v_all) of this pass
        for i in indices:
            block, owner = self.blocks[i], self.shape.owner(i)
            narrow = last_only and i == self.config.global_kv_layer
            if owner in shared:  # the owner already wrote this pass's K/V: read it, store nothing
                x, _ = block(x, cos, sin, kv=shared[owner], mask=mask, last_only=narrow)
            else:
                layer_cache = cache.layer(i, window=block.attn.window)
                x, shared[i] = block(x, cos, sin, layer_cache=layer_cache, mask=mask, last_only=narrow)
            if narrow:
                cos, sin = cos[..., -1:, :], sin[..., -1:, :]
                mask = None if mask is None else mask[..., -1:, :]
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the output projection: logits."""
        return self.lm_head(self.norm(x))


def fuse_projections(model: TinyDecoder) -> TinyDecoder:
    """Fuse, in place, every layer's Q/K/V projections into one matrix and its gate/up projections into another.

    A decode step then runs 3 matrix products per layer instead of 6 (plus the output
    head), reading exactly the same weights. The logits are the same up to float
    rounding (the tests hold them equal to the unfused model's). Returns ``model``.
    """
    for block in model.blocks:
        block.attn.fuse()
        block.mlp.fuse()
    return model


class CharTokenizer:
    """Characters to token ids and back: printable ASCII plus newline, 96 tokens.

    The tiny model's weights are random, so what it writes is gibberish; a character
    vocabulary keeps every token readable on screen.
    """

    alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
    unknown = "?"

    def __init__(self):
        self._index = {ch: i for i, ch in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str, device=None) -> torch.Tensor:
        """Return ids (1, len(text)); characters outside the alphabet become '?'."""
        ids = [self._index.get(ch, self._index[self.unknown]) for ch in text]
        return torch.tensor([ids], dtype=torch.long, device=device)

    def decode(self, ids) -> str:
        """Return the text for a 1-D sequence of ids (tensor or list)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.alphabet[i] if 0 <= i < len(self.alphabet) else self.unknown for i in ids)

    def token_str(self, i: int) -> str:
        """One token, shown so whitespace is visible."""
        ch = self.decode([i])
        return {"\n": "\\n", " ": "\u2423"}.get(ch, ch)


@torch.no_grad()
def attention_inputs(model, ids: torch.Tensor, layer: int = 0):
    """The rotated (q, k, v) that layer ``layer`` computes for ``ids`` in one uncached pass.

    Also returns the keys before rotation, for comparing quantization before and after
    RoPE: ``(q, k, v, k_before_rope)``, shaped (B, heads, T, D).
    """
    attn = model.blocks[layer].attn
    if not attn.projects_kv:
        raise ValueError(f"layer {layer} reads another layer's cache and computes no K/V of its own")
    seen = {}

    def grab(_module, args):
        seen["x"], seen["cos"], seen["sin"] = args[0], args[1], args[2]

    handle = attn.register_forward_pre_hook(grab)
    try:
        model(ids)
    finally:
        handle.remove()
    x = seen["x"]
    q, k, v = attn.project(x, seen["cos"], seen["sin"])
    k_raw = attn._heads(attn._rows(x, "k"), attn.kv_heads)
    return q, k, v, k_raw
