"""Speculative decoding with rollback (lesson 11): a cheap draft guesses, the model checks in one pass.

Greedy decoding runs the whole model once per token. Speculative decoding (Leviathan
et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) lets a cheaper
**draft** propose ``k`` tokens one by one, then runs the **target** model once over
the last chosen token and the ``k`` proposals: a multi-token append to its cache,
whose logits give the target's own choice after each of them. The proposals are kept
up to the first one the target would not have chosen; there the target's choice
replaces it, so every round emits between 1 and k + 1 tokens, and (greedily) exactly
the tokens the target alone would have produced.

The cache holds keys and values for every proposal the target read, the rejected ones
too; **rollback** is ``cache.crop(n)``, back to the last accepted position. In the
paged cache that releases the blocks wholly past it and leaves the rest of the pool,
shared blocks and the prefix cache, as they were.

Two kinds of draft share one small interface, ``propose(known, k)`` and ``rollback(length)``:

- :class:`ModelDraft`: a model with its own cache, choosing greedily: the target
  itself made cheaper, by its first layers only (:class:`FirstLayers`, an early exit as
  in LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710), or reading a 4-bit cache;
- :class:`PromptLookupDraft`: no model at all. It finds the sequence's last few tokens
  earlier in the sequence and proposes what followed them there (prompt lookup
  decoding, Saxena 2023; transformers' ``generate(prompt_lookup_num_tokens=...)``). Free
  to run, and right whenever the answer copies its input (quoting, editing, extraction).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..bench import _timed_call
from ..cache import ConcatCache, KVCache
from ..paging.blocks import _token_ids
from ..shape import require_positive_int


class FirstLayers(nn.Module):
    """A draft: the first ``layers`` blocks of ``model``, then its final norm and output head (early exit).

    It shares the model's weights (nothing is copied) and keeps a cache of its own
    ``layers`` layers. Called as the model is: ``draft(ids, cache, last_only)``.
    """

    def __init__(self, model, layers: int):
        super().__init__()
        total = len(model.blocks)
        if not 1 <= require_positive_int("layers", layers) <= total:
            raise ValueError(f"layers must be between 1 and the model's {total} layers, got {layers}")
        self.model, self.layers = model, layers

    @property
    def config(self):
        return self.model.config

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        cache, cos, sin, x, mask = self.model.begin(ids, cache)
        with cache.transaction(ids):
            x = self.model.run_blocks(range(self.layers), x, cos, sin, cache, mask=mask, last_only=last_only)
            logits = self.model.head(x[:, -1:] if last_only else x)
            cache.advance(ids.shape[1])
        return logits


def accepted_count(proposed, chosen) -> int:
    """How many proposals the target keeps: the length of the run of ``proposed[i] == chosen[i]`` from the start.

    ``chosen[i]`` is the target's greedy token after reading the last accepted token and
    ``proposed[:i]``; ``chosen`` has one more entry than ``proposed`` (the target's choice
    after all of them). The first disagreement ends the run: every later proposal was
    drafted after a token the target rejected, so it answers a different prefix.
    """
    proposed, chosen = list(proposed), list(chosen)
    if len(chosen) != len(proposed) + 1:
        raise ValueError(f"chosen must hold one more token than proposed (the target's choice after the last "
                         f"proposal): {len(proposed)} proposed, got {len(chosen)} chosen")
    a = 0
    while a < len(proposed) and proposed[a] == chosen[a]:
        a += 1
    return a


def verify(proposed, chosen, cached: int) -> tuple[list[int], int]:
    """Return (the tokens a round emits, the cache length to crop to) for one verification.

    ``cached``: positions the target's cache held before the round. The round fed the last
    chosen token and every proposal (``cached + 1 + k`` positions); the keys to keep are
    those of that token and the ``a`` accepted proposals. Emitted: the accepted
    proposals, then the target's own choice after them (a correction, or a bonus token when all were accepted).
    """
    require_positive_int("cached", cached, allow_zero=True)
    a = accepted_count(proposed, chosen)
    return list(proposed[:a]) + [chosen[a]], cached + 1 + a


class ModelDraft:
    """A draft that is a model with its own cache (a new ConcatCache by default); it proposes greedily.

    It reads what it has not read yet of the sequence (at least the last chosen token)
    in one pass, then proposes one token per pass. ``rollback`` crops its cache, so
    after a rejection it re-reads only the tokens the target chose instead.
    """

    def __init__(self, model, cache: KVCache | None = None):
        self.model = model
        self.cache = ConcatCache() if cache is None else cache
        if self.cache.seq_len:
            raise ValueError("cache must start empty: the draft reads the prompt itself")

    def atomic(self):
        return self.cache.atomic()

    def propose(self, known: list[int], k: int) -> list[int]:
        proposed, feed = [], known[self.cache.seq_len:]
        dev = next(self.model.parameters()).device
        for _ in range(k):
            logits = self.model(torch.tensor([feed], device=dev), cache=self.cache, last_only=True)
            proposed.append(int(logits[0, -1].argmax()))
            feed = proposed[-1:]
        return proposed

    def rollback(self, length: int) -> None:
        if self.cache.seq_len > length:
            self.cache.crop(length)


class PromptLookupDraft:
    """A draft without a model: it copies what followed the sequence's last n tokens where they appeared before.

    For n from ``max_ngram`` down to ``min_ngram``, it looks for the latest earlier place
    where the last n tokens of the sequence also occur, and proposes the (up to k)
    tokens that came after them there. No match: no proposal (the round is a plain decode step).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = require_positive_int("max_ngram", max_ngram)
        self.min_ngram = require_positive_int("min_ngram", min_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram must be <= max_ngram, got {min_ngram} > {max_ngram}")

    def atomic(self):
        return nullcontext()

    def propose(self, known: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(known) - 1), self.min_ngram - 1, -1):
            tail = known[-n:]
            for start in range(len(known) - n - 1, -1, -1):  # latest earlier occurrence first
                if known[start : start + n] == tail:
                    return known[start + n : start + n + k]
        return []

    def rollback(self, length: int) -> None:
        """Nothing to undo: it keeps no state."""


