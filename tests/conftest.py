"""Shared fixtures: the device under test and every cache variant on the common interface."""

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import kvlessons
from kvlessons.generate import feed_in_chunks  # noqa: F401 (the tests' chunked loop is the package's)
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.fp4 import QuantizedCache
from kvlessons.model import TinyConfig, TinyDecoder
from kvlessons.paging import PagedKVCache
from kvlessons.crosslayer import YOCODecoder
from kvlessons.eviction import EvictingCache
from kvlessons.mla import MLAConfig, MLADecoder

# Storage kinds that take any TinyDecoder: name -> factory(max_tokens).
STORAGE_KINDS = {
    "concat": lambda max_tokens: ConcatCache(),
    "static": lambda max_tokens: StaticCache(max_tokens),
}

# (q_heads, kv_heads): MHA, GQA, MQA
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def small_config(q_heads=4, kv_heads=2, seed=0, **overrides) -> TinyConfig:
    """A tiny seeded config, small enough for many parametrized cases."""
    cfg = dict(vocab_size=50, hidden_size=32, layers=2, q_heads=q_heads, kv_heads=kv_heads, head_dim=8, mlp_hidden=48, seed=seed)
    cfg.update(overrides)
    return TinyConfig(**cfg)


def small_model(q_heads=4, kv_heads=2, seed=0, dev=None, **overrides):
    """A tiny seeded float32 model."""
    return TinyDecoder(small_config(q_heads, kv_heads, seed, **overrides)).to(dev or "cpu").eval()


def paged_view(model, max_tokens, block_size=4):
    """A one-sequence view of a PagedKVCache with room for ``max_tokens`` (and a spare block)."""
    pool = PagedKVCache(model.shape, num_blocks=math.ceil(max_tokens / block_size) + 1, block_size=block_size,
                        device=model.device)
    seq_id, _ = pool.add_sequence()
    return pool.view(seq_id)


@dataclass(frozen=True)
class CacheVariant:
    """One cache variant: how to build the model it runs on, and the cache itself."""

    make_cache: Callable  # (model, max_tokens) -> cache
    overrides: dict = field(default_factory=dict)  # small_config keyword overrides
    yoco_window: int | None = None  # build a YOCODecoder with this window instead of a TinyDecoder
    max_batch: int = 2  # a paged view serves one sequence
    mla: dict | None = None  # build an MLADecoder: MLA_SMALL with these changes (overrides is not used)

    def model(self, q_heads=4, kv_heads=2, dev=None, seed=0, **more):
        if self.mla is not None:  # latent attention has no KV heads: kv_heads does not apply
            model = MLADecoder(MLAConfig(**{**MLA_SMALL, "q_heads": q_heads, "seed": seed, **self.mla, **more}))
        else:
            config = small_config(q_heads, kv_heads, seed, **{**self.overrides, **more})
            model = TinyDecoder(config) if self.yoco_window is None else YOCODecoder(config, window=self.yoco_window)
        return model.to(dev or "cpu").eval()


# A small latent-attention model: 12 latent + 4 rotary values cached per token per layer
# (16: a whole NVFP4 block, so the quantized cache can hold it).
MLA_SMALL = dict(vocab_size=50, hidden_size=32, layers=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
                 v_head_dim=8, mlp_hidden=48)


# Every cache variant, so the "cached equals uncached" and "all or nothing" tests cover each.
CACHE_VARIANTS = {
    "concat": CacheVariant(lambda model, n: ConcatCache()),
    "static": CacheVariant(lambda model, n: StaticCache(n)),
    "window-concat": CacheVariant(lambda model, n: ConcatCache(), overrides={"layers": 3, "windows": (4, None, 3)}),
    "window-static": CacheVariant(lambda model, n: StaticCache(n), overrides={"layers": 3, "windows": (4, None, 3)}),
    # A full-precision tail at least as long as the whole sequence: nothing is quantized, so it must be exact.
    "quantized-tail": CacheVariant(lambda model, n: QuantizedCache("nvfp4", residual=n), overrides={"head_dim": 16}),
    "paged": CacheVariant(paged_view, max_batch=1),
    "cla-static": CacheVariant(lambda model, n: StaticCache(n), overrides={"layers": 4, "kv_owners": (0, 0, 2, 2)}),
    "yoco-concat": CacheVariant(lambda model, n: ConcatCache(), overrides={"layers": 4}, yoco_window=3),
    "yoco-static": CacheVariant(lambda model, n: StaticCache(n), overrides={"layers": 4}, yoco_window=3),
    # Eviction with a budget longer than any test sequence: exactly a full cache (kvlessons.eviction).
    "evict-large-budget-h2o": CacheVariant(lambda model, n: EvictingCache("H2O", budget=10_000, when="decode")),
    "evict-large-budget-snapkv": CacheVariant(lambda model, n: EvictingCache("SnapKV", budget=10_000)),
    # Latent attention (kvlessons.mla): the cache stores one latent row per token per layer.
    "mla-absorbed-concat": CacheVariant(lambda model, n: ConcatCache(), mla={"decode": "absorbed"}),
    "mla-naive-static": CacheVariant(lambda model, n: StaticCache(n), mla={"decode": "naive"}),
    "mla-absorbed-static-qlora": CacheVariant(lambda model, n: StaticCache(n), mla={"decode": "absorbed", "q_lora_rank": 16}),
    "mla-absorbed-paged": CacheVariant(paged_view, max_batch=1, mla={"decode": "absorbed"}),
    "mla-quantized-tail": CacheVariant(lambda model, n: QuantizedCache("nvfp4", residual=n), mla={"decode": "absorbed"}),
}


@pytest.fixture
def dev():
    return kvlessons.device()


@pytest.fixture(params=sorted(STORAGE_KINDS))
def make_cache(request):
    return STORAGE_KINDS[request.param]


@pytest.fixture(params=sorted(CACHE_VARIANTS))
def variant(request):
    return CACHE_VARIANTS[request.param]


def random_ids(batch, length, vocab=50, seed=0, dev=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, length), generator=g).to(dev or "cpu")
