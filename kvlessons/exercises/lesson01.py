"""Lesson 01's exercises: count the K/V work with and without a cache, and write the cache yourself.

01.1 is a count on paper (two NumericExercises). 01.2 is a class the learner writes for
:class:`kvlessons.scaffold.TinyModel`; :func:`check_my_cache` runs it the way the course's
detector does (a prefill, a multi-token append, then single tokens, each compared with one
uncached pass), and when the logits disagree it looks at what each method returned to name
the classic mistake behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import scaffold
from ..generate import expected_kv_work
from ..memory import measured_bytes
from .core import Feedback, NumericExercise, as_ints, check_parts


__all__ = [
    "KV_WORK_PROMPT", "KV_WORK_NEW_TOKENS", "KV_WORK_RECOMPUTE", "KV_WORK_CACHED", "check_kv_work",
    "MY_CACHE_HINTS", "my_cache_hint", "check_my_cache",
]


# ---------------------------------------------------------------------------------------------
# 01.1: the K/V work of a generation, recomputed and cached
# ---------------------------------------------------------------------------------------------

KV_WORK_PROMPT, KV_WORK_NEW_TOKENS = 200, 50


def _kv_work_exercises() -> tuple[NumericExercise, NumericExercise]:
    p, n = KV_WORK_PROMPT, KV_WORK_NEW_TOKENS
    slow, fast = expected_kv_work(p, n, cached=False), expected_kv_work(p, n, cached=True)
    recompute = NumericExercise(
        name="kv_work_recompute",
        question=f"A {p}-token prompt, {n} new tokens, no cache: token-positions whose K/V one layer computes?",
        answer=slow,
        unit="token-positions",
        rel_tol=0,  # a count: 11,275 (off by one) is 0.4% away and still wrong
        explanation=f"step i (0..{n - 1}) runs over the {p} prompt tokens and the i tokens written so far: "
        f"{n} x {p} + (0 + 1 + ... + {n - 1}) = {n * p:,} + {n * (n - 1) // 2:,} = {slow:,}.",
        mistakes=[
            (n * (n + 1) // 2, f"That counts the new tokens only. Every step without a cache re-reads the {p} prompt "
                               f"tokens too: the first step alone computes K/V for {p} positions."),
            (n * (n - 1) // 2, f"That counts the new tokens only. Every step without a cache re-reads the {p} prompt "
                               f"tokens too: the first step alone computes K/V for {p} positions."),
            ((p + n) * (p + n + 1) // 2, f"That is 1 + 2 + ... + {p + n}, as if the prompt were also written one token "
                                         f"at a time. The first step reads all {p} prompt tokens at once."),
            ((p + n - 1) * (p + n) // 2, f"That is 1 + 2 + ... + {p + n - 1}, as if the prompt were also written one token "
                                         f"at a time. The first step reads all {p} prompt tokens at once."),
            (n * p + n * (n + 1) // 2, f"Off by one: the steps see {p}, {p + 1}, ..., {p + n - 1} tokens, not {p + 1} .. "
                                       f"{p + n}. The token a step writes is only fed to the model by the next step, "
                                       f"and after the last step there is none."),
            (n * (p + n), f"Not every step sees all {p + n} tokens: step i sees the prompt plus the i tokens written "
                          f"before it."),
            (n * p, f"That is the prompt re-read {n} times, but each step also re-reads the tokens generated so far."),
            (2 * slow, "Twice the answer: count token-positions, each of which gets one key and one value "
                       "(and this is per layer)."),
        ],
        hints=[
            "Without a cache, each step runs the model over every token so far. How many tokens does the first step "
            "see? The last?",
            f"The first step sees the {p} prompt tokens; step i sees {p} + i; the last step (i = {n - 1}) sees "
            f"{p + n - 1}, because the token it writes has not been fed yet. Add them up.",
            f"{n} x {p} + (0 + 1 + ... + {n - 1}) = {n * p:,} + {n * (n - 1) // 2:,} = {slow:,}.",
        ],
    )
    cached = NumericExercise(
        name="kv_work_cached",
        question="The same generation with a cache: token-positions whose K/V one layer computes?",
        answer=fast,
        unit="token-positions",
        rel_tol=0,
        explanation=f"the prompt once ({p}), then each later step feeds one token, the one the step before wrote: "
        f"{p} + {n - 1} = {fast}. The last token written is never fed, so its K/V is never needed.",
        mistakes=[
            (p + n, f"Off by one: the {n}th new token is written by the last step and never fed back, so its K/V is "
                    f"never computed. {p} + {n - 1}."),
            (n, f"You left out the prompt: the prefill computes K/V for all {p} prompt tokens, once."),
            (n - 1, f"You left out the prompt: the prefill computes K/V for all {p} prompt tokens, once."),
            (p, "That is the prefill alone. Every later step feeds one new token, whose K/V is computed then."),
            (2 * fast, "Twice the answer: count token-positions, each of which gets one key and one value."),
            (slow, "That is the recompute count; with a cache each token's K/V is computed exactly once."),
        ],
        hints=[
            "With a cache, a token's K/V is computed once, in the pass where the token is fed to the model. "
            "Which tokens are ever fed?",
            f"The prefill feeds the {p} prompt tokens at once; after that each step feeds the token the step "
            f"before wrote. The {n}th new token is written last and never fed.",
            f"{p} + {n - 1} = {fast}.",
        ],
    )
    return recompute, cached


KV_WORK_RECOMPUTE, KV_WORK_CACHED = _kv_work_exercises()




def check_kv_work(recompute, cached) -> Feedback:
    """Exercise 01.1: K/V token-positions one layer computes for 50 new tokens after a 200-token prompt."""
    verdict = check_parts(("Without a cache", KV_WORK_RECOMPUTE, recompute), ("With a cache", KV_WORK_CACHED, cached))
    message = verdict.message
    if verdict.correct:
        ratio = KV_WORK_RECOMPUTE.answer / KV_WORK_CACHED.answer
        message += (f"\n{ratio:.0f}x fewer with the cache; generate.measure_kv_work(model, [{KV_WORK_NEW_TOKENS}], "
                    f"prompt_len={KV_WORK_PROMPT}) counts the same on the model.")
    return Feedback(verdict.correct, message)


# ---------------------------------------------------------------------------------------------
# 01.2: write the cache yourself
# ---------------------------------------------------------------------------------------------

# Tiered hints for each TODO of the exercise (1: update, 2: positions and advance, 3: mask, 4: reset).
MY_CACHE_HINTS = {
    1: [
        "update() receives this pass's keys and values only, (B, H_kv, t, D). Attention needs every key so far: "
        "keep one entry per layer (self.keys[layer]) and put the new ones after what it holds.",
        "Rotate the new keys first, at their own positions: k = scaffold.rotate(k, cos, sin). A key's rotation "
        "belongs to the position it was made at and never changes, so the cache stores rotated keys. Then join "
        "along dim 2, the tokens of (B, H_kv, T, D).",
        "k = scaffold.rotate(k, cos, sin); if self.keys[layer] is not None: k = torch.cat([self.keys[layer], k], "
        "dim=2) (the same for v); self.keys[layer], self.values[layer] = k, v; return k, v",
    ],
    2: [
        "Positions number the tokens of the whole sequence. With seq_len tokens held, where does the first new "
        "token sit?",
        "positions = torch.arange(self.seq_len, self.seq_len + t). The counter moves by t once per forward pass: "
        "in advance(), which the model calls after its last layer, never in update(), which runs in every layer.",
        "def advance(self, t): self.seq_len += t",
    ],
    3: [
        "New query i sits at position seq_len + i and may look at the keys at positions 0 .. seq_len + i. "
        "Rows are the t queries, columns the seq_len + t keys. With t == 1 it may look at everything.",
        "torch.ones(t, t).tril(), like is_causal=True, puts the diagonal in the top-left corner, which is right only "
        "when nothing is cached. Shift it right by the seq_len cached keys: the bottom-right corner.",
        "mask = torch.ones(t, self.seq_len + t, dtype=torch.bool).tril(diagonal=self.seq_len)",
    ],
    4: [
        "After reset() the cache must behave exactly like a new one: what does __init__ set?",
        "self.keys = [None] * len(self.keys); self.values = [None] * len(self.values); self.seq_len = 0",
    ],
}


def my_cache_hint(todo: int, level: int = 1) -> str:
    """Hint ``level`` (1 = gentlest, the last is the code) for TODO ``todo`` (1-4) of exercise 01.2."""
    if todo not in MY_CACHE_HINTS:
        raise ValueError(f"todo must be one of 1, 2, 3, 4 (update, positions, mask, reset); got {todo!r}")
    hints = MY_CACHE_HINTS[todo]
    level = min(max(int(level), 1), len(hints))
    return f"TODO {todo}, hint {level}/{len(hints)}: {hints[level - 1]}"


def _more(todo: int) -> str:
    return f"More: exercises.my_cache_hint({todo}, level) for level 1-{len(MY_CACHE_HINTS[todo])}."


# The detector's schedule: a prefill, a multi-token append, single tokens; then reset and a second prompt.
CHUNKS = (5, 3, 1, 1, 1, 1)
SECOND_PROMPT = (4, 3)
ATOL = 1e-4


class _LearnerError(Exception):
    """An exception raised inside one of the learner's methods (or a method that is missing)."""

    def __init__(self, method: str, error: BaseException):
        super().__init__(method, error)
        self.method, self.error = method, error


