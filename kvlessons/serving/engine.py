"""Continuous batching over one paged pool: a serving engine in miniature (lesson 11).

A server keeps one pool of K/V blocks (:class:`~kvlessons.paging.PagedKVCache`) and
decodes many requests at once. Each **step** is one forward pass of the model over the
new tokens of every running request:

- a request that is decoding contributes one token (the one it chose last step);
- a request that is reading its prompt contributes the next piece of it (chunked
  prefill: at most ``token_budget`` tokens per step in all, decode tokens first);
- the logits at each request's last new token choose its next token, once its prompt
  is read.

**How one pass serves requests of different lengths.** The new tokens of all requests
are packed into one row, (1, N, hidden), with no padding: projections and MLPs work
token by token, so packing changes nothing there. Each token gets its own position
(where it sits in its own request). Attention is the only place where requests meet:
every layer writes the new keys and values into their requests' slots of the pool,
gathers the blocks of all the batch's block tables at once (one ``index_select``), and
runs the course's one attention call over them with a mask that lets a token see only
its own request's keys at or before its position. That mask is what makes the batched
result equal to running each request alone; the price is that each query is scored
against every gathered key and the masked scores are thrown away. vLLM's paged
attention kernel (and FlashAttention's variable-length mode) does the same job without
that waste, walking each request's block table inside the kernel; at this course's
sizes the masked scores cost far less than the weights every step reads.

**Between steps.** A finished request's blocks go back to the pool; with
``keep_finished`` its full blocks stay in the prefix cache until the pool needs them,
so the next turn of a chat (whose prompt starts with everything the last turn read
and wrote) or another user with the same system prompt reads them instead of
recomputing them. A waiting request joins when there is room in the batch
(``max_batch``) and the pool. If the pool runs dry mid-generation, the engine first
drops kept finished blocks, then preempts the request admitted last: its blocks are
freed and it waits again, keeping the tokens it produced; when it comes back it
re-reads its prompt and those tokens (recompute, as vLLM does by default).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ..bench import _timed_call
from ..paging import PagedKVCache, PoolExhaustedError
from ..paging.attention import slot_indices
from ..paging.blocks import _token_ids
from ..rope import rope_tables
from ..shape import require_positive_int


# ---------------------------------------------------------------------------------------------
# One batched forward pass over a paged pool
# ---------------------------------------------------------------------------------------------


class _BatchLayer:
    """One layer's view of a batched step: writes the new K/V into their slots, returns the batch's blocks."""

    window = None  # the engine serves full-attention layers only

    def __init__(self, pool: torch.Tensor, new_slots: torch.Tensor, blocks: torch.Tensor):
        self.pool, self.new_slots, self.blocks = pool, new_slots, blocks

    def observe(self, q):
        """Nothing to watch: the engine keeps every position."""

    def update(self, k, v):
        parts, h, nb, bs, d = self.pool.shape
        slots = self.pool.view(parts, h, nb * bs, d)  # slot s of block b is row b * bs + s
        slots[0][:, self.new_slots] = k[0].to(self.pool)
        slots[1][:, self.new_slots] = v[0].to(self.pool)
        # Every block of every request in the batch, in table order: (1, H_kv, blocks * bs, D) each.
        k_all, v_all = self.pool.index_select(2, self.blocks).view(parts, 1, h, len(self.blocks) * bs, d).unbind(0)
        return k_all, v_all


class _BatchStep:
    """What ``model.run_blocks`` asks for a cache: ``layer(i, window)``, here the batch's view of pool i."""

    def __init__(self, paged: PagedKVCache, new_slots, blocks):
        self._layers = {i: _BatchLayer(pool, new_slots, blocks) for i, pool in paged.kv_pools.items()}

    def layer(self, index, window=None):
        return self._layers[index]


def _check_model(model, paged: PagedKVCache) -> None:
    if not all(hasattr(model, name) for name in ("embed", "run_blocks", "head", "config")):
        raise ValueError("model must be a kvlessons TinyDecoder (or SmolLM2 loaded into one): "
                         "the engine runs its blocks on a packed batch")
    if model.shape.latent_dim is not None:
        raise ValueError("model must cache keys and values (the engine does not serve latent attention)")
    if model.shape != paged.shape:
        raise ValueError("paged must be a pool built for this model's shape (PagedKVCache(model.shape, ...))")


