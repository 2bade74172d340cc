"""The KV-cache bugs that fill public issue trackers, each as a clearly named broken variant (lesson 07).

Every broken variant here is the real model with one thing done wrong, so the
lesson can show it breaking a generation, and the tests can show that the detector
catches it. Nothing in the rest of the package uses these.

Detector: :func:`check_cache_consistency` feeds a sequence through a cache in chunks
(prefill, then one token at a time, or a multi-token append) and compares the logits
with one uncached pass over the whole sequence; it reports the first position where
they disagree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import attend
from .cache import ConcatCache, KVCache
from .generate import feed_in_chunks, generate
from .model import TinyDecoder
from .rope import apply_rope, rope_tables
from .shape import require_positive_int

# ---------------------------------------------------------------------------------------------
# The detector
# ---------------------------------------------------------------------------------------------


@dataclass
class ConsistencyReport:
    ok: bool
    max_error: float
    first_bad_position: int | None  # first token position whose logits disagree
    chunks: list[int]

    def __str__(self) -> str:
        if self.ok:
            return f"OK: cached logits match one uncached pass (max error {self.max_error:.1e}) for chunks {self.chunks}"
        return (f"MISMATCH: cached logits differ from one uncached pass from position {self.first_bad_position} on "
                f"(max error {self.max_error:.2f}) for chunks {self.chunks}")


@torch.no_grad()
def check_cache_consistency(model, ids: torch.Tensor, chunks=None, cache: KVCache | None = None,
                            reference=None, atol: float = 1e-4) -> ConsistencyReport:
    """Feed ``ids`` (B, T) through ``cache`` in ``chunks`` and compare with one uncached pass.

    ``chunks`` defaults to a prefill of half the sequence, a 3-token append, then
    single tokens, which exercises the three ways a cache is written. ``reference``
    (default: ``model`` itself) computes the uncached logits, so a broken model can be
    checked against a correct one.
    """
    t = ids.shape[1]
    if chunks is None:
        half = max(1, t // 2)
        chunks = [half] + ([min(3, t - half)] if t - half > 0 else [])
        chunks += [1] * (t - sum(chunks))
    cache = ConcatCache() if cache is None else cache
    got = feed_in_chunks(model, ids, chunks, cache)  # checks the chunks before anything runs
    expected = (reference or model)(ids)
    error = (got - expected).abs().amax(dim=(0, 2))  # per position
    bad = (error > atol).nonzero()
    return ConsistencyReport(len(bad) == 0, error.max().item(), int(bad[0]) if len(bad) else None, list(chunks))


def first_token_divergence(a, b) -> int | None:
    """Index of the first generated token where two Generations differ (None if they agree)."""
    diff = (a.new_tokens != b.new_tokens).any(dim=0).nonzero()
    return int(diff[0]) if len(diff) else None


# ---------------------------------------------------------------------------------------------
# 1. Mask alignment
# ---------------------------------------------------------------------------------------------


def attend_is_causal_always(q, k, v, mask=None, window=None):
    """BROKEN: ``is_causal=True`` on every call. PyTorch aligns that mask to the top left, so one
    query over S cached keys sees only key 0, and T new queries see only the first T keys."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)


def attend_textbook(q, k, v, mask=None, window=None):
    """BROKEN: the textbook ``is_causal=(cache is None)``: causal when there is no cache, no mask
    otherwise. Right for one-token decode; a multi-token append lets new tokens see later new tokens."""
    g = q.shape[1] // k.shape[1]
    no_cache = q.shape[2] == k.shape[2]
    return F.scaled_dot_product_attention(q, k, v, is_causal=no_cache, enable_gqa=g > 1)


def with_attention(model, attend_fn):
    """A copy of ``model`` whose every layer attends with ``attend_fn``."""
    broken = copy.deepcopy(model)
    for block in broken.blocks:
        block.attn.attend_fn = attend_fn
    return broken


def attend_fixed(q, k, v, mask=None, window=None):
    """The fix: the bottom-right mask from kvlessons.attention (what the model uses)."""
    return attend(q, k, v, mask=mask, window=window)


# ---------------------------------------------------------------------------------------------
# 2. Position offsets
# ---------------------------------------------------------------------------------------------


class BrokenPositionsRestart(TinyDecoder):
    """BROKEN: new tokens' positions restart at 0 in every forward pass instead of at cache.seq_len."""

    def positions(self, start, new_tokens, device=None):
        return torch.arange(0, new_tokens, device=device)