def _call(cache, method, *args):
    try:
        fn = getattr(cache, method)
    except AttributeError as err:
        raise _LearnerError(method, err) from None
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
        raise _LearnerError(method, err) from None


@dataclass
class _Pass:
    """What one forward pass through the learner's cache did."""

    held: int  # tokens truly held before the pass (what the positions should continue from)
    t: int  # tokens fed
    stage: str  # in words, for the feedback
    positions: list | None = None  # as returned by positions_and_mask
    mask: object = None  # the mask returned (a tensor or None)
    planned: bool = False  # whether positions_and_mask returned at all
    keys_returned: list = field(default_factory=list)  # tokens in the keys update returned, per layer
    seq_len_before: object = None  # the learner's counter before the pass, if it has one
    seq_len_after: object = None  # and after it


class _Watched:
    """The learner's cache as the model sees it: every call passes through, and is noted down."""

    def __init__(self, cache, record: _Pass | None = None):
        self.cache, self.record = cache, record

    def positions_and_mask(self, t):
        plan = _call(self.cache, "positions_and_mask", t)
        if not isinstance(plan, (tuple, list)) or len(plan) != 2:
            raise _LearnerError("positions_and_mask", TypeError(f"it must return (positions, mask), got {type(plan).__name__}"))
        positions, mask = plan
        if self.record is not None:
            self.record.positions = as_ints(positions)
            self.record.mask = mask.detach().clone() if isinstance(mask, torch.Tensor) else mask
            self.record.planned = True
        return positions, mask

    def update(self, index, k, v, cos, sin):
        out = _call(self.cache, "update", index, k, v, cos, sin)
        if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(x, torch.Tensor) for x in out):
            raise _LearnerError("update", TypeError(f"it must return (keys, values), two tensors, got {type(out).__name__}"))
        if self.record is not None:
            self.record.keys_returned.append(out[0].shape[2] if out[0].dim() == 4 else None)
        return out

    def advance(self, t):
        return _call(self.cache, "advance", t)