@dataclass(frozen=True)
class BatchLayout:
    """Where a batched step's tokens go and what each may see (all on the model's device).

    positions: (N,) each new token's position in its own sequence (the packed row's order).
    new_slots: (N,) the pool slot (block * block_size + offset) each new token's K/V is written to.
    blocks:    (G,) the blocks gathered for attention: every sequence's table, one after another.
    query_seq, key_seq: which sequence (index in the batch) each new token and each gathered slot belongs to.
    key_pos:   (G * block_size,) the position each gathered slot holds in its sequence.
    mask:      (N, G * block_size) True where a new token may attend to a gathered slot.
    """

    positions: torch.Tensor
    new_slots: torch.Tensor
    blocks: torch.Tensor
    query_seq: torch.Tensor
    key_seq: torch.Tensor
    key_pos: torch.Tensor
    mask: torch.Tensor


def _layout(paged: PagedKVCache, seqs, ids, starts, dev) -> BatchLayout:
    """The layout of a step whose positions are already reserved (see :class:`BatchLayout`)."""
    bs = paged.block_size
    positions, new_slots, blocks, q_seq, k_seq, k_pos = [], [], [], [], [], []
    for j, (s, toks, start) in enumerate(zip(seqs, ids, starts)):
        end = start + len(toks)
        table = paged._seq(s).table[: math.ceil(end / bs)]
        positions.append(torch.arange(start, end))
        new_slots.append(slot_indices(table, end, bs)[start:])
        blocks.append(torch.tensor(table))
        q_seq.append(torch.full((len(toks),), j))
        k_seq.append(torch.full((len(table) * bs,), j))
        k_pos.append(torch.arange(len(table) * bs))
    positions, new_slots, blocks, q_seq, k_seq, k_pos = (
        torch.cat(t).to(dev) for t in (positions, new_slots, blocks, q_seq, k_seq, k_pos))
    # A token sees the keys of its own sequence at or before its position; slots past the
    # sequence's end (the unused tail of its last block) are after every query, so never seen.
    mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= positions[:, None])
    return BatchLayout(positions, new_slots, blocks, q_seq, k_seq, k_pos, mask)


def _checked_batch(model, paged: PagedKVCache, batch) -> tuple[list[int], list[list[int]]]:
    _check_model(model, paged)
    if not batch:
        raise ValueError("batch must hold at least one (seq_id, token_ids) pair")
    seqs = [s for s, _ in batch]
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"batch must name each sequence once, got seq_ids {seqs}")
    ids = [_token_ids(f"batch[{j}] token_ids", toks) for j, (_, toks) in enumerate(batch)]
    for j, toks in enumerate(ids):
        if not toks:
            raise ValueError(f"batch[{j}] must hold at least one new token")
        if max(toks) >= model.config.vocab_size:
            raise ValueError(f"batch[{j}] token ids must be < vocab_size={model.config.vocab_size}")
    return seqs, ids


def _reserve(paged: PagedKVCache, seqs, ids) -> list[int]:
    """Reserve every sequence's new positions (checking ids against declared prompts first); return the starts."""
    starts = [paged._seq(s).length for s in seqs]
    for s, toks in zip(seqs, ids):
        paged._new_ids(paged._seq(s), len(toks), toks)
    for s, toks in zip(seqs, ids):
        paged.reserve(s, len(toks))
    return starts


def batch_layout(model, paged: PagedKVCache, batch) -> BatchLayout:
    """The layout :func:`batched_forward` would use for ``batch``, computed without changing the pool."""
    seqs, ids = _checked_batch(model, paged, batch)
    state = paged.state()
    try:
        return _layout(paged, seqs, ids, _reserve(paged, seqs, ids), model.device)
    finally:
        paged.set_state(state)


