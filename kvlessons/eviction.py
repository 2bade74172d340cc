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

from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.nn.functional as F

from .attention import reference_attention
from .cache import HeldTensorsLayer, KVCache, _check_kv
from .generate import generate, next_token_agreement
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
        return self.recent_attention()

    def recent_attention(self, n: int | None = None) -> torch.Tensor:
        """(B, H_q, n, S): the attention of this pass's last ``n`` queries (all of them by default; SnapKV and TOVA read a few)."""
        if self.queries is None:
            raise ValueError("this policy reads attention weights: the model must call layer.observe(q) before update")
        n = self.queries.shape[2] if n is None else n
        q, k = self.queries[:, :, -n:].float(), self.keys.float()
        h_q, h_kv = q.shape[1], k.shape[1]
        # The pass's queries sit at the newest positions: query j of the last n is at newest - n + 1 + j. It sees
        # the keys at earlier or equal positions (kept keys keep theirs, which differ from head to head).
        newest = self.positions.amax(-1, keepdim=True)[..., None]  # (B, H_kv, 1, 1)
        q_pos = newest - (n - 1) + torch.arange(n, device=q.device)[:, None]  # (B, H_kv, n, 1)
        visible = (self.positions[:, :, None, :] <= q_pos).repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, n, S)
        _, weights = reference_attention(q, k, k, mask=visible, return_weights=True)  # the course's one written-out attention
        return weights


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
    w = obs.recent_attention(window)[..., :-window]  # (B, H_q, window, S - window): the window's queries, earlier keys
    b, h_kv, s = obs.positions.shape
    scores = w.mean(dim=-2)  # (B, H_q, S - window)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(b, h_kv, -1, s - window).mean(2)  # the group's query heads
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


def tova(obs: Observation) -> torch.Tensor:
    """TOVA (Oren et al. 2024): the last query's attention, averaged over every query head; the newest key is kept."""
    w = obs.recent_attention(1)[..., -1, :-1].mean(1, keepdim=True)  # (B, 1, S - 1)
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