@dataclass
class _Run:
    passes: list
    cache: object = None
    failed: _Pass | None = None
    error: BaseException | None = None  # what was raised in the failing pass
    method: str | None = None  # the learner's method that raised, if it was one
    first_bad: int | None = None
    max_error: float = 0.0
    nan: bool = False  # some cached logits were NaN (a query that may look at no key, for one)


def _ids(batch, length, seed, vocab):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _stage(held, t, second=False):
    if second:
        return f"the second prompt after reset() ({t} tokens into the emptied cache)" if held == 0 else \
               f"the second prompt's next {t} tokens"
    if held == 0:
        return f"the prefill ({t} tokens into an empty cache)"
    if t > 1:
        return f"the {t}-token append after {held} cached tokens"
    return f"decoding token {held} (one token after {held} cached)"


@torch.no_grad()
def _detect(model, cache_class) -> _Run:
    """Feed two sequences through one learner cache in chunks, with reset() between; stop at the first disagreement."""
    vocab = model.config.vocab_size
    first, second = _ids(2, sum(CHUNKS), 0, vocab), _ids(2, sum(SECOND_PROMPT), 1, vocab)
    run = _Run(passes=[])
    try:
        run.cache = cache_class(model.config.layers)
    except Exception as err:  # noqa: BLE001
        run.error, run.method = err, "__init__"
        return run
    schedule = [(first, CHUNKS, False), (second, SECOND_PROMPT, True)]
    for ids, chunks, after_reset in schedule:
        if after_reset:
            try:
                _call(run.cache, "reset")
            except _LearnerError as err:
                run.error, run.method = err.error, err.method
                return run
        expected, start = model(ids), 0
        for t in chunks:
            record = _Pass(held=start, t=t, stage=_stage(start, t, after_reset))
            run.passes.append(record)
            try:
                got = model(ids[:, start : start + t], cache=_Watched(run.cache, record))
            except _LearnerError as err:
                run.failed, run.error, run.method = record, err.error, err.method
                return run
            except Exception as err:  # noqa: BLE001 - the model choking on what the learner returned
                run.failed, run.error = record, err
                return run
            record.seq_len_after = getattr(run.cache, "seq_len", None)
            error = (got - expected[:, start : start + t]).abs().amax(dim=(0, 2))  # per position
            run.max_error = max(run.max_error, error.nan_to_num(0.0).max().item())
            run.nan = run.nan or not torch.isfinite(got).all().item()
            if not torch.isfinite(error).all() or (error > ATOL).any():
                bad = (~(error <= ATOL)).nonzero()
                run.failed, run.first_bad = record, start + int(bad[0])
                return run
            start += t
    return run


