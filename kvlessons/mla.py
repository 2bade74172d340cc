"""Multi-head latent attention (MLA), the cache that stores a compressed latent (lesson 09).

DeepSeek-V2 (arXiv 2405.04434) and V3 (arXiv 2412.19437) do not cache keys and values
per head. Each layer projects the token down to one latent vector ``c`` of
``kv_lora_rank`` values (plus, for RoPE, one small rotary key ``k_rope`` of
``qk_rope_head_dim`` values shared by every head), and caches only that:

    x ─▶ kv_a_proj ─▶ [c (r) | k_rope (d_r)]    c ─▶ RMSNorm;  k_rope ─▶ RoPE at its position
         cached per token per layer: r + d_r values  (DeepSeek-V3: 512 + 64 = 576)

Every head's key and value are linear in ``c``: ``k_nope = W_uk[h] c`` and
``v = W_uv[h] c`` (``kv_b_proj`` holds both). That gives two ways to attend over the cache:

- **naive**: decompress every cached latent to per-head keys and values, then ordinary
  attention with per-head keys ``[k_nope | k_rope]``. Each step re-does the
  decompression for the whole context.
- **absorbed**: fold ``W_uk`` into the query (``q_nope . W_uk[h] c = (W_uk[h]^T q_nope) . c``)
  and ``W_uv`` into the output, so attention runs directly over the cached latents: one
  (r + d_r)-wide "KV head" read by every query head, whose values are its first r columns.

RoPE is why the rotary part is separate: a rotation sits between ``W_uk`` and the
query, and it depends on the key's position, so it cannot be folded into a fixed
matrix. DeepSeek keeps a small rotated key beside the latent (the "decoupled" RoPE).

The model here is :class:`MLADecoder`: the course's one forward pass
(:class:`kvlessons.model.TinyDecoder`) with :class:`MLAAttention` in every block. Its
cache layers store keys only (``update(latent, None)``), one (B, 1, T, r + d_r) tensor,
in any of the course's caches (concatenating, static, quantized, paged).
:func:`from_deepseek_v3` loads a transformers ``DeepseekV3ForCausalLM`` (dense MLPs, no
mixture of experts) into it, for the peer check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend, causal_mask
from .generate import next_token_agreement
from .memory import storage_format
from .model import Block, Linear, RMSNorm, TinyDecoder
from .pretrained import unpermute_rotary_rows
from .rope import apply_rope
from .shape import ModelShape, require_even, require_positive_int

DECODE_MODES = ("naive", "absorbed")
LATENT_NORM_EPS = 1e-6  # the latents' RMSNorm epsilon in DeepSeek's code and in transformers' DeepseekV3


def _check_mode(decode: str) -> str:
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
    return decode


@dataclass(frozen=True)
class MLAConfig:
    """Sizes of an :class:`MLADecoder`; names as in DeepSeek's configs. Defaults: a laptop-sized model.

    kv_lora_rank:      r, width of the cached latent (DeepSeek-V2/V3: 512).
    qk_rope_head_dim:  d_r, width of the shared rotary key, also cached (64); even.
    qk_nope_head_dim:  width of each head's key part without RoPE, decompressed from the latent (128).
    v_head_dim:        width of each head's value (128).
    q_lora_rank:       queries through a low-rank bottleneck of this width (V3: 1536), or None for one projection.
    decode:            "absorbed" or "naive": how attention reads the latents (same logits).
    """

    vocab_size: int = 96
    hidden_size: int = 128
    layers: int = 2
    q_heads: int = 8
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    q_lora_rank: int | None = None
    mlp_hidden: int = 344
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 2
    decode: str = "absorbed"

    global_kv_layer = None  # what TinyDecoder reads: no YOCO cross-decoder
    windows = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "layers", "q_heads", "kv_lora_rank", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "mlp_hidden"):
            require_positive_int(name, getattr(self, name))
        require_even("qk_rope_head_dim", self.qk_rope_head_dim, "for rotary embeddings")
        if self.q_lora_rank is not None:
            require_positive_int("q_lora_rank", self.q_lora_rank)
        _check_mode(self.decode)

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the decompressed part and the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def shape(self) -> ModelShape:
        """The cache-relevant shape: one latent row of ``latent_dim`` values per layer per token.

        ``kv_heads`` and ``head_dim`` describe what the latents decompress to (every head
        its own key); the cache formula reads only ``latent_dim``.
        """
        return ModelShape(layers=self.layers, q_heads=self.q_heads, kv_heads=self.q_heads, head_dim=self.qk_head_dim,
                          hidden_size=self.hidden_size, latent_dim=self.latent_dim)


# Published attention shapes (config.json of each model; DeepSeek-AI, arXiv 2405.04434 and 2412.19437), for
# counting only: these models are mixtures of experts, so their MLPs are not what MLADecoder would build.
# kvlessons.memory's presets of the same names hold the same layers and latent width (the tests tie them).
MLA_CONFIGS = {
    "DeepSeek-V2-Lite": MLAConfig(vocab_size=102400, hidden_size=2048, layers=27, q_heads=16, kv_lora_rank=512,
                                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
                                  mlp_hidden=10944),
    "DeepSeek-V2": MLAConfig(vocab_size=102400, hidden_size=5120, layers=60, q_heads=128, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536,
                             mlp_hidden=12288),
    "DeepSeek-V3": MLAConfig(vocab_size=129280, hidden_size=7168, layers=61, q_heads=128, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536,
                             mlp_hidden=18432),
}


class MLAAttention(nn.Module):
    """Latent attention over one layer of a cache that stores (B, 1, T, r + d_r) latents.

    Weights are named as in transformers' DeepseekV3Attention (``kv_a_proj`` is its
    ``kv_a_proj_with_mqa``; ``q_a_norm`` / ``kv_a_norm`` its ``*_layernorm``), and the
    rotary dimensions use Llama's half-split layout (:func:`from_deepseek_v3` reorders
    interleaved checkpoints).
    """

    window = None  # no sliding window
    projects_kv = True  # every MLA layer owns its cache

    def __init__(self, config: MLAConfig):
        super().__init__()
        c = config
        self.heads, self.rank = c.q_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.decode = c.decode
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, c.q_heads * c.qk_head_dim)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank)
            self.q_a_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(c.q_lora_rank, c.q_heads * c.qk_head_dim)
        self.kv_a_proj = Linear(c.hidden_size, c.latent_dim)  # rows: the latent, then the shared rotary key
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(c.kv_lora_rank, c.q_heads * (c.qk_nope_head_dim + c.v_head_dim))  # per head: key rows, value rows
        self.o_proj = Linear(c.q_heads * c.v_head_dim, c.hidden_size)
        self.scale = c.qk_head_dim ** -0.5  # scores are scaled by the per-head key width, in both modes

    # -- the pieces ---------------------------------------------------------------------------------

    def queries(self, x, cos, sin):
        """Each head's query, split: (q_nope (B, H, T, d_nope), q_rope (B, H, T, d_r) rotated)."""
        b, t, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(b, t, self.heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin)

    def latents(self, x, cos, sin):
        """What the cache stores for x: (B, 1, T, r + d_r), the normalised latent then the rotated shared key."""
        b, t, _ = x.shape
        c, k_rope = self.kv_a_proj(x).split([self.rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope.view(b, 1, t, self.rope_dim), cos, sin)
        return torch.cat([self.kv_a_norm(c).view(b, 1, t, self.rank), k_rope], dim=-1)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk (H, d_nope, r), W_uv (H, d_v, r)): views of kv_b_proj's key and value rows, per head."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def decompress(self, latents):
        """Per-head keys (B, H, S, d_nope + d_r) and values (B, H, S, d_v) from cached latents (B, 1, S, r + d_r)."""
        c, k_rope = latents.split([self.rank, self.rope_dim], dim=-1)
        b, _, s, _ = latents.shape
        kv = self.kv_b_proj(c[:, 0]).view(b, s, self.heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(b, self.heads, s, self.rope_dim)], dim=-1), v

    def absorb_query(self, q_nope):
        """q_nope (B, H, T, d_nope) moved into latent space: (B, H, T, r), q_latent[h] = W_uk[h]^T q_nope[h].

        Then q_latent . c equals q_nope . (W_uk[h] c): the score against the decompressed key,
        computed without decompressing it.
        """
        w_uk, _ = self.up_weights()
        return torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)

    def attend_latents(self, q_latent, q_rope, latents, mask=None):
        """Absorbed attention: every head over the one latent 'KV head'; returns (B, H, T, r), still in latent space.

        The H query heads of one sequence read the same (S, r + d_r) keys, so they are
        stacked as H x T rows of one query matrix over one KV head (MQA's layout): the
        cache is read once for all heads, never copied per head. The values are the
        keys' first r columns (the latents themselves).
        """
        b, h, t, _ = q_latent.shape
        s = latents.shape[2]
        q = torch.cat([q_latent, q_rope], dim=-1).reshape(b, 1, h * t, -1)  # row h * T + i: head h, query i
        if mask is None and t > 1:
            mask = causal_mask(t, s, device=q.device)
        if mask is not None:  # (..., T, S) -> (B or 1, 1, H * T, S): every head, the same mask
            mask = mask.reshape(-1, 1, t, s).unsqueeze(1).expand(-1, h, -1, -1, -1).reshape(-1, 1, h * t, s)
        # SDPA directly, not attend(): these rows are heads as well as positions, so attend's
        # default (a causal mask whenever there are several query rows) would be wrong here.
        # Grouping by reshape, not enable_gqa=True: with values narrower than keys, PyTorch's
        # CPU path for enable_gqa copies the keys per head (measured 100x slower at 128 heads).
        out = F.scaled_dot_product_attention(q, latents, latents[..., : self.rank], attn_mask=mask, scale=self.scale)
        return out.view(b, h, t, self.rank)

    def forward(self, x, cos, sin, layer_cache=None, kv=None, mask=None, kv_input=None):
        """Return (output (B, T, hidden), (all cached latents, None)), the call :class:`kvlessons.model.Block` makes."""
        if kv is not None or kv_input is not None:
            raise ValueError("an MLA layer owns its cache: it neither reads another layer's K/V nor a separate K/V input")
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x, cos, sin)
        latents, _ = layer_cache.update(self.latents(x, cos, sin), None)  # keys only: (B, 1, S, r + d_r)
        if _check_mode(self.decode) == "naive":
            k, v = self.decompress(latents)
            out = attend(torch.cat([q_nope, q_rope], dim=-1), k, v, mask=mask, scale=self.scale)  # (B, H, T, d_v)
        else:
            out_latent = self.attend_latents(self.absorb_query(q_nope), q_rope, latents, mask)
            _, w_uv = self.up_weights()
            out = torch.einsum("bhtr,hvr->bhtv", out_latent, w_uv)  # W_uv applied after attention, per head
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (latents, None)