class BrokenPositionsOffByOne(TinyDecoder):
    """BROKEN: after the prompt, positions start one too far (cache.seq_len + 1)."""

    def positions(self, start, new_tokens, device=None):
        shift = 1 if start > 0 else 0
        return torch.arange(start + shift, start + shift + new_tokens, device=device)


class BrokenAdvancePerLayer(TinyDecoder):
    """BROKEN: the cache's position counter advances once per layer instead of once per forward pass,
    so every later pass starts its positions ``layers`` times too far."""

    def forward(self, ids, cache=None, last_only=False, pad_mask=None):
        cache, cos, sin, x, mask = self.begin(ids, cache, pad_mask)
        for i in range(len(self.blocks)):
            x = self.run_blocks([i], x, cos, sin, cache, mask=mask)
            cache.advance(ids.shape[1])  # the bug: inside the layer loop
        return self.head(x[:, -1:] if last_only else x)


class BrokenRopeAfterCache(TinyDecoder):
    """BROKEN: keys are cached unrotated and rotary embeddings are applied after reading the cache,
    with the new tokens' angles: every cached key is rotated as if it sat at the current position."""

    def __init__(self, config=None):
        super().__init__(config)
        for block in self.blocks:
            block.attn.forward = _rope_after_cache_forward.__get__(block.attn)


def _rope_after_cache_forward(self, x, cos, sin, layer_cache=None, kv=None, mask=None, kv_input=None):
    b, t, _ = x.shape
    q = self.queries(x, cos, sin)
    k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    k_all, v_all = layer_cache.update(k, v)  # unrotated keys in the cache
    s = k_all.shape[2]
    if s == t:  # no cache before: the angles line up, so the bug hides in uncached runs
        k_all = apply_rope(k_all, cos, sin)
    else:  # the new tokens' angles, stretched over every cached key
        k_all = apply_rope(k_all, cos[..., -1:, :].expand(*cos.shape[:-2], s, cos.shape[-1]),
                           sin[..., -1:, :].expand(*sin.shape[:-2], s, sin.shape[-1]))
    out = attend(q, k_all, v_all, mask=mask, window=self.window)
    return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k_all, v_all)


def broken_variant(cls, model):
    """An instance of broken class ``cls`` with ``model``'s config and weights."""
    broken = cls(model.config).to(model.device)
    broken.load_state_dict(model.state_dict())
    return broken.eval()


# ---------------------------------------------------------------------------------------------
# 3. Stale caches
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def edit_and_continue(model, ids: torch.Tensor, position: int, new_token: int, crop: bool) -> dict:
    """Edit token ``position`` of a sequence already in a cache, then compute the rest.

    ``crop=False`` is the BROKEN way: the cache keeps the old token's K/V (and every K/V
    after it, computed from the old text), and only the edited token is re-fed at the
    end. ``crop=True`` is the fix: crop the cache to ``position`` and re-feed the edited
    suffix. Returns the next-token logits and the uncached logits of the edited text.
    """
    require_positive_int("position", position, allow_zero=True)
    if not 0 <= position < ids.shape[1]:
        raise ValueError(f"position must be inside the sequence (0..{ids.shape[1] - 1}), got {position}")
    edited = ids.clone()
    edited[:, position] = new_token
    cache = ConcatCache()
    model(ids, cache=cache)
    if crop:
        cache.crop(position)
        logits = model(edited[:, position:], cache=cache)[:, -1]
    else:
        logits = model(edited[:, position : position + 1], cache=cache)[:, -1]
    expected = model(edited)[:, -1]
    return {"logits": logits, "expected": expected, "max_error": (logits - expected).abs().max().item()}


class BrokenNoTransaction(TinyDecoder):
    """BROKEN: the forward pass writes each layer's cache as it goes, with no way back (as most
    textbook code does). Interrupt it half way and the early layers hold one more append than
    ``cache.seq_len`` says; every later pass reads keys at the wrong positions."""

    def forward(self, ids, cache=None, last_only=False, pad_mask=None):
        cache, cos, sin, x, mask = self.begin(ids, cache, pad_mask)
        x = self.run_blocks(range(len(self.blocks)), x, cos, sin, cache, mask=mask)  # no transaction
        cache.advance(ids.shape[1])
        return self.head(x[:, -1:] if last_only else x)