def _name(cache_class) -> str:
    return getattr(cache_class, "__name__", "your cache")


def _stubs(cache_class, layers) -> list[str]:
    """The methods that raise NotImplementedError (every one if __init__ does)."""
    try:
        cache = cache_class(layers)
    except NotImplementedError:
        return ["__init__", "positions_and_mask", "update", "advance", "reset"]
    except Exception:  # noqa: BLE001
        return []
    k = torch.zeros(1, 1, 1, 2)
    cos, sin = torch.ones(1, 2), torch.zeros(1, 2)
    calls = {"positions_and_mask": (1,), "update": (0, k, k, cos, sin), "advance": (1,), "reset": ()}
    stubbed = []
    for method, args in calls.items():
        try:
            getattr(cache, method)(*args)
        except NotImplementedError:
            stubbed.append(method)
        except Exception:  # noqa: BLE001 - written, and wrong or unhappy with these toy inputs: not a stub
            pass
    return stubbed


# --- what a pass's positions and mask should have been ---------------------------------------


def _allowed(mask, t, s):
    """The mask as a bool (t, s) tensor, True = may look; or a sentence saying why it cannot be read as one."""
    if mask is None:
        return None
    try:
        mask = torch.as_tensor(mask)
    except Exception:  # noqa: BLE001
        return f"the mask must be a tensor (or None), got {type(mask).__name__}"
    mask = mask.detach().cpu()
    while mask.dim() > 2 and mask.shape[0] == 1:
        mask = mask[0]  # (1, 1, t, s) is fine
    if mask.dtype != torch.bool:
        if mask.is_floating_point() and set(mask.unique().tolist()) <= {0.0, 1.0}:
            return ("the mask is a float tensor of 0s and 1s. A float mask is added to the scores (0 to keep, -inf "
                    "to hide), so 1s hide nothing. Return a bool mask, True where a query may look.")
        if not mask.is_floating_point():
            return ("the mask holds integers (dtype " + str(mask.dtype).replace("torch.", "") + "). Attention takes a "
                    "bool mask (True = may look) or a float one it adds to the scores; integers would be added, "
                    "hiding nothing. Build it with dtype=torch.bool, or call .bool() on it.")
        mask = mask > -1e4
    if tuple(mask.shape) != (t, s):
        if tuple(mask.shape) == (t, t) and s > t:
            return (f"the mask is ({t}, {t}): it covers only the {t} new keys, but attention runs over all {s} keys, "
                    f"the {s - t} cached ones first. Make it ({t}, seq_len + {t}).")
        if tuple(mask.shape) == (s, t):
            return f"the mask is transposed, ({s}, {t}): rows are the {t} new queries, columns the {s} keys."
        return f"the mask has shape {tuple(mask.shape)}; with {t} new tokens over {s} keys it must be ({t}, {s})."
    return mask