class MLADecoder(TinyDecoder):
    """The course's decoder with latent attention in every layer; ``forward(ids, cache=...)`` as every kvlessons model.

    ``decode`` switches every layer between "absorbed" and "naive" (same logits, different work).
    """

    def __init__(self, config: MLAConfig | None = None):
        super().__init__(config or MLAConfig())

    def _build(self, config: MLAConfig) -> None:
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, attention=MLAAttention(config)) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    @property
    def decode(self) -> str:
        return self.blocks[0].attn.decode

    @decode.setter
    def decode(self, mode: str) -> None:
        _check_mode(mode)
        for block in self.blocks:
            block.attn.decode = mode


# -- the peer: transformers' DeepSeek-V3 -----------------------------------------------------------------


def config_from_deepseek_v3(hf_config, decode: str = "absorbed") -> MLAConfig:
    """The MLAConfig of a transformers ``DeepseekV3Config``; raises ValueError for what MLADecoder does not model."""
    c = hf_config
    if c.first_k_dense_replace < c.num_hidden_layers:
        raise ValueError(
            f"first_k_dense_replace must be >= num_hidden_layers ({c.num_hidden_layers}) so every MLP is dense: "
            f"MLADecoder has no mixture-of-experts layers, got {c.first_k_dense_replace}"
        )
    if c.rope_scaling is not None:
        raise ValueError(f"rope_scaling must be None (YaRN scaling is not modelled), got {c.rope_scaling!r}")
    if c.attention_bias:
        raise ValueError("attention_bias must be False: MLADecoder's projections have no bias")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {c.hidden_act!r}")
    return MLAConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, layers=c.num_hidden_layers, q_heads=c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim, qk_nope_head_dim=c.qk_nope_head_dim,
        v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank, mlp_hidden=c.intermediate_size,
        rope_theta=float(c.rope_theta), norm_eps=c.rms_norm_eps, decode=decode,
    )