@torch.no_grad()
def interrupted_pass(model, ids: torch.Tensor, prefill: int, interrupt_after_layer: int) -> dict:
    """Prefill ``prefill`` tokens, then interrupt the next pass (as Ctrl-C would) right after layer
    ``interrupt_after_layer`` wrote its cache; then re-run that pass, as a learner re-runs the
    cell, and read the rest of ``ids``.

    Returns the tokens each cache layer holds just after the interruption, ``cache.seq_len``
    then, and the largest logit difference of the resumed run from one uncached pass.
    """
    require_positive_int("prefill", prefill)
    if not 0 < prefill < ids.shape[1]:
        raise ValueError(f"prefill must be between 1 and {ids.shape[1] - 1}, got {prefill}")
    if not 0 <= interrupt_after_layer < len(model.blocks):
        raise ValueError(f"interrupt_after_layer must be in [0, {len(model.blocks)}), got {interrupt_after_layer}")

    def ctrl_c(*_):
        raise KeyboardInterrupt

    cache = ConcatCache()
    model(ids[:, :prefill], cache=cache)
    handle = model.blocks[interrupt_after_layer].register_forward_hook(ctrl_c)
    try:
        model(ids[:, prefill:], cache=cache)
    except KeyboardInterrupt:
        pass
    finally:
        handle.remove()
    held = [layer.seq_len for layer in cache.layers()]
    seq_len = cache.seq_len
    resumed = model(ids[:, prefill:], cache=cache)  # the cell, run again
    expected = model(ids)[:, prefill:]
    return {"layer_tokens": held, "seq_len": seq_len, "max_error": (resumed - expected).abs().max().item()}