def _check_plan(p: _Pass, layers: int, second: bool) -> str | None:
    """Why this pass's positions or mask are wrong, or None if they are right."""
    if not p.planned:
        return None  # positions_and_mask never returned: its exception is reported instead
    want = list(range(p.held, p.held + p.t))
    got = p.positions
    if got is None:
        return (f"In {p.stage}, positions_and_mask returned positions that are not integers (a list or a tensor of "
                f"{p.t} ints). " + _more(2))
    if got != want:
        if len(got) != p.t:
            return (f"In {p.stage}, positions_and_mask gave {len(got)} positions for {p.t} new tokens: one per "
                    f"token, {want}. " + _more(2))
        if second and p.held == 0 and got == list(range(got[0], got[0] + p.t)):
            if p.keys_returned and p.keys_returned[0] == got[0] + p.t:
                return (f"Forgetting to reset: reset() leaves the cache as it was, so the second prompt is appended "
                        f"to the first: its positions start at {got[0]} and it attends to the first prompt's keys and "
                        f"values. Empty every layer and set the counter back to 0 (assigning a new object to self "
                        f"inside a method changes nothing outside it). " + _more(4))
            return (f"reset() leaves the counter where it was: the second prompt's positions start at {got[0]}, where "
                    f"the first prompt stopped, instead of 0. Set it back to 0 as well. " + _more(4))
        if p.held > 0 and got == list(range(p.t)):
            counter = p.seq_len_before
            if counter == 0:
                cause = ("Your counter is still 0 after the first pass: advance() does not move it (or reset it "
                         "somewhere). The model calls advance(t) once per pass, after its last layer.")
            elif counter == p.held:
                cause = (f"Your counter says {p.held} tokens are held, but positions_and_mask starts at 0 anyway: "
                         f"start at self.seq_len.")
            else:
                cause = "The new tokens must continue after the ones held."
            return (f"Positions restart at 0: in {p.stage} the new tokens got positions {got}, but they come after "
                    f"the {p.held} cached tokens, at {want}. Rotary embeddings then place them at the start of the "
                    f"text, and every score against a cached key is wrong. {cause} " + _more(2))
        if got == list(range(got[0], got[0] + p.t)) and p.held > 0 and got[0] in (p.held * layers, p.held * (layers + 1)):
            both = got[0] == p.held * (layers + 1)
            return (f"Advancing per layer instead of per pass: after {p.held} tokens the counter says {got[0]} = "
                    f"{p.held} x {layers + 1 if both else layers}, so it moved in every one of the {layers} layers"
                    f"{' and once more in advance()' if both else ''}. update() runs once per layer; the counter must "
                    f"move once per forward pass, in advance(), which the model calls after its last layer. "
                    f"Take the `seq_len +=` out of update(). " + _more(2))
        if got in ([x + 1 for x in want], [x - 1 for x in want]):
            which = (f"skips position {p.held}" if got[0] == p.held + 1 else
                     f"reuses position {p.held - 1}, which the last cached token already has")
            return (f"Off by one: in {p.stage} the new tokens got positions {got}, which {which}. With {p.held} "
                    f"tokens held (positions 0..{p.held - 1}), the next is {p.held}. " + _more(2))
        return f"In {p.stage}, the new tokens got positions {got}; they should be {want}. " + _more(2)

    s = p.held + p.t
    bottom_right = torch.ones(p.t, s, dtype=torch.bool).tril(diagonal=p.held)
    allowed = _allowed(p.mask, p.t, s)
    if isinstance(allowed, str):
        return f"In {p.stage}, {allowed} " + _more(3)
    if allowed is None or (allowed.all() and p.t > 1):
        if p.t == 1:
            return None  # one query may look at every key: no mask needed
        if p.held == 0:
            return (f"No mask for the prompt: in {p.stage} the mask lets every token see the tokens after it. "
                    f"With nothing cached it is the usual causal mask (t x t, lower triangle). " + _more(3))
        return (f"No mask for a multi-token append: in {p.stage} the mask lets each new token see the new tokens "
                f"after it (the textbook is_causal=(cache is None) does this). One decoded token needs no mask, but "
                f"t > 1 new tokens do: the bottom-right causal mask. " + _more(3))
    if torch.equal(allowed, bottom_right):
        return None
    if p.t == s and torch.equal(allowed, bottom_right.T):
        return (f"The mask is transposed: in {p.stage} it is the upper triangle, so each token sees the tokens after "
                f"it. Rows are the new queries, columns the keys, and a query sees the keys at or before it. " + _more(3))
    if torch.equal(allowed, ~bottom_right):
        return ("The mask is inverted: it is True where a query may NOT look (the convention of "
                "nn.MultiheadAttention's attn_mask). Here, as in scaled_dot_product_attention, True means "
                "'may look': return ~mask. " + _more(3))
    if torch.equal(allowed, torch.ones(p.t, s, dtype=torch.bool).tril()):
        return (f"The mask is aligned to the top left, like is_causal=True: in {p.stage}, new query 0 sees only key 0, "
                f"but it sits at position {p.held} and may see keys 0..{p.held}. That is right only when nothing is "
                f"cached. Align the diagonal to the bottom-right corner. " + _more(3))
    future = allowed & ~bottom_right
    if future.any():
        i, j = (int(x) for x in future.nonzero()[0])
        return (f"In {p.stage}, the mask lets the token at position {p.held + i} see position {j}, which comes after it. "
                + _more(3))
    i, j = (int(x) for x in (bottom_right & ~allowed).nonzero()[0])
    return f"In {p.stage}, the mask hides position {j} from the token at position {p.held + i}, which may see it. " + _more(3)