@torch.inference_mode()
def batched_forward(model, paged: PagedKVCache, batch) -> torch.Tensor:
    """Run the new tokens of several paged sequences through the model in one pass.

    ``batch`` is a list of ``(seq_id, token_ids)``: each sequence's next tokens (one
    for a decode step, several for a prompt or a piece of one), appended after what
    the sequence holds. Returns the logits of each sequence's last new token, (len(batch), vocab).
    All or nothing: if anything raises (Ctrl-C included), the pool's bookkeeping is as
    before the call (what was written lies past the sequences' lengths, where nobody reads).
    """
    seqs, ids = _checked_batch(model, paged, batch)
    dev = model.device
    state = paged.state()
    try:
        layout = _layout(paged, seqs, ids, _reserve(paged, seqs, ids), dev)
        step = _BatchStep(paged, layout.new_slots, layout.blocks)
        x = model.embed(torch.tensor([sum(ids, [])], device=dev))  # (1, N, hidden): packed, no padding
        cos, sin = rope_tables(layout.positions, model.config.rope_dim, model.config.rope_theta)
        dtype = model.embed.weight.dtype
        x = model.run_blocks(range(len(model.blocks)), x, cos.to(dtype), sin.to(dtype), step,
                             mask=layout.mask[None, None])
        last = torch.tensor([len(t) for t in ids], device=dev).cumsum(0) - 1  # each sequence's last new token
        logits = model.head(x[0, last])
        for s, toks in zip(seqs, ids):
            paged.advance(s, len(toks), toks)
    except BaseException:
        paged.set_state(state)
        raise
    return logits


