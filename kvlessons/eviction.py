"""Shrinking the cache along the sequence: keep a budget of positions, chosen by a policy (lesson 10).

An :class:`EvictingCache` is a cache whose layers keep at most a budget of positions per
KV head. After a forward pass has attended over everything (the held positions and the
new ones), the layer scores every position with a **policy** and keeps the highest
scores. Kept keys stay rotated at their original positions: nothing is re-rotated, and
the next token still gets position ``cache.seq_len`` (the count of every token seen),
not the count of tokens held.

A policy is a function ``score(obs) -> (B, H_kv, S)``: higher is kept. ``obs`` is an
:class:`Observation` of the layer at the end of a pass: its keys and values, the
original positions of each head's keys, and this pass's queries, with the attention
weights computed on request. The policies here are short on purpose:

- :func:`recency` (a sliding window), :func:`sinks_and_window` (StreamingLLM);
- :func:`key_norm` (low key norm = important, kvpress's "knorm");
- :func:`snapkv` (attention from the prompt's last queries, pooled), :func:`tova`
  (the last query's attention, averaged over heads);
- :func:`heavy_hitters` (H2O: attention accumulated over every query so far).

When: ``when="prefill"`` compresses once, after the pass that fills an empty cache (what
kvpress does); ``when="decode"`` keeps the budget after every pass, generation included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.nn.functional as F

from .attention import causal_mask
from .cache import KVCache, LayerCache, _check_kv
from .shape import require_positive_int

WHEN = ("prefill", "decode")


@dataclass
class Observation:
    """What a policy sees at the end of a pass, for one layer.

    keys, values: (B, H_kv, S, D), every position the layer holds after the pass (rotated keys).
    positions:    (B, H_kv, S) the original position of each held key (kept keys keep theirs).
    queries:      (B, H_q, T, D) this pass's rotated queries (the T newest positions).
    history:      (B, H_kv, S) attention each held key has received so far, summed over queries
                  and the heads of its group (only for a policy with ``uses_history``), else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    history: torch.Tensor | None = None

    @cached_property
    def attention(self) -> torch.Tensor:
        """(B, H_q, T, S): softmax attention of this pass's queries over the held keys, causal (computed once, on request)."""
        if self.queries is None:
            raise ValueError("this policy reads attention weights: the model must call layer.observe(q) before update")
        q, k = self.queries.float(), self.keys.float()
        b, h_q, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        scores = q.reshape(b, h_kv, (h_q // h_kv) * t, d) @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.view(b, h_q, t, s)
        # query i (position P - T + i) sees keys at earlier or equal positions; positions differ per head
        q_pos = self.positions.amax(-1, keepdim=True)[..., None] - (t - 1) + torch.arange(t, device=q.device)[:, None]
        visible = self.positions[:, :, None, :] <= q_pos  # (B, H_kv, T, S)
        visible = visible.repeat_interleave(h_q // h_kv, dim=1)
        return scores.masked_fill(~visible, float("-inf")).softmax(-1)


# -- the policies ---------------------------------------------------------------------------------------


def recency(obs: Observation) -> torch.Tensor:
    """A sliding window: the newest positions score highest."""
    return obs.positions.float()


def sinks_and_window(obs: Observation, n_sink: int = 4) -> torch.Tensor:
    """StreamingLLM (Xiao et al. 2023): the first ``n_sink`` positions (the attention sinks), then the newest."""
    score = obs.positions.float()
    return score.masked_fill(obs.positions < n_sink, float("inf"))


def key_norm(obs: Observation) -> torch.Tensor:
    """Keys with a small L2 norm are kept (Devoto et al. 2024; kvpress's KnormPress): the score is minus the norm."""
    return -torch.linalg.vector_norm(obs.keys.float(), dim=-1)


def snapkv(obs: Observation, window: int = 64, kernel: int = 5) -> torch.Tensor:
    """SnapKV (Li et al. 2024): how much the last ``window`` queries attend to each earlier key, pooled over ``kernel`` neighbours.

    Averaged over the window's queries and over the query heads of each KV head; the
    window's own keys are always kept (they score above everything else). A pass with
    fewer than ``window`` queries (a decode step) uses the queries it has.
    """
    window = min(window, obs.queries.shape[2], obs.keys.shape[2] - 1)
    w = obs.attention[..., -window:, :-window]  # (B, H_q, window, S - window): the window's queries, earlier keys
    b, h_kv, s = obs.positions.shape
    scores = w.mean(dim=-2)  # (B, H_q, S - window)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(b, h_kv, -1, s - window).mean(2)  # the group's query heads
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


def tova(obs: Observation) -> torch.Tensor:
    """TOVA (Oren et al. 2024): the last query's attention, averaged over every query head; the newest key is kept."""
    w = obs.attention[..., -1, :-1].mean(1, keepdim=True)  # (B, 1, S - 1)
    scores = w.expand(-1, obs.positions.shape[1], -1)
    return F.pad(scores, (0, 1), value=scores.max().item() + 1)


def heavy_hitters(obs: Observation, recent: int = 8) -> torch.Tensor:
    """H2O (Zhang et al. 2023): keys that have received the most attention so far, plus the ``recent`` newest."""
    score = obs.history.clone()
    newest = obs.positions.amax(-1, keepdim=True)
    return score.masked_fill(obs.positions > newest - recent, float("inf"))


heavy_hitters.uses_history = True

POLICIES = {"window": recency, "sinks+window": sinks_and_window, "key norm": key_norm, "SnapKV": snapkv,
            "TOVA": tova, "H2O": heavy_hitters}


# -- the cache --------------------------------------------------------------------------------------------


def kept_count(held: int, budget: int | None = None, ratio: float | None = None) -> int:
    """Positions to keep out of ``held``: ``budget`` (at most ``held``), or ``held`` x (1 - ratio) rounded down (at least 1)."""
    if ratio is not None:
        return max(1, int(held * (1 - ratio)))
    return min(held, budget)


def _check_budget(budget, ratio) -> None:
    if (budget is None) == (ratio is None):
        raise ValueError("give exactly one of budget (positions kept per KV head) and ratio (fraction removed)")
    if budget is not None:
        require_positive_int("budget", budget)
    elif isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"ratio must be a fraction removed, 0 <= ratio < 1, got {ratio!r}")


class EvictingLayer(LayerCache):
    """One layer that keeps at most a budget of positions per KV head, chosen by ``policy``.

    ``update`` returns everything held plus the new keys, so the pass attends over all
    of them; then the layer keeps the positions the policy scores highest. Tensors are
    replaced, never written into, so a failed pass is undone by the default snapshot.
    """

    def __init__(self, policy, budget: int | None = None, ratio: float | None = None, when: str = "prefill"):
        super().__init__()
        _check_budget(budget, ratio)
        if when not in WHEN:
            raise ValueError(f"when must be one of {WHEN}, got {when!r}")
        self.policy, self.budget, self.ratio, self.when = policy, budget, ratio, when
        self._k = self._v = None  # (B, H_kv, held, D)
        self._pos = None  # (B, H_kv, held) int32: original positions
        self._history = None  # (B, H_kv, held): attention received (policies with uses_history)
        self._queries = None  # this pass's queries, from observe()

    def observe(self, q: torch.Tensor) -> None:
        """The pass's rotated queries (B, H_q, T, D), given before ``update`` (attention-based policies need them)."""
        self._queries = q

    @property
    def held(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    @property
    def keys(self):
        return self._k

    @property
    def values(self):
        return self._v

    @property
    def positions(self) -> torch.Tensor | None:
        """(B, H_kv, held): the original position of every held key, per head."""
        return self._pos

    def update(self, k, v):
        if v is None:
            raise ValueError("v must be a tensor: an evicting layer stores keys and values")
        _check_kv(k, v, self._k)
        b, h, t, _ = k.shape
        new_pos = torch.arange(self.seq_len, self.seq_len + t, device=k.device, dtype=torch.int32).expand(b, h, t)
        k_all = k if self._k is None else torch.cat([self._k, k], dim=2)
        v_all = v if self._v is None else torch.cat([self._v, v], dim=2)
        pos = new_pos if self._pos is None else torch.cat([self._pos, new_pos], dim=2)
        history = None
        uses_history = getattr(self.policy, "uses_history", False)
        obs = Observation(k_all, v_all, pos, self._queries)
        if uses_history:
            g = obs.attention.shape[1] // h
            got = obs.attention.view(b, h, g, t, -1).sum(dim=(2, 3))  # (B, H_kv, S): this pass's attention per key
            old = torch.zeros(b, h, t, device=k.device) if self._history is None else F.pad(self._history, (0, t))
            history = old + got
            obs.history = history
        compress = self.when == "decode" or (self.seq_len == 0 and t > 1)
        keep = kept_count(k_all.shape[2], self.budget, self.ratio) if compress else k_all.shape[2]
        if keep < k_all.shape[2]:
            scores = self.policy(obs)
            index = scores.topk(keep, dim=-1).indices.sort(dim=-1).values  # kept, in position order
            self._k = k_all.gather(2, index[..., None].expand(-1, -1, -1, k.shape[3]))
            self._v = v_all.gather(2, index[..., None].expand(-1, -1, -1, v.shape[3]))
            self._pos = pos.gather(2, index)
            self._history = None if history is None else history.gather(2, index)
        else:
            self._k, self._v, self._pos, self._history = k_all, v_all, pos.clone(), history
        self._queries = None
        self.bytes_written += k_all.nbytes + v_all.nbytes
        self.seq_len += t
        return k_all, v_all

    def reset(self):
        self._k = self._v = self._pos = self._history = self._queries = None
        self.seq_len = 0

    def _keep_first(self, length):
        """Keep the held positions before ``length`` (per head, so every head must hold the same count)."""
        mask = self._pos < length
        counts = mask.sum(-1)
        n = int(counts.flatten()[0])
        if not bool((counts == n).all()):
            raise ValueError("cannot crop: the heads hold different numbers of positions before that length")
        index = mask.int().argsort(dim=-1, descending=True, stable=True)[..., :n].sort(dim=-1).values
        self._k = self._k.gather(2, index[..., None].expand(-1, -1, -1, self._k.shape[3]))
        self._v = self._v.gather(2, index[..., None].expand(-1, -1, -1, self._v.shape[3]))
        self._pos = self._pos.gather(2, index)
        self._history = None if self._history is None else self._history.gather(2, index)


class EvictingCache(KVCache):
    """A cache whose layers keep ``budget`` positions per KV head (or remove a ``ratio`` of them), chosen by ``policy``.

    ``policy`` is a function from :class:`Observation` to scores, or a name in ``POLICIES``.
    With a budget at least as long as the sequence it is exactly a full cache.
    """

    def __init__(self, policy="sinks+window", budget: int | None = None, ratio: float | None = None, when: str = "prefill"):
        super().__init__()
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"policy must be a function or one of {list(POLICIES)}, got {policy!r}")
            policy = POLICIES[policy]
        if not callable(policy):
            raise ValueError(f"policy must be a function of an Observation, got {policy!r}")
        EvictingLayer(policy, budget, ratio, when)  # validates now, not at the first write
        self.policy, self.budget, self.ratio, self.when = policy, budget, ratio, when

    def new_layer(self, window=None):
        if window is not None:
            raise ValueError("EvictingCache stores full-attention layers only (window must be None)")
        return EvictingLayer(self.policy, self.budget, self.ratio, self.when)

    def kept_positions(self) -> dict[int, torch.Tensor]:
        """{layer index: (B, H_kv, held) original positions kept}, for every layer that holds anything."""
        return {i: layer.positions for i, layer in sorted(self._layers.items()) if layer.positions is not None}

    def __repr__(self):
        what = f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio}"
        return f"EvictingCache({self.policy.__name__}, {what}, when={self.when!r}, seq_len={self.seq_len}, nbytes={self.nbytes()})"


POSITION_BYTES = 4  # each kept key's original position, int32, per KV head


def evicting_cache_bytes(shape, kept: int, batch: int = 1, dtype="fp32") -> int:
    """Bytes an EvictingCache holds with ``kept`` positions per KV head in every layer: K and V, plus each key's position.

    The positions (int32) are what lets a policy tell a sink from a recent token, and
    ``crop`` find where to cut, after the keys have left their original order of arrival.
    """
    from .memory import kv_cache_bytes

    require_positive_int("kept", kept)
    require_positive_int("batch", batch)
    index = len(shape.cache_layers) * shape.kv_heads * kept * batch * POSITION_BYTES
    return kv_cache_bytes(shape, kept, batch, dtype) + index


KVPRESS_METHODS = ("StreamingLLM", "knorm", "SnapKV", "TOVA")


def kvpress_equivalent(method: str, ratio: float, n_sink: int = 4, window: int = 16, kernel: int = 5):
    """(kvpress press, the kvlessons policy that should keep the same positions) for ``method`` at ``ratio``.

    The cross-check's pairs (tests and lesson 10): StreamingLLMPress and :func:`sinks_and_window`,
    KnormPress and :func:`key_norm`, SnapKVPress and :func:`snapkv`, TOVAPress and :func:`tova`.
    Needs kvpress (``pip install -r requirements.txt`` installs it).
    """
    import kvpress

    _check_budget(None, ratio)
    if method == "StreamingLLM":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=n_sink), partial(sinks_and_window, n_sink=n_sink)
    if method == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio), key_norm
    if method == "SnapKV":
        return (kvpress.SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel),
                partial(snapkv, window=window, kernel=kernel))
    if method == "TOVA":
        return kvpress.TOVAPress(compression_ratio=ratio), tova
    raise ValueError(f"method must be one of {KVPRESS_METHODS}, got {method!r}")