# --- update() on tensors the checker chose ---------------------------------------------------


def _probe_update(cache_class, layers, head_dim) -> str | None:
    """Why update() is wrong, found by calling it on a fresh cache with known tensors; None if it is right."""
    g = torch.Generator().manual_seed(3)

    def kv(t):
        return torch.randn(2, 2, t, head_dim, generator=g), torch.randn(2, 2, t, head_dim, generator=g)

    def tables(start, t):
        return scaffold.rope_tables(torch.arange(start, start + t), head_dim)

    def close(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-5)

    def call(cache, layer, k, v, cs):
        out = _call(cache, "update", layer, k, v, *cs)
        if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(x, torch.Tensor) for x in out):
            raise _LearnerError("update", TypeError(f"it must return (keys, values), two tensors, got {type(out).__name__}"))
        return out

    try:
        cache = cache_class(layers)
        (k1, v1), cs1 = kv(3), tables(0, 3)
        ka, va = call(cache, 1, k1, v1, cs1)
    except _LearnerError as err:
        return f"On the first write (3 tokens, nothing cached yet) update() raised {_what(err.error)}. " + _more(1)
    except Exception:  # noqa: BLE001 - __init__ is judged elsewhere
        return None
    want_k1 = scaffold.rotate(k1, *cs1)
    if tuple(ka.shape) != tuple(k1.shape) or tuple(va.shape) != tuple(v1.shape):
        return (f"On the first write (keys {tuple(k1.shape)}, nothing cached) update() returned keys {tuple(ka.shape)} "
                f"and values {tuple(va.shape)}; with nothing cached it must return just these. " + _more(1))
    if close(ka, k1) and not close(ka, want_k1):
        return ("The keys are never rotated: update() stores and returns them as it got them, but the queries are "
                "rotated, so scores no longer depend on how far apart two tokens are. Rotate the new keys with "
                "scaffold.rotate(k, cos, sin) before storing them. " + _more(1))
    (k2, v2), cs2 = kv(1), tables(3, 1)
    try:
        kb, vb = call(cache, 1, k2, v2, cs2)
    except _LearnerError as err:
        return _concat_dim(cache_class, layers, head_dim, kv, tables) or (
            f"When one token came after 3 cached ones, update() raised {_what(err.error)}. " + _more(1))
    want_v, want_k = torch.cat([v1, v2], dim=2), torch.cat([want_k1, scaffold.rotate(k2, *cs2)], dim=2)
    if tuple(vb.shape) == tuple(v2.shape):
        return ("update() returns only this pass's keys and values: attention then sees the new token and none of "
                "the cached ones. Return everything held for the layer, the cached ones followed by the new. " + _more(1))
    if tuple(vb.shape) != tuple(want_v.shape) or tuple(kb.shape) != tuple(want_k.shape):
        return _concat_dim(cache_class, layers, head_dim, kv, tables) or (
            f"After 3 cached tokens and 1 new, update() returned keys {tuple(kb.shape)}; expected {tuple(want_k.shape)} "
            f"(B, H_kv, 4 tokens, D). " + _more(1))
    if close(vb, torch.cat([v2, v1], dim=2)):
        return ("update() puts the new token before the cached ones. The new tokens come after the cached ones: "
                "torch.cat([cached, new], dim=2). " + _more(1))
    if not close(vb, want_v):
        return ("update() changes the values: they are stored as they come (no rotation) and returned cached first, "
                "then new. " + _more(1))
    if not close(kb, want_k):
        if close(kb, scaffold.rotate(torch.cat([k1, k2], dim=2), *cs2)):
            return ("Rotating keys after caching: update() stores the keys unrotated and rotates all of them on the "
                    "way out with this pass's angles, so every cached key is turned as if it sat at the new token's "
                    "position (and with several new tokens the angles no longer even fit). Rotate each key once, at "
                    "its own position, before storing it. " + _more(1))
        if close(kb, scaffold.rotate(want_k, *cs2)):
            return ("update() rotates the cached keys a second time on the way out: they were stored rotated already. "
                    "Rotate only the new keys, once, before storing. " + _more(1))
        if close(kb, torch.cat([k1, k2], dim=2)):
            return ("The keys are never rotated: rotate the new keys with scaffold.rotate(k, cos, sin) before "
                    "storing them. " + _more(1))
        return ("update() returns keys that differ from the cached rotated keys followed by the new token's rotated "
                "key. " + _more(1))
    (k3, v3), cs3 = kv(2), tables(0, 2)
    try:
        kc, _ = call(cache, 2, k3, v3, cs3)
    except _LearnerError as err:
        return f"On the first write to a second layer, update() raised {_what(err.error)}. " + _more(1)
    if kc.shape[2] == 6:
        return ("Every layer shares one store: the first write to layer 2 came back with layer 1's 4 tokens in front. "
                "Each layer has its own keys and values: keep one entry per layer, self.keys[layer]. " + _more(1))
    if not close(kc, scaffold.rotate(k3, *cs3)):
        return "On the first write to layer 2, update() returned something other than that layer's 2 rotated keys. " + _more(1)
    return None