def _half_split_rope_rows(weight: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """Rows (heads * (nope + rope), in) with each head's last ``rope`` rows from interleaved to half-split order."""
    w = weight.reshape(heads, nope + rope, -1)
    rotary = unpermute_rotary_rows(w[:, nope:].reshape(heads * rope, -1), heads).view(heads, rope, -1)
    return torch.cat([w[:, :nope], rotary], dim=1).reshape(weight.shape)


@torch.no_grad()
def from_deepseek_v3(hf_model, decode: str = "absorbed") -> MLADecoder:
    """An MLADecoder holding the weights of a transformers ``DeepseekV3ForCausalLM`` (dense MLPs only).

    Same dtype and device as ``hf_model``. With ``rope_interleave`` (DeepSeek's
    checkpoints rotate adjacent pairs) the rotary rows are reordered to the half-split
    layout kvlessons rotates; the logits are the same.
    """
    hf = hf_model.config
    config = config_from_deepseek_v3(hf, decode)
    sd = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    rope, nope, heads, rank = config.qk_rope_head_dim, config.qk_nope_head_dim, config.q_heads, config.kv_lora_rank
    ours = {"embed.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"],
            "lm_head.weight": sd.get("lm_head.weight", sd["embed_tokens.weight"])}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "mlp": "mlp",
             "self_attn.q_proj": "attn.q_proj", "self_attn.q_a_proj": "attn.q_a_proj",
             "self_attn.q_a_layernorm": "attn.q_a_norm", "self_attn.q_b_proj": "attn.q_b_proj",
             "self_attn.kv_a_proj_with_mqa": "attn.kv_a_proj", "self_attn.kv_a_layernorm": "attn.kv_a_norm",
             "self_attn.kv_b_proj": "attn.kv_b_proj", "self_attn.o_proj": "attn.o_proj"}
    for key, value in sd.items():
        if not key.startswith("layers."):
            continue
        _, i, rest = key.split(".", 2)
        module, param = rest.rsplit(".", 1)
        target = module if module.startswith("mlp.") else names[module]  # the MLP's names are the same
        if hf.rope_interleave and module in ("self_attn.q_proj", "self_attn.q_b_proj"):
            value = _half_split_rope_rows(value, heads, nope, rope)
        elif hf.rope_interleave and module == "self_attn.kv_a_proj_with_mqa":
            value = torch.cat([value[:rank], unpermute_rotary_rows(value[rank:], 1)])
        ours[f"blocks.{i}.{target}.{param}"] = value
    model = MLADecoder(config)
    model.load_state_dict(ours, strict=True)
    weight = hf_model.lm_head.weight
    return model.to(device=weight.device, dtype=weight.dtype).eval()