@dataclass
class SpeculativeRun:
    """What :func:`speculative_generate` returns."""

    tokens: list[int]  # the generated tokens
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) per round
    seconds: float = 0.0  # wall-clock of the whole generation, prefill included
    draft_seconds: float = 0.0
    target_seconds: float = 0.0

    @property
    def proposed(self) -> int:
        return sum(p for p, _ in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.rounds)

    @property
    def acceptance(self) -> float:
        """Accepted proposals over proposals made."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def target_passes(self) -> int:
        return len(self.rounds) + 1  # every round's verification, and the prefill

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target forward pass after the prefill (1.0 for plain greedy decoding)."""
        return (len(self.tokens) - 1) / len(self.rounds) if self.rounds else 0.0


@torch.inference_mode()
def speculative_generate(target, draft, prompt_ids: torch.Tensor, max_new_tokens: int, k: int,
                         target_cache: KVCache | None = None, stop=()) -> SpeculativeRun:
    """Greedy generation of ``max_new_tokens`` tokens by ``target``, with ``draft`` proposing up to ``k`` at a time.

    ``draft``: a :class:`ModelDraft` or :class:`PromptLookupDraft` (anything with
    ``propose(known, k)``, ``rollback(length)`` and ``atomic()``). ``prompt_ids`` (1, P).
    ``target_cache`` is a new ConcatCache by default; a paged view, a StaticCache or a
    4-bit cache work the same way, through ``crop``. It may already hold the prompt's
    first tokens (a paged sequence whose first blocks came from the prefix cache): only
    the rest of the prompt is read. The tokens equal
    greedy decoding of ``target`` (up to float rounding between a multi-token pass and
    one-token steps). Generation ends early after a token in ``stop``.

    All or nothing: interrupted, the caches are as they were before the call.
    """
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError("prompt_ids must be a (1, tokens) tensor: speculative decoding here serves one sequence")
    require_positive_int("max_new_tokens", max_new_tokens)
    require_positive_int("k", k)
    if not all(hasattr(draft, name) for name in ("propose", "rollback", "atomic")):
        raise ValueError("draft must be a ModelDraft or a PromptLookupDraft (propose, rollback, atomic)")
    stop = set(_token_ids("stop", stop))
    target_cache = ConcatCache() if target_cache is None else target_cache
    if target_cache.seq_len >= prompt_ids.shape[1]:
        raise ValueError(f"target_cache must hold fewer positions than the prompt ({prompt_ids.shape[1]}): it holds "
                         f"{target_cache.seq_len}, taken to be the prompt's first tokens, and the rest is read here")
    dev = prompt_ids.device
    prompt = prompt_ids[0].tolist()
    run = SpeculativeRun([])
    start = time.perf_counter()
    with target_cache.atomic(), draft.atomic():
        rest = prompt_ids[:, target_cache.seq_len:]
        secs, logits = _timed_call(lambda: target(rest, cache=target_cache, last_only=True), dev)
        run.target_seconds += secs
        out = [int(logits[0, -1].argmax())]
        while len(out) < max_new_tokens and out[-1] not in stop:
            cached = target_cache.seq_len  # the cache holds all but the last chosen token
            room = min(k, max_new_tokens - len(out) - 1)  # a round emits at most room + 1 tokens
            secs, proposed = _timed_call(lambda: draft.propose(prompt + out, room) if room else [], dev)
            run.draft_seconds += secs
            ids = torch.tensor([[out[-1]] + proposed], device=dev)
            secs, logits = _timed_call(lambda: target(ids, cache=target_cache), dev)  # one pass over 1 + len(proposed) tokens
            run.target_seconds += secs
            emitted, keep = verify(proposed, logits[0].argmax(-1).tolist(), cached)
            target_cache.crop(keep)  # roll back the rejected proposals
            draft.rollback(keep)
            run.rounds.append((len(proposed), len(emitted) - 1))
            for token in emitted:
                out.append(token)
                if token in stop:
                    break
        held = len(prompt) + len(out) - 1  # a stop inside the accepted proposals leaves later keys behind
        if target_cache.seq_len > held:
            target_cache.crop(held)
        draft.rollback(held)
    run.tokens = out
    run.seconds = time.perf_counter() - start
    return run