def _concat_dim(cache_class, layers, head_dim, kv, tables) -> str | None:
    """Name the dimension update() joins along, from two writes of equal size (which any dimension accepts)."""
    try:
        cache = cache_class(layers)
        _call(cache, "update", 0, *kv(2), *tables(0, 2))
        keys, _ = _call(cache, "update", 0, *kv(2), *tables(2, 2))
    except Exception:  # noqa: BLE001
        return None
    shape = tuple(getattr(keys, "shape", ()))
    names = {(4, 2, 2, head_dim): (0, "the batch"), (2, 4, 2, head_dim): (1, "the KV heads"),
             (2, 2, 2, 2 * head_dim): (3, "head_dim")}
    if shape not in names:
        return None
    dim, what = names[shape]
    return (f"A wrong concat dimension: update() joins the cached and new keys along dim {dim} ({what}): two writes "
            f"of 2 tokens came back as {shape} instead of (2, 2, 4, {head_dim}). K and V are (B, H_kv, T, D), so the "
            f"tokens are dim 2: torch.cat([cached, new], dim=2). (With chunks of different sizes it fails outright.) "
            + _more(1))


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__




@torch.no_grad()
def _same_generation(model, cache_class, new_tokens=10) -> bool:
    """Greedy decoding of one sequence with a fresh learner cache writes the tokens recomputing writes."""
    prompt = _ids(1, 6, 2, model.config.vocab_size)
    slow, fast = prompt, prompt
    cache = _Watched(cache_class(model.config.layers))
    fed = prompt
    for _ in range(new_tokens):
        slow = torch.cat([slow, model(slow)[:, -1:].argmax(-1)], dim=1)
        nxt = model(fed, cache=cache)[:, -1:].argmax(-1)
        fast, fed = torch.cat([fast, nxt], dim=1), nxt
    return torch.equal(slow, fast)