# -- counting the work -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionWork:
    """What one layer's attention does in one forward pass of ``new_tokens`` after ``cached`` tokens.

    flops:       multiply-adds x 2 of the parts that differ between the ways of reading the cache
                 (decompression, query absorption, scores, weighted sum, output up-projection);
                 the projections every way shares (queries, kv_a, o_proj) are left out.
    cache_bytes: bytes of cache the pass reads (every cached position, once).
    cached_per_token: bytes this way stores per token per layer.
    """

    way: str
    flops: int
    cache_bytes: int
    cached_per_token: int


WAYS = ("cache K/V", "naive", "absorbed")


def attention_work(config: MLAConfig, new_tokens: int, cached: int = 0, batch: int = 1, dtype="bf16") -> dict[str, AttentionWork]:
    """One layer's attention work for the three ways, each counted from the rule written out.

    - "cache K/V": what transformers' DeepseekV3 does: decompress only the new tokens,
      cache per-head keys (d_nope + d_r) and values (d_v), attend over them.
    - "naive": cache the latent; every pass decompresses all S = cached + new latents.
    - "absorbed": cache the latent; absorb W_uk into the queries, attend over the
      latents (keys r + d_r wide, values r wide), apply W_uv to the output.

    Scores and weighted sums are counted per (query, visible key) pair: a causal pass of
    T new tokens after C cached sees T x C + T(T + 1)/2 pairs.
    """
    require_positive_int("new_tokens", new_tokens)
    require_positive_int("cached", cached, allow_zero=True)
    require_positive_int("batch", batch)
    fmt = storage_format(dtype)
    c, t = config, new_tokens
    s = cached + t
    h, r, dr, dn, dv = c.q_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    pairs = t * cached + t * (t + 1) // 2
    kv_row = h * (dn + dr + dv)  # per-head keys and values of one token
    latent_row = r + dr
    per_head_attention = 2 * h * pairs * (dn + dr) + 2 * h * pairs * dv
    work = {
        "cache K/V": (2 * t * r * h * (dn + dv) + per_head_attention, kv_row),
        "naive": (2 * s * r * h * (dn + dv) + per_head_attention, latent_row),
        "absorbed": (2 * t * h * dn * r + 2 * h * pairs * (r + dr) + 2 * h * pairs * r + 2 * t * h * r * dv, latent_row),
    }
    out = {}
    for way, (flops, row) in work.items():
        per_token = fmt.row_bytes(row)
        out[way] = AttentionWork(way, batch * flops, batch * per_token * cached, per_token)
    return out