# ---------------------------------------------------------------------------------------------
# 4. Left-padded batches
# ---------------------------------------------------------------------------------------------


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D prompts of different lengths, padded on the left: (ids (B, L), pad_mask (B, L))."""
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool, device=prompts[0].device)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        ids[i, longest - len(p):] = p
        mask[i, longest - len(p):] = True
    return ids, mask


@torch.no_grad()
def padded_batch_agreement(model, prompts: list[torch.Tensor], max_new_tokens: int, mode: str = "fixed") -> list[bool]:
    """Generate a left-padded batch and compare each row with its prompt generated alone.

    mode "fixed": positions from the pad mask and pads masked out (the right way);
    "no_mask": the pads are attended to as if they were text (BROKEN);
    "positions_ignore_padding": pads masked, but positions count the pads (each row
    starts at its pad count instead of 0).
    """
    if mode not in ("fixed", "no_mask", "positions_ignore_padding"):
        raise ValueError(f"mode must be 'fixed', 'no_mask' or 'positions_ignore_padding', got {mode!r}")
    ids, mask = left_pad(prompts)
    if mode == "fixed":
        batch = generate(model, ids, max_new_tokens, cache=ConcatCache(), pad_mask=mask)
    elif mode == "no_mask":
        batch = generate(model, ids, max_new_tokens, cache=ConcatCache())
    else:
        batch = _generate_positions_ignore_padding(model, ids, mask, max_new_tokens)
    alone = [generate(model, p[None], max_new_tokens, cache=ConcatCache()).new_tokens[0] for p in prompts]
    return [torch.equal(batch.new_tokens[i], a) for i, a in enumerate(alone)]


def _generate_positions_ignore_padding(model, ids, mask, max_new_tokens):
    # Pads masked correctly, but positions 0..L-1 for every row, pads included.
    class PadBlindPositions(type(model)):
        def begin(self, ids_, cache, pad_mask=None):
            cache, cos, sin, x, attn_mask = super().begin(ids_, cache, pad_mask)
            if pad_mask is not None:
                start = cache.seq_len
                positions = torch.arange(start, start + ids_.shape[1], device=ids_.device)
                cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
                cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            return cache, cos, sin, x, attn_mask

    blind = broken_variant(PadBlindPositions, model)
    return generate(blind, ids, max_new_tokens, cache=ConcatCache(), pad_mask=mask)


# ---------------------------------------------------------------------------------------------
# 5. Quadratic copying
# ---------------------------------------------------------------------------------------------


def expected_bytes_written(cache_kind: str, steps: int, bytes_per_token: int, prompt_len: int = 1) -> int:
    """Bytes a cache writes over ``steps`` one-token decode steps after a ``prompt_len`` prefill, by the formula.

    The measurement to compare it with is ``cache.bytes_written()``, which the layers count as they write.

    "concat": ``torch.cat`` allocates and fills a new tensor holding everything at every
    step, so step i writes (prompt_len + i) tokens' worth: quadratic in the steps.
    "static": each step writes only the new token: linear.
    """
    require_positive_int("steps", steps, allow_zero=True)
    require_positive_int("bytes_per_token", bytes_per_token)
    if cache_kind == "concat":
        return bytes_per_token * (prompt_len + sum(prompt_len + i for i in range(1, steps + 1)))
    if cache_kind == "static":
        return bytes_per_token * (prompt_len + steps)
    raise ValueError(f"cache_kind must be 'concat' or 'static', got {cache_kind!r}")


def append_cost(steps: int, kv_heads: int = 8, head_dim: int = 128, repeats: int = 5, dtype=torch.float32,
                device=None) -> dict:
    """Seconds per one-token append to one layer's cache: ``torch.cat`` (ConcatLayer) vs a preallocated StaticLayer.

    Only the appends are timed, no model around them: each side starts from an empty
    layer and appends ``steps`` tokens, K and V of shape (1, kv_heads, 1, head_dim) each,
    one at a time; the two sides are interleaved over ``repeats`` rounds after a warm-up
    round (:func:`kvlessons.bench.interleaved_decode`). The preallocated side allocates its
    buffer on its first append, inside the timer.

    Returns ``{"steps", "bytes_per_token"`` (K and V of one token), ``"bytes_written"``
    (side: bytes its layer counted as written in the last repeat; compare
    :func:`expected_bytes_written`), ``"same_keys"`` (both layers ended holding the same
    keys and values), ``"runs"``: interleaved_decode's runs, keyed "torch.cat" and
    "preallocated", seconds per append}.
    """
    from .bench import interleaved_decode
    from .cache import ConcatLayer, StaticLayer
    from ._device import device as default_device

    require_positive_int("steps", steps)
    require_positive_int("kv_heads", kv_heads)
    require_positive_int("head_dim", head_dim)
    dev = torch.device(device) if device is not None else default_device()
    g = torch.Generator().manual_seed(steps)
    ks = torch.randn(steps, 1, kv_heads, 1, head_dim, generator=g).to(device=dev, dtype=dtype)
    vs = torch.randn(steps, 1, kv_heads, 1, head_dim, generator=g).to(device=dev, dtype=dtype)
    marks = torch.arange(steps).view(1, steps)  # what each step returns: which append it was
    last = {}  # side -> the layer of its latest repeat

    def appending(name, new_layer):
        def start():
            layer = last[name] = new_layer()
            appends = iter(range(steps))

            @torch.inference_mode()
            def step():
                i = next(appends)
                layer.update(ks[i], vs[i])
                return marks[:, i : i + 1]

            return step

        return start

    runs = interleaved_decode({"torch.cat": appending("torch.cat", ConcatLayer),
                               "preallocated": appending("preallocated", lambda: StaticLayer(steps))},
                              steps, repeats, dev)
    cat, pre = last["torch.cat"], last["preallocated"]
    return {
        "steps": steps,
        "bytes_per_token": ks[0].nbytes + vs[0].nbytes,
        "bytes_written": {"torch.cat": cat.bytes_written, "preallocated": pre.bytes_written},
        "same_keys": torch.equal(cat.keys, pre.keys) and torch.equal(cat.values, pre.values),
        "runs": runs,
    }


def decode_cost(model, prompt_len: int, new_tokens: int, repeats: int = 5) -> dict:
    """Seconds per greedy decode step of ``model`` with a ConcatCache against a StaticCache, interleaved.

    The same random ``prompt_len``-token prompt is prefilled untimed into each cache, then
    ``new_tokens`` one-token greedy steps are timed, the two sides interleaved over
    ``repeats`` rounds (:func:`kvlessons.bench.interleaved_decode`). Returns its runs, keyed
    "torch.cat" and "preallocated"; :func:`kvlessons.bench.format_decode_comparison` prints them.
    """
    from .bench import _random_ids, greedy_stepper, interleaved_decode

    require_positive_int("prompt_len", prompt_len)
    require_positive_int("new_tokens", new_tokens)
    ids = _random_ids(model, 1, prompt_len, seed=prompt_len)
    starts = {"torch.cat": lambda: greedy_stepper(model, ids, cache=ConcatCache()),
              "preallocated": lambda: greedy_stepper(model, ids, prompt_len + new_tokens)}
    return interleaved_decode(starts, new_tokens, repeats, model.device)
