"""Greedy decoding with and without a cache, the one chunked-feeding loop, and an instrument that counts K/V work (lesson 01)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

import torch.nn.functional as F

from ._device import synchronize
from .cache import ConcatCache, KVCache
from .shape import require_positive_int


@dataclass
class Generation:
    """What :func:`generate` returns.

    tokens:      (B, P + N), the prompt followed by the new tokens.
    new_tokens:  (B, N).
    logits:      (B, N, vocab), the logits each new token was chosen from.
    step_times:  seconds per forward pass; step 0 reads the prompt (prefill), step i > 0
                 produces new token i. Wall-clock, with GPU work synchronised.
    step_lengths: tokens fed to the model at each step (P then 1s with a cache; P, P+1, ... without).
    """

    tokens: torch.Tensor
    new_tokens: torch.Tensor
    logits: torch.Tensor
    step_times: list[float] = field(default_factory=list)
    step_lengths: list[int] = field(default_factory=list)


def _check_prompt(prompt_ids: torch.Tensor) -> None:
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids must be a (batch, tokens) tensor of token ids")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids must hold at least one token")


@torch.inference_mode()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, cache: KVCache | None = None,
             pad_mask: torch.Tensor | None = None) -> Generation:
    """Greedily extend ``prompt_ids`` (B, P) by ``max_new_tokens`` tokens.

    With ``cache=None`` every step re-runs the model over the whole sequence so far
    (the recompute baseline). With a cache, the prompt is read once (prefill) and each
    later step feeds only the newest token (decode). The prompt is appended after
    whatever the cache already holds: pass an empty (or ``reset()``) cache to start over.
    ``pad_mask`` (B, P), True for real tokens, generates a left-padded batch; it is
    extended by one real token per step.
    """
    _check_prompt(prompt_ids)
    require_positive_int("max_new_tokens", max_new_tokens, allow_zero=True)
    if pad_mask is not None and cache is not None and cache.seq_len:
        raise ValueError("a padded prompt must start from an empty cache")
    dev = prompt_ids.device
    tokens = prompt_ids
    fed = prompt_ids
    new, logits, times, lengths = [], [], [], []
    # All or nothing, like each pass: interrupted, the cache is as it was before the call,
    # not holding the steps that had finished (whose tokens the caller never received).
    with nullcontext() if cache is None else cache.atomic():
        for _ in range(max_new_tokens):
            inputs = tokens if cache is None else fed
            extra = {} if pad_mask is None else {"pad_mask": pad_mask}
            synchronize(dev)
            t0 = time.perf_counter()
            out = model(inputs, cache=cache, last_only=True, **extra)[:, -1]  # (B, vocab): only the last position predicts
            nxt = out.argmax(dim=-1, keepdim=True)  # (B, 1)
            synchronize(dev)
            times.append(time.perf_counter() - t0)
            lengths.append(inputs.shape[1])
            logits.append(out)
            new.append(nxt)
            tokens = torch.cat([tokens, nxt], dim=1)
            fed = nxt
            if pad_mask is not None:
                pad_mask = torch.cat([pad_mask, pad_mask.new_ones(pad_mask.shape[0], 1)], dim=1)
    b = prompt_ids.shape[0]
    new_tokens = torch.cat(new, dim=1) if new else prompt_ids.new_empty(b, 0)
    all_logits = torch.stack(logits, dim=1) if logits else torch.empty(b, 0, 0, device=dev)
    return Generation(tokens, new_tokens, all_logits, times, lengths)


@torch.inference_mode()
def feed_in_chunks(model, ids: torch.Tensor, chunks, cache: KVCache, last_only: bool = False) -> torch.Tensor:
    """Feed ``ids`` (B, T) through ``cache`` in pieces of ``chunks`` tokens; return the logits.

    The one chunked loop of the course: the detector of lesson 07 compares its result
    with one uncached pass, the quantized-cache measures read a passage through it, and
    the tests run every cache variant through it. Returns (B, T, vocab), or with
    ``last_only`` the logits of each chunk's last position, (B, len(chunks), vocab).
    The tokens are appended after what ``cache`` already holds.
    """
    chunks = list(chunks)
    for j, size in enumerate(chunks):
        require_positive_int(f"chunks[{j}]", size)
    if sum(chunks) != ids.shape[1]:
        raise ValueError(f"chunks must add up to the {ids.shape[1]} tokens, got {chunks} (sum {sum(chunks)})")
    pieces, start = [], 0
    for size in chunks:
        logits = model(ids[:, start : start + size], cache=cache, last_only=last_only)
        pieces.append(logits)
        start += size
    return torch.cat(pieces, dim=1)


@dataclass
class KVWork:
    """Token-positions whose keys and values were computed, per forward pass (one layer's view).

    Every layer projects the same positions, so ``per_layer_total = total * layers``.
    """

    layers: int
    per_forward: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.per_forward)

    @property
    def per_layer_total(self) -> int:
        return self.total * self.layers


@contextmanager
def count_kv_work(model):
    """Count K/V projections while the block runs: ``with count_kv_work(model) as work: ...``.

    A forward hook on the first layer's key projection (fused or not) records batch x tokens per
    call; the model itself is not changed.
    """
    work = KVWork(layers=len(model.blocks))

    def hook(_module, inputs, _output):
        x = inputs[0]  # (B, T, hidden)
        work.per_forward.append(x.shape[0] * x.shape[1])

    attn = model.blocks[0].attn
    handle = (attn.k_proj if attn.qkv_proj is None else attn.qkv_proj).register_forward_hook(hook)
    try:
        yield work
    finally:
        handle.remove()


def expected_kv_work(prompt_len: int, new_tokens: int, cached: bool) -> int:
    """Token-positions of K/V a greedy generation computes, by the formula.

    Recompute: steps see P, P+1, ..., P+N-1 tokens, so N*P + N(N-1)/2 (n(n+1)/2 for P=1, N=n).
    Cached: the prompt once, then one token per later step, so P + N - 1.
    """
    require_positive_int("prompt_len", prompt_len)
    require_positive_int("new_tokens", new_tokens, allow_zero=True)
    if new_tokens == 0:
        return 0
    if cached:
        return prompt_len + new_tokens - 1
    return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2


@dataclass
class TraceStep:
    """The state after one step of a cached generation (for the 'watch it grow' view)."""

    step: int  # 0 = after prefill
    tokens: list[int]  # everything in context, prompt included
    cached_tokens: int  # positions held in the cache
    cache_bytes: int  # cache.nbytes() at this point
    next_token: int  # the token chosen from this step's logits
    top_tokens: list[int]  # most likely next tokens
    top_probs: list[float]


@torch.inference_mode()
def trace_generation(model, prompt_ids: torch.Tensor, max_new_tokens: int, cache: KVCache, top_k: int = 3) -> list[TraceStep]:
    """Run a cached greedy generation of one sequence and record the cache after every step.

    ``cache`` is reset first, so the trace always starts from an empty cache.
    """
    _check_prompt(prompt_ids)
    if prompt_ids.shape[0] != 1:
        raise ValueError("trace_generation follows one sequence: prompt_ids must have batch size 1")
    require_positive_int("max_new_tokens", max_new_tokens)
    require_positive_int("top_k", top_k)
    cache.reset()
    tokens = prompt_ids[0].tolist()
    fed = prompt_ids
    steps = []
    for step in range(max_new_tokens):
        logits = model(fed, cache=cache, last_only=True)[0, -1]
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(min(top_k, probs.numel()))
        nxt = int(logits.argmax())
        steps.append(
            TraceStep(step, list(tokens), cache.seq_len, cache.nbytes(), nxt, top.indices.tolist(), top.values.tolist())
        )
        tokens.append(nxt)
        fed = torch.tensor([[nxt]], device=prompt_ids.device)
    return steps


def measure_kv_work(model, lengths, prompt_len: int = 1) -> dict[str, list[int]]:
    """Counted K/V token-positions to generate n tokens after a ``prompt_len`` prompt, for each n.

    Returns ``{"n": [...], "recompute": [...], "cached": [...]}``, each count read off
    :func:`count_kv_work` while :func:`generate` runs (a fresh ConcatCache for "cached").
    """
    require_positive_int("prompt_len", prompt_len)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (1, prompt_len), generator=g).to(model.device)
    result = {"n": [], "recompute": [], "cached": []}
    for n in lengths:
        require_positive_int("n", n)
        result["n"].append(n)
        for key, cache in (("recompute", None), ("cached", ConcatCache())):
            with count_kv_work(model) as work:
                generate(model, prompt, n, cache=cache)
            result[key].append(work.total)
    return result


def next_token_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict:
    """How close ``candidate``'s next-token predictions are to ``reference``'s: logits (..., vocab) at the same positions.

    ``top1``: how often both pick the same token; ``kl``: mean KL(reference || candidate)
    in nats per position (each clamped at 0: rounding can make an exact match print as
    -0.0000); ``max_logit_diff``: the largest logit difference.
    """
    kl = F.kl_div(candidate.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {
        "top1": (candidate.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "kl": kl.clamp_min(0).mean().item(),
        "max_logit_diff": (candidate - reference).abs().max().item(),
    }