def format_attention_work(config: MLAConfig, lengths=(1024, 32768), dtype="bf16") -> str:
    """A table of :func:`attention_work` (one layer, one sequence) for a decode step and a prefill at each length."""
    lines = [f"{'(one layer, one sequence)':<24}", f"{'pass':<24}{'way':<11}{'cached per token':>17}{'GFLOP':>12}{'cache read':>13}"]
    for n in lengths:
        for label, t, cached in ((f"decode at {n:,}", 1, n - 1), (f"prefill of {n:,}", n, 0)):
            for way, w in attention_work(config, t, cached, dtype=dtype).items():
                read = f"{w.cache_bytes / 2**20:,.1f} MiB" if cached else "none"
                lines.append(f"{label:<24}{way:<11}{w.cached_per_token:>15,} B{w.flops / 1e9:>12,.3f}{read:>13}")
                label = ""
    return "\n".join(lines)


# -- how much a trained layer's K/V can be compressed --------------------------------------------------


@dataclass(frozen=True)
class RankPoint:
    """One rank of :func:`kv_rank_errors`: the K/V error of a rank-``rank`` joint latent, and what it would cache."""

    rank: int
    weight_error: float  # ||W - W_r||_F / ||W||_F (Eckart-Young: the discarded singular values' share)
    output_error: float  # ||(W - W_r) x|| / ||W x|| over the given inputs: the error in the keys and values themselves
    values_per_token: int  # cached per token per layer as a latent: rank (K and V would be W's rows)


def joint_kv_weight(attn) -> torch.Tensor:
    """A GQA layer's key and value projections stacked, (2 x kv_heads x head_dim, hidden): x -> [k | v] in one product."""
    if attn.qkv_proj is not None or not attn.projects_kv:
        raise ValueError("attn must have its own, unfused k_proj and v_proj")
    return torch.cat([attn.k_proj.weight, attn.v_proj.weight])