# ---------------------------------------------------------------------------------------------
# Requests and what the engine records about them
# ---------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request, as the engine saw it. Times are seconds on the engine's clock (the sum of its steps)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    stop: frozenset = frozenset()
    name: str = ""
    tokens: list[int] = field(default_factory=list)  # what it generated
    token_times: list[float] = field(default_factory=list)  # when each generated token was ready
    arrival_time: float | None = None  # the clock when it arrived (the start of the step it arrived for)
    admitted_step: int | None = None  # the step it first ran in
    first_token_step: int | None = None  # the step that produced its first token
    finish_step: int | None = None
    reused_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed (first admission)
    prefill_tokens: int = 0  # tokens it ran through the model before its first output token (every admission)
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens run again after a preemption

    @property
    def finished(self) -> bool:
        return self.finish_step is not None

    @property
    def ttft(self) -> float | None:
        """Time to first token: from arrival to the end of the step that produced it."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def latency(self) -> float | None:
        """From arrival to the last token."""
        return self.token_times[-1] - self.arrival_time if self.finished and self.token_times else None

    @property
    def inter_token(self) -> list[float]:
        """Seconds between consecutive tokens (what a reader of a streamed answer waits for)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran and how long the forward pass took."""

    step: int
    seconds: float
    decode: int  # sequences that fed one token and chose their next
    prefill_tokens: int  # prompt tokens read this step (all sequences)
    running: int  # sequences admitted after the step
    waiting: int
    free_blocks: int
    kept_blocks: int  # blocks held only by finished requests kept for prefix reuse
    finished: tuple[int, ...] = ()  # request ids that finished this step
    preempted: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.decode + self.prefill_tokens


@dataclass
class _Running:
    """A request in the batch: its paged sequence, and how many of its known tokens the pool holds."""

    record: RequestRecord
    seq_id: int
    order: int  # admission order: the latest admitted is preempted first

    def known(self) -> list[int]:
        """The tokens whose K/V belong in the cache: the prompt, then every output token."""
        return self.record.prompt + self.record.tokens


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class Engine:
    """Continuous batching on one paged pool, one batched forward pass per step.

    model:          a kvlessons TinyDecoder (SmolLM2 included).
    num_blocks:     blocks in the pool; ``block_size`` token slots each.
    max_batch:      most requests running at once (vLLM's ``max_num_seqs``).
    token_budget:   most tokens one step feeds (vLLM's ``max_num_batched_tokens``): decode
                    tokens first, then prompt pieces fill the rest (chunked prefill). None:
                    no limit, every admitted prompt is read whole in one step.
    prefix_caching: find a prompt's leading full blocks in the pool instead of recomputing them.
    keep_finished:  keep a finished request's full blocks for later prompts until the pool
                    needs them (with ``prefix_caching``).

    ``add`` queues a request; ``step`` runs one batched pass; ``run`` steps until every
    request is done. A step is all or nothing: interrupted, the engine and its pool are
    as they were before it.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch: int = 8,
                 token_budget: int | None = None, prefix_caching: bool = True, keep_finished: bool = True):
        self.model = model
        self.max_batch = require_positive_int("max_batch", max_batch)
        if token_budget is not None:
            require_positive_int("token_budget", token_budget)
            if token_budget < max_batch:
                raise ValueError(f"token_budget must be >= max_batch ({max_batch}): every running request "
                                 f"feeds one token per decode step, got {token_budget}")
        self.token_budget = token_budget
        self.keep_finished = keep_finished and prefix_caching
        dtype = model.embed.weight.dtype
        self.paged = PagedKVCache(model.shape, num_blocks, block_size, dtype=dtype, device=model.device,
                                  prefix_sharing=prefix_caching)
        _check_model(model, self.paged)
        self.records: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self.clock = 0.0  # seconds: the sum of the steps' forward passes
        self._pending: list[RequestRecord] = []  # not arrived yet, in arrival order
        self._waiting: deque[RequestRecord] = deque()  # arrived, not running
        self._running: list[_Running] = []
        self._kept: deque[int] = deque()  # seq ids of finished requests kept for prefix reuse, oldest first
        self._admitted = 0

    # -- requests ----------------------------------------------------------------------------------

    def add(self, prompt, max_new_tokens: int, arrival: int | None = None, stop=(), name: str = "") -> int:
        """Queue a request; return its id. ``prompt``: token ids (a list, or a (1, T) / (T,) tensor).

        ``arrival``: the step it arrives for (default: the next step). ``stop``: ids that end
        it early (the stop token is kept as its last output).
        """
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] != 1:
                raise ValueError(f"prompt must be one sequence, got a batch of {prompt.shape[0]}")
            prompt = prompt.reshape(-1).tolist()
        prompt = _token_ids("prompt", prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if max(prompt) >= self.model.config.vocab_size:
            raise ValueError(f"prompt ids must be < vocab_size={self.model.config.vocab_size}")
        require_positive_int("max_new_tokens", max_new_tokens)
        arrival = len(self.steps) if arrival is None else require_positive_int("arrival", arrival, allow_zero=True)
        # Its whole cache (the last output token is never fed) must fit in the pool with nothing else there,
        # or it could be preempted forever.
        need = math.ceil((len(prompt) + max_new_tokens - 1) / self.paged.block_size)
        if need > self.paged.allocator.num_blocks:
            raise ValueError(
                f"prompt and max_new_tokens must fit in the pool: {len(prompt)} + {max_new_tokens} tokens need "
                f"{need} blocks of {self.paged.block_size}, the pool has {self.paged.allocator.num_blocks}"
            )
        record = RequestRecord(len(self.records), prompt, max_new_tokens, arrival,
                               frozenset(_token_ids("stop", stop)), name)
        self.records.append(record)
        self._pending.append(record)
        self._pending.sort(key=lambda r: (r.arrival_step, r.id))
        return record.id

    @property
    def done(self) -> bool:
        return not (self._pending or self._waiting or self._running)

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> StepRecord | None:
        """Admit, schedule, run one batched forward pass, and hand out tokens; None if nothing is left.

        All or nothing: if the pass raises (Ctrl-C included), the engine and the pool are as before.
        """
        if self.done:
            return None
        saved = self._save()
        try:
            return self._step()
        except BaseException:
            self._load(saved)
            raise

    def _save(self):
        return (self.paged.state(), copy.deepcopy((self.records, self._pending, self._waiting, self._running,
                                                   self._kept)), self._admitted, len(self.steps), self.clock)

    def _load(self, saved) -> None:
        state, python, self._admitted, n_steps, self.clock = saved
        self.paged.set_state(state)
        # One deep copy of all of them, so the copied queues point at the copied records.
        records, self._pending, self._waiting, self._running, self._kept = python
        self.records[:] = records  # the same list object: callers may hold it
        del self.steps[n_steps:]

    def _step(self) -> StepRecord:
        number = len(self.steps)
        if not (self._waiting or self._running) and self._pending:
            number = max(number, self._pending[0].arrival_step)  # nothing to do until the next arrival
        while self._pending and self._pending[0].arrival_step <= number:
            record = self._pending.pop(0)
            record.arrival_time = self.clock
            self._waiting.append(record)
        self._admit(number)
        preempted = []
        batch = self._schedule(preempted)
        seconds, chosen = _timed_call(
            lambda: batched_forward(self.model, self.paged, [(run.seq_id, toks) for run, toks in batch]).argmax(-1).tolist(),
            self.model.device)
        self.clock += seconds
        decode, prefill, finished = 0, 0, []
        for (run, toks), token in zip(batch, chosen):
            record = run.record
            pending = len(run.known()) - self.paged._seq(run.seq_id).length
            if len(toks) == 1 and record.tokens and pending == 0:
                decode += 1
            else:
                prefill += len(toks)
                record.prefill_tokens += len(toks)
            if pending:  # the prompt is not all read yet: no token to choose
                continue
            if not record.tokens:
                record.first_token_step = number
            record.tokens.append(token)
            record.token_times.append(self.clock)
            if len(record.tokens) >= record.max_new_tokens or token in record.stop:
                self._finish(run, number)
                finished.append(record.id)
        self._admit(number + 1)  # a finished request's room is free: a newcomer joins the next step
        record = StepRecord(number, seconds, decode, prefill, len(self._running), len(self._waiting) + len(self._pending),
                            self.paged.allocator.num_free, self._kept_blocks(), tuple(finished), tuple(preempted))
        self.steps.append(record)
        return record

    def _admit(self, number: int) -> None:
        """Start waiting requests, first come first served, while the batch and the pool have room (they run from step ``number``)."""
        while self._waiting and len(self._running) < self.max_batch:
            record = self._waiting[0]
            known = record.prompt + record.tokens
            seq_id, reused = self.paged.add_sequence(known)
            # Room for all it must still read, plus the block its first output may open.
            need = self.paged.blocks_needed(seq_id, len(known) - reused)
            if need > self.paged.allocator.num_free + self._kept_blocks():
                self.paged.free(seq_id)
                break
            self._waiting.popleft()
            if record.admitted_step is None:
                record.admitted_step, record.reused_tokens = number, reused
            else:
                record.recomputed_tokens += len(known) - reused
            self._running.append(_Running(record, seq_id, self._admitted))
            self._admitted += 1

    def _schedule(self, preempted: list[int]) -> list[tuple[_Running, list[int]]]:
        """This step's (request, new tokens): decode tokens first, then prompt pieces within the budget."""
        while True:
            budget = math.inf if self.token_budget is None else self.token_budget
            batch = []
            decoding = [r for r in self._running if len(r.known()) - self.paged._seq(r.seq_id).length == 1]
            reading = [r for r in self._running if r not in decoding]
            for run in decoding + reading:
                if budget <= 0:
                    break
                length = self.paged._seq(run.seq_id).length
                toks = run.known()[length : length + int(min(budget, len(run.known()) - length))]
                batch.append((run, toks))
                budget -= len(toks)
            need = sum(self.paged.blocks_needed(run.seq_id, len(toks)) for run, toks in batch)
            if need <= self.paged.allocator.num_free:
                return batch
            if self._kept:  # drop the oldest kept prefix first
                self.paged.free(self._kept.popleft())
            elif len(self._running) > 1:
                victim = max(self._running, key=lambda r: r.order)
                self._preempt(victim)
                preempted.append(victim.record.id)
            else:  # cannot happen: add() made sure a request fits alone
                raise PoolExhaustedError(f"a lone request needs {need} blocks, the pool has {self.paged.allocator.num_free}")

    def _preempt(self, run: _Running) -> None:
        """Free a running request's blocks and queue it first; it keeps its tokens and re-reads them later."""
        self.paged.free(run.seq_id)
        self._running.remove(run)
        run.record.preemptions += 1
        self._waiting.appendleft(run.record)

    def _finish(self, run: _Running, number: int) -> None:
        run.record.finish_step = number
        self._running.remove(run)
        seq = self.paged._seq(run.seq_id)
        full = seq.length // self.paged.block_size * self.paged.block_size
        if self.keep_finished and full:
            self.paged.crop(run.seq_id, full)  # keep only full blocks: the ones a later prompt can match
            self._kept.append(run.seq_id)
        else:
            self.paged.free(run.seq_id)

    def _kept_blocks(self) -> int:
        """Blocks that only kept finished requests hold: freed if the pool needs room."""
        holders: dict[int, int] = {}
        for sid in self._kept:
            for b in self.paged._seq(sid).table:
                holders[b] = holders.get(b, 0) + 1
        return sum(1 for b, n in holders.items() if n == self.paged.allocator.ref_counts[b])

    def run(self, max_steps: int = 100_000) -> list[RequestRecord]:
        """Step until every request has finished; return the records in request order."""
        require_positive_int("max_steps", max_steps)
        for _ in range(max_steps):
            if self.step() is None:
                break
        else:
            if not self.done:
                raise RuntimeError(f"requests still running after max_steps={max_steps} steps")
        return self.records

    def release_kept(self) -> None:
        """Free the blocks kept for prefix reuse (the prefix cache empties)."""
        while self._kept:
            self.paged.free(self._kept.popleft())
