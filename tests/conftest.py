"""Shared fixtures: the device under test and every cache variant on the common interface."""

import pytest
import torch

import kvlessons
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.model import TinyConfig, TinyDecoder

# name -> factory(max_tokens) for every cache variant; later lessons add theirs here so the
# "cached equals uncached" tests cover them too.
CACHE_VARIANTS = {
    "concat": lambda max_tokens: ConcatCache(),
    "static": lambda max_tokens: StaticCache(max_tokens),
}

# (q_heads, kv_heads): MHA, GQA, MQA
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture
def dev():
    return kvlessons.device()


@pytest.fixture(params=sorted(CACHE_VARIANTS))
def make_cache(request):
    return CACHE_VARIANTS[request.param]


def small_model(q_heads=4, kv_heads=2, seed=0, dev=None, **overrides):
    """A tiny seeded float32 model, small enough for many parametrized cases."""
    cfg = dict(vocab_size=50, hidden_size=32, layers=2, q_heads=q_heads, kv_heads=kv_heads, head_dim=8, mlp_hidden=48, seed=seed)
    cfg.update(overrides)
    return TinyDecoder(TinyConfig(**cfg)).to(dev or "cpu").eval()


def random_ids(batch, length, vocab=50, seed=0, dev=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, length), generator=g).to(dev or "cpu")


def feed_in_chunks(model, ids, sizes, cache):
    """Logits of ``ids`` fed through ``cache`` in pieces of ``sizes`` tokens, concatenated (B, T, vocab)."""
    pieces, start = [], 0
    with torch.inference_mode():
        for size in sizes:
            pieces.append(model(ids[:, start : start + size], cache=cache))
            start += size
    return torch.cat(pieces, dim=1)