def check_my_cache(cache_class) -> Feedback:
    """Exercise 01.2: ``cache_class(layers)`` must be a working KV cache for kvlessons.scaffold.TinyModel.

    Runs the course's detector: two sequences fed through one instance in chunks (a
    5-token prefill, a 3-token append, single tokens; then reset() and a second prompt),
    each pass compared with one uncached pass of the same model. If they disagree, the
    positions and masks the cache returned and update() on known tensors name the mistake:
    positions restarting at 0, a top-left (is_causal=True) mask, no mask for multi-token
    appends, advancing per layer, rotating keys after caching, a wrong concat dimension,
    forgetting to reset. Anything the learner's code raises becomes feedback.
    """
    if not callable(cache_class):
        return Feedback(False, f"Pass the class itself: exercises.check_my_cache(MyCache), got {cache_class!r}.")
    model = scaffold.TinyModel()
    layers, name = model.config.layers, _name(cache_class)
    with torch.no_grad():
        run = _detect(model, cache_class)
    stubbed = _stubs(cache_class, layers) if run.error is not None or run.failed is not None else []
    if stubbed:
        which = "every method" if "__init__" in stubbed else ", ".join(f"{m}()" for m in stubbed)
        verb = "raises" if len(stubbed) == 1 or "__init__" in stubbed else "raise"
        return Feedback(False, f"Not written yet: {which} of {name} still {verb} NotImplementedError. Fill in the class "
                               f"in the cell above, TODO by TODO; the checker then says what, if anything, is wrong. "
                               f"Stuck? exercises.my_cache_hint(1) for TODO 1, and so on.")
    if run.method == "__init__":
        return Feedback(False, f"{name}({layers}) raised {_what(run.error)}. The model builds the cache as "
                               f"{name}(layers), with the number of layers ({layers} here).")
    if run.failed is None and run.error is None:
        return _passed(model, cache_class, run)

    # The detector found a disagreement (or an exception): look at what the learner's methods did.
    found = run.failed
    if run.error is not None and isinstance(run.error, AttributeError) and run.method is not None:
        return Feedback(False, f"{name} has no method {run.method}(): the model calls cache.positions_and_mask(t) "
                               f"once per pass, cache.update(index, k, v, cos, sin) in every layer, then cache.advance(t)."
                               f" ({_what(run.error)})")
    if run.error is not None and run.method == "reset":
        return Feedback(False, f"reset() raised {_what(run.error)} between the two prompts. " + _more(4))
    if run.error is not None and run.method in ("positions_and_mask", "advance"):
        return Feedback(False, f"Not yet. {_detector_sentence(run)}\n" + _more(2))
    detector = _detector_sentence(run)
    cause = None
    for p in run.passes:
        second = p.stage.startswith("the second prompt")
        p.seq_len_before = _counter_before(run.passes, p)
        cause = _check_plan(p, layers, second)
        if cause or p is found:
            break
    if cause is None:
        cause = _probe_update(cache_class, layers, model.config.head_dim)
    if cause is None and found is not None and found.stage.startswith("the second prompt") and found.keys_returned:
        if found.keys_returned[0] != found.held + found.t:
            cause = (f"Forgetting to reset the keys: after reset() the first layer's update() returned "
                     f"{found.keys_returned[0]} tokens for a {found.t}-token prompt, so the new prompt attends to the "
                     f"old one's keys and values. reset() must empty every layer, not only the counter. " + _more(4))
    if cause is None and run.error is not None and run.method is not None:
        cause = f"{run.method}() raised {_what(run.error)}. " + _more({"update": 1, "advance": 2}.get(run.method, 3))
    if cause is None and run.error is not None:
        cause = (f"The model raised {_what(run.error)} with what your cache returned: check the shapes, keys and "
                 f"values (B, H_kv, S, D), mask (t, S). " + _more(1))
    if cause is None:
        cause = ("Each method looks right on its own, so compare the class with the TODOs once more. " + _more(1))
    return Feedback(False, f"Not yet. {detector}\n{cause}")


def _counter_before(passes, p):
    i = passes.index(p)
    return passes[i - 1].seq_len_after if i > 0 else 0


def _detector_sentence(run: _Run) -> str:
    p = run.failed
    if p is None:
        return ""
    if run.error is not None:
        return f"The detector stopped in {p.stage}: {run.method + '()' if run.method else 'the model'} raised {_what(run.error)}."
    size = "some of them are NaN" if run.nan else f"largest difference {run.max_error:.2g}"
    return (f"The detector: fed in chunks, your cache's logits differ from one uncached pass from position "
            f"{run.first_bad} on, in {p.stage}; {size}.")


def _passed(model, cache_class, run: _Run) -> Feedback:
    c = model.config
    lines = [f"Correct: your cache gives the logits of one uncached pass at every position, fed as a "
             f"{CHUNKS[0]}-token prefill, a {CHUNKS[1]}-token append and {len(CHUNKS) - 2} single tokens "
             f"(2 sequences at once, within 1e-4); after reset() a second prompt starts clean."]
    try:
        same = _same_generation(model, cache_class)
    except Exception as err:  # noqa: BLE001
        return Feedback(False, f"Almost: the detector passes, but greedy decoding of one sequence with your cache "
                               f"raised {_what(err)}.")
    if not same:
        return Feedback(False, "Almost: the detector passes, but greedy decoding of one sequence with your cache writes "
                               "different tokens from recomputing. Does it assume a batch of 2?")
    lines.append("Greedy decoding with it writes the same 10 tokens as recomputing.")
    per_token = 2 * c.layers * c.kv_heads * c.head_dim * 4
    tokens = 2 * sum(SECOND_PROMPT)
    if measured_bytes(run.cache) == per_token * tokens:
        lines.append(f"It holds {per_token * tokens:,} bytes for 2 sequences of {sum(SECOND_PROMPT)} tokens: "
                     f"{per_token} per token = 2 (K and V) x {c.layers} layers x {c.kv_heads} KV heads x "
                     f"{c.head_dim} (head_dim) x 4 bytes (float32).")
    return Feedback(True, "\n".join(lines))