def _highest(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (B, H_kv, keep) of the ``keep`` highest scores per head, in position order.

    Equal scores are broken by position, the older first, the same on every device
    (``topk``'s choice among ties is unspecified).
    """
    return scores.argsort(dim=-1, descending=True, stable=True)[..., :keep].sort(dim=-1).values


class EvictingLayer(HeldTensorsLayer):
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
        if ratio is not None and when == "decode":
            raise ValueError("ratio removes a fraction of the prompt once (when='prefill'); applied after every decode "
                             "step it would shrink the cache each step. For decode-time eviction give a budget")
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
            if not isinstance(scores, torch.Tensor) or scores.shape != pos.shape:
                got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise ValueError(f"a policy must return one score per held key, shaped (B, H_kv, S) = {tuple(pos.shape)}; "
                                 f"{getattr(self.policy, '__name__', 'this policy')} returned {got}")
            index = _highest(scores, keep)
        else:
            index = None
        # contiguous(): the first pass's positions are an expanded view, which would not hold its own bytes
        self._k, self._v, self._pos, self._history = k_all, v_all, pos.contiguous(), history
        if index is not None:
            self._keep(index)
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
        self._keep(_highest(mask.int(), n))  # the n held positions before `length`, in order

    def _keep(self, index: torch.Tensor) -> None:
        """Keep only the held entries at ``index`` (B, H_kv, kept), per head, in new tensors (the old ones are not written)."""
        self._k = self._k.gather(2, index[..., None].expand(-1, -1, -1, self._k.shape[3]))
        self._v = self._v.gather(2, index[..., None].expand(-1, -1, -1, self._v.shape[3]))
        self._pos = self._pos.gather(2, index)
        self._history = None if self._history is None else self._history.gather(2, index)


class EvictingCache(KVCache):
    """A cache whose layers keep ``budget`` positions per KV head (or remove a ``ratio`` of them), chosen by ``policy``.

    ``policy`` is a function from :class:`Observation` to scores, or a name in ``POLICIES``.
    With a budget at least as long as the sequence it is exactly a full cache.
    """

    supports_padding = False  # kept keys are no longer a contiguous run of positions: a padding mask cannot be sliced

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
        name = getattr(self.policy, "__name__", None) or getattr(getattr(self.policy, "func", None), "__name__", "policy")
        return f"EvictingCache({name}, {what}, when={self.when!r}, seq_len={self.seq_len}, nbytes={self.nbytes()})"


POSITION_BYTES = 4  # each kept key's original position, int32, per KV head


def evicting_cache_bytes(shape, kept: int, batch: int = 1, dtype="fp32", history: bool = False) -> int:
    """Bytes an EvictingCache holds with ``kept`` positions per KV head in every layer: K and V, plus each key's position.

    The positions (int32) are needed once anything is evicted: a slot's index then no
    longer says which position it holds, and policies (which key is a sink, which is
    recent) and ``crop`` need to know. ``history``: the policy accumulates attention
    (H2O), one float32 score more per kept key.
    """
    from .memory import kv_cache_bytes

    require_positive_int("kept", kept)
    require_positive_int("batch", batch)
    per_key = POSITION_BYTES + (4 if history else 0)
    index = len(shape.cache_layers) * shape.kv_heads * kept * batch * per_key
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


# -- what eviction costs, measured (lesson 10) ---------------------------------------------------------------


@torch.no_grad()
def attention_to_first(model, ids: torch.Tensor, first: int = 1, skip: int = 16) -> list[float]:
    """Per layer: the share of attention that queries at positions >= ``skip`` give the first ``first`` tokens.

    Averaged over those queries and every head; measured with the written-out attention
    (:func:`kvlessons.attention.reference_attention`) on the rotated q, k, v each layer computes.
    A share far above ``first / position`` (what uniform attention would give) is an attention sink.
    """
    from .attention import reference_attention

    require_positive_int("first", first)
    if ids.shape[1] <= skip:
        raise ValueError(f"ids must hold more than skip={skip} tokens, got {ids.shape[1]}")
    inputs = {}
    hooks = [block.attn.register_forward_pre_hook(lambda module, args, i=i: inputs.__setitem__(i, args[:3]))
             for i, block in enumerate(model.blocks)]
    try:
        model(ids)  # one pass; each layer's attention input noted on the way
    finally:
        for h in hooks:
            h.remove()
    shares = []
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.project(*inputs[i])
        _, weights = reference_attention(q.float(), k.float(), v.float(), return_weights=True)  # (B, H, T, S)
        shares.append(float(weights[:, :, skip:, :first].sum(-1).mean()))
    return shares


@torch.no_grad()
def compression_quality(model, ids: torch.Tensor, prompt_len: int, policy, budget: int | None = None,
                        ratio: float | None = None, reference: torch.Tensor | None = None) -> dict:
    """Compress the first ``prompt_len`` tokens once, then read the rest in one pass: how close are its next-token predictions?

    Returns top-1 agreement with the full cache over the continuation's positions, the mean
    KL(full || compressed) in nats, and the positions kept per KV head. ``reference`` (the
    full model's logits over ``ids``) can be passed to avoid recomputing it.
    """
    require_positive_int("prompt_len", prompt_len)
    if not 1 < prompt_len < ids.shape[1]:
        raise ValueError(f"prompt_len must be between 2 and len(ids) - 1 = {ids.shape[1] - 1}, got {prompt_len}")
    full = (model(ids) if reference is None else reference)[:, prompt_len:].float()
    cache = EvictingCache(policy, budget=budget, ratio=ratio, when="prefill")
    model(ids[:, :prompt_len], cache=cache)
    kept = next(iter(cache.kept_positions().values())).shape[-1]
    agreement = next_token_agreement(full, model(ids[:, prompt_len:], cache=cache).float())
    return {"top1": agreement["top1"], "kl": agreement["kl"], "kept": kept}


def quality_sweep(model, ids: torch.Tensor, prompt_len: int, policies: dict, fractions) -> dict[str, list[dict]]:
    """{policy name: [compression_quality at each kept fraction of the prompt]}, every policy on the same text."""
    with torch.inference_mode():
        reference = model(ids)
        return {name: [dict(compression_quality(model, ids, prompt_len, policy, budget=max(1, round(f * prompt_len)),
                                                reference=reference), fraction=f) for f in fractions]
                for name, policy in policies.items()}


def format_quality_sweep(sweep: dict[str, list[dict]]) -> str:
    """:func:`quality_sweep` as a table: top-1 agreement (and KL) per policy and kept fraction."""
    fractions = [r["fraction"] for r in next(iter(sweep.values()))]
    lines = [f"{'policy':<14}" + "".join(f"{'keep ' + format(f, '.0%'):>17}" for f in fractions)]
    for name, rows in sweep.items():
        lines.append(f"{name:<14}" + "".join(f"{r['top1']:>9.0%} ({r['kl']:.2f})" for r in rows))
    return "\n".join(lines)


def haystack_prompt(tokenizer, sentences: int = 90, depth: float = 0.3, code: str = "4817", seed: int = 0, device=None):
    """A chat prompt (1, T): ``sentences`` plain filler sentences with one fact planted at ``depth``, then a question about it.

    The filler is generated from a seed (buildings, colours, years), so it holds many
    similar, irrelevant numbers; the fact is the one sentence about a password. Returns
    (ids, the expected answer ``code``).
    """
    import random

    from .pretrained import chat_ids

    require_positive_int("sentences", sentences)
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    colours = ["red", "green", "blue", "grey", "white", "yellow", "brown", "orange"]
    things = ["boat", "house", "garden", "bridge", "market", "library", "station", "tower"]
    filler = [f"The {rng.choice(colours)} {rng.choice(things)} near the river was built in {rng.randint(1700, 1990)}."
              for _ in range(sentences)]
    at = round(depth * sentences)
    text = " ".join(filler[:at] + [f"The password for the archive is {code}."] + filler[at:])
    question = "What is the password for the archive? Answer with the number only."
    return chat_ids(tokenizer, f"{text}\n\n{question}", device=device), code


@torch.no_grad()
def retrieval_trial(model, tokenizer, ids: torch.Tensor, expected: str, policies: dict, budgets,
                    max_new_tokens: int = 12) -> list[dict]:
    """Answer the haystack question with the full cache and with each policy at each budget (compressed once, after the prompt).

    Rows: policy ("full cache" first), budget (None for the full cache), the answer text,
    and whether it contains ``expected``.
    """
    from .cache import ConcatCache
    from .pretrained import answer_text

    def row(name, budget, cache):
        text = answer_text(tokenizer, torch.tensor(answer_with(model, ids, cache, max_new_tokens)))
        return {"policy": name, "budget": budget, "answer": text, "correct": expected in text}

    rows = [row("full cache", None, ConcatCache())]
    for name, policy in policies.items():
        for b in budgets:
            rows.append(row(name, b, EvictingCache(policy, budget=b)))
    return rows


@torch.no_grad()
def answer_with(model, ids: torch.Tensor, cache, max_new_tokens: int = 8) -> list[int]:
    """Greedy answer ids to ``ids`` (1, T) read through ``cache`` (compressed as its policy says)."""
    return generate(model, ids, max_new_tokens, cache=cache).new_tokens[0].tolist()


@torch.no_grad()
def kvpress_kept_positions(hf_model, ids: torch.Tensor, press) -> tuple[dict[int, torch.Tensor], object]:
    """Run kvpress's ``press`` on a transformers model's prefill of ``ids`` (1, S): ({layer: (1, H_kv, kept)
    positions it kept}, the compressed DynamicCache).

    kvpress stores the kept keys, not their positions: each is found among the keys of an
    uncompressed prefill, where it must appear exactly once.
    """
    from transformers import DynamicCache

    full, past = DynamicCache(), DynamicCache()
    hf_model(ids, past_key_values=full)
    with press(hf_model):
        hf_model(ids, past_key_values=past)
    out = {}
    for i, (f, c) in enumerate(zip(full.layers, past.layers)):
        same = (c.keys[0][:, :, None, :] == f.keys[0][:, None, :, :]).all(-1)  # (H, kept, S): which prompt key it is
        if not bool((same.sum(-1) == 1).all()):
            raise ValueError(f"layer {i}: a kept key is not exactly one of the prompt's keys")
        out[i] = same.int().argmax(-1).sort(-1).values[None]
    return out, past


@torch.no_grad()
def kvpress_check(model, hf_model, ids: torch.Tensor, methods=KVPRESS_METHODS, ratios=(0.25, 0.5), next_id: int = 42) -> list[dict]:
    """For each method and ratio: layers whose kept positions (every KV head) equal kvpress's, and the next token's logit gap.

    ``model`` is the kvlessons model, ``hf_model`` transformers' with the same weights. After
    compression transformers would give the next token the position of the cache's length
    (the kept count); kvpress's own pipeline passes positions explicitly, and so does this
    check: the next token is at position S on both sides.
    """
    rows = []
    for method in methods:
        for ratio in ratios:
            press, policy = kvpress_equivalent(method, ratio)
            theirs, past = kvpress_kept_positions(hf_model, ids, press)
            cache = EvictingCache(policy, ratio=ratio)
            model(ids, cache=cache)
            mine = cache.kept_positions()
            equal = sum(torch.equal(mine[i].long().cpu(), p.cpu()) for i, p in theirs.items())
            nxt = torch.tensor([[next_id]], device=ids.device)
            expected = hf_model(nxt, past_key_values=past, position_ids=torch.tensor([[ids.shape[1]]], device=ids.device)).logits
            gap = float((model(nxt, cache=cache) - expected).abs().max())
            rows.append({"method": method, "ratio": ratio, "kept": mine[0].shape[-1], "layers_equal": equal,
                         "layers": len(theirs), "logit_gap": gap})
    return rows