def low_rank(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(up (rows, rank), down (rank, cols)) with up @ down the best rank-``rank`` approximation of ``weight`` (SVD).

    ``down`` is the latent projection (what a cache would store is ``down @ x``) and
    ``up`` decompresses it; the singular values are split evenly between them.
    """
    require_positive_int("rank", rank)
    if rank > min(weight.shape):
        raise ValueError(f"rank must be <= min(weight.shape) = {min(weight.shape)}, got {rank}")
    u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).to(weight.dtype), (root[:, None] * vh[:rank]).to(weight.dtype)


def kv_rank_errors(weight: torch.Tensor, inputs: torch.Tensor, ranks) -> list[RankPoint]:
    """For each rank: how well a latent of that width reproduces K/V = ``weight @ x`` for the ``inputs`` (N, hidden)."""
    w = weight.detach().double()
    x = inputs.detach().reshape(-1, inputs.shape[-1]).double()
    full = x @ w.T
    points = []
    for r in ranks:
        up, down = low_rank(w, r)
        approx = up @ down
        out = x @ approx.T
        points.append(RankPoint(r, float((w - approx).norm() / w.norm()), float((out - full).norm() / full.norm()), r))
    return points


class low_rank_kv:
    """Context manager: every layer of a GQA ``model`` computes K and V through a rank-``rank`` joint latent.

    The weights are swapped in place and put back on exit, even after an exception or a
    Ctrl-C, so a learner's model is never left changed. Lesson 09 measures what the
    latent width costs a trained model this way.
    """

    def __init__(self, model, rank: int):
        self.model, self.rank = model, require_positive_int("rank", rank)
        self._saved = []

    @torch.no_grad()
    def __enter__(self):
        try:
            for block in self.model.blocks:
                attn = block.attn
                joint = joint_kv_weight(attn)
                k, v = attn.k_proj.weight, attn.v_proj.weight
                up, down = low_rank(joint, self.rank)
                approx = up @ down
                self._saved.append((k, v, k.clone(), v.clone()))
                k.copy_(approx[: k.shape[0]])
                v.copy_(approx[k.shape[0]:])
        except BaseException:
            self.__exit__()
            raise
        return self.model

    @torch.no_grad()
    def __exit__(self, *exc):
        while self._saved:
            k, v, k_old, v_old = self._saved.pop()
            k.copy_(k_old)
            v.copy_(v_old)
        return False


@torch.no_grad()
def rank_sweep(model, ids: torch.Tensor, ranks) -> list[dict]:
    """For each rank: ``model``'s next-token agreement and KL with itself when every layer's K/V go through a latent of that rank.

    Rows: rank, the latent values a token would cache per layer (the rank) against the
    K/V values it caches now, top-1 agreement over every position of ``ids`` (1, T), and
    the mean KL(full || low rank) of the next-token distributions, in nats.
    """
    full = model(ids).float()
    kv_values = joint_kv_weight(model.blocks[0].attn).shape[0]
    rows = []
    for r in ranks:
        with low_rank_kv(model, r):
            agreement = next_token_agreement(full, model(ids).float())
        rows.append({"rank": r, "kv_values": kv_values, "top1": agreement["top1"], "kl": agreement["kl"]})
    return rows


def format_rank_sweep(rows: list[dict]) -> str:
    """:func:`rank_sweep`'s rows as an aligned table."""
    lines = [f"{'latent rank':>11}{'cached values vs K/V':>22}{'top-1 agreement':>17}{'KL (nats)':>11}"]
    for r in rows:
        lines.append(f"{r['rank']:>11}{r['rank']:>11} / {r['kv_values']:<8}{r['top1']:>17.1%}{r['kl']:>11.3f}")
    return "\n".join(lines)


def attention_params(model) -> int:
    """Parameters of every layer's attention (projections and norms), counted from the tensors held."""
    return sum(p.numel() for block in model.blocks for p in block.attn.parameters())


@torch.no_grad()
def measured_bytes_per_token(model, tokens: int = 16, dtype=None) -> int:
    """Bytes one token adds to ``model``'s cache, measured: a ``tokens``-long prompt in a ConcatCache, nbytes() / tokens."""
    from .cache import ConcatCache

    require_positive_int("tokens", tokens)
    cache = ConcatCache()
    ids = torch.randint(model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(ids.to(model.device), cache=cache)
    return cache.nbytes() // tokens


def tiny_deepseek_v3(q_lora_rank: int | None = None, seed: int = 0, layers: int = 2, rope_interleave: bool = True):
    """A small transformers ``DeepseekV3ForCausalLM`` with dense MLPs and order-1 random weights, built offline.

    The peer for the tests and lesson 09. transformers' default initialisation
    (standard deviation 0.02) makes every logit nearly the same, so any two models
    would agree; weights of order 1 (and norm gains near, not at, 1) make an error show.
    """
    import math

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=12,
        v_head_dim=10, first_k_dense_replace=layers, max_position_embeddings=512, rope_interleave=rope_interleave,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm gains
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = 1 if "embed" in name else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    return model
