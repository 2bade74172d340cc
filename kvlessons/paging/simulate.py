"""A serving simulation (lesson 06): contiguous reservation against paging, at one memory budget.

Time runs in steps. Each step computes at most ``token_budget`` tokens (vLLM's
``max_num_batched_tokens``): one decode token for every sequence past its prefill, then
chunks of prompts (chunked prefill). A paged pool that runs dry preempts the most
recently admitted sequence, by recompute or by swap. ``SimResult.assumptions()`` says in
sentences what the simulation does and what it leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..shape import require_positive_int

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class Request:
    id: int
    arrival: int  # step at which it arrives
    prompt_len: int
    output_len: int


def make_workload(n_requests: int = 200, seed: int = 0, mean_prompt: int = 300, mean_output: int = 200, max_len: int = 2048, arrivals_per_step: float = 0.5) -> list[Request]:
    """Requests with random (geometric-like) prompt and output lengths, capped at ``max_len`` in total."""
    require_positive_int("n_requests", n_requests)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n_requests, 3, generator=g)  # exponential lengths and gaps by inverse transform
    requests, t = [], 0.0
    for i in range(n_requests):
        prompt = max(1, int(-mean_prompt * math.log(1 - u[i, 0].item())))
        output = max(1, int(-mean_output * math.log(1 - u[i, 1].item())))
        prompt = min(prompt, max_len - 1)
        output = min(output, max_len - prompt)
        t += -math.log(1 - u[i, 2].item()) / arrivals_per_step
        requests.append(Request(i, int(t), prompt, output))
    return requests


@dataclass
class RequestOutcome:
    """What happened to one request. Steps are indices counted from 0, like ``Request.arrival``."""

    arrival: int
    prompt_len: int
    output_len: int
    generated: int = 0  # output tokens produced so far; a preemption never takes them back
    first_token_step: int | None = None  # the step whose prefill produced the first output token
    finish_step: int | None = None  # the step that produced the last output token
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens whose keys and values preemptions threw away, to be computed again

    @property
    def ttft(self) -> int | None:
        """Time to first token in steps: from arrival, counting the step that produced it (None if it never came)."""
        return None if self.first_token_step is None else self.first_token_step - self.arrival + 1

    @property
    def latency(self) -> int | None:
        """Steps from arrival to the last output token, counting the step that produced it (None if unfinished)."""
        return None if self.finish_step is None else self.finish_step - self.arrival + 1


@dataclass
class SimResult:
    """Per-step records of one simulated run, per-request outcomes, and the run's settings."""

    policy: str
    capacity: int  # token slots in the budget
    block_size: int = 16
    token_budget: int = 2048  # tokens one step may compute
    preemption: str = "recompute"
    swap_blocks: int | None = None  # host memory for swapped blocks (preemption="swap")
    max_len: int = 2048
    max_new_tokens: int | None = None
    steps: int = 0
    running: list[int] = field(default_factory=list)  # sequences holding cache at the end of each step
    used: list[int] = field(default_factory=list)  # token slots holding K/V at each step
    held: list[int] = field(default_factory=list)  # token slots reserved/allocated at each step
    largest_hole: list[int] = field(default_factory=list)  # biggest run of free slots one request could use
    batched: list[int] = field(default_factory=list)  # tokens computed at each step (decode and prefill)
    finished: int = 0
    preempted: int = 0
    recomputed_tokens: int = 0  # tokens discarded by recompute preemptions (each is computed a second time)
    swapped_out_blocks: int = 0  # blocks copied to host memory
    swapped_in_blocks: int = 0  # blocks copied back
    swap_fallbacks: int = 0  # swap preemptions recomputed instead, host memory being full
    max_table_entries: int = 0
    requests: dict[int, RequestOutcome] = field(default_factory=dict)

    @property
    def waste(self) -> float:
        """Held-but-unused slots as a fraction of held slots, averaged over steps with anything held."""
        fractions = [(h - u) / h for h, u in zip(self.held, self.used) if h]
        return sum(fractions) / len(fractions) if fractions else 0.0

    @property
    def mean_running(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0

    @property
    def output_tokens(self) -> int:
        """Output tokens produced, all requests together."""
        return sum(o.generated for o in self.requests.values())

    @property
    def throughput(self) -> float:
        """Output tokens per step over the whole run."""
        return self.output_tokens / self.steps if self.steps else 0.0

    def ttfts(self) -> list[int]:
        """Time to first token (steps) of every request that got one, in request order."""
        return [o.ttft for o in self.requests.values() if o.ttft is not None]

    @property
    def mean_ttft(self) -> float:
        values = self.ttfts()
        return sum(values) / len(values) if values else 0.0

    def ttft_percentile(self, q: float) -> int:
        """The ``q``-th percentile of time to first token, nearest rank (the smallest value at or above q% of them)."""
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 100:
            raise ValueError(f"q must be a percentage in (0, 100], got {q!r}")
        values = sorted(self.ttfts())
        if not values:
            raise ValueError("no request produced a first token, so there is no time to first token to rank")
        return values[max(1, math.ceil(q / 100 * len(values))) - 1]

    def fragmentation(self) -> list[float]:
        """Per step, the share of free slots outside the largest usable run (0 = none)."""
        out = []
        for held, hole in zip(self.held, self.largest_hole):
            free = self.capacity - held
            out.append(1 - hole / free if free > 0 else 0.0)
        return out

    def assumptions(self) -> list[str]:
        """What this run assumed and what it left out, one plain sentence each."""
        lines = [
            "Time runs in steps, and every step lasts the same, whatever mix of prefill and decode tokens it computes.",
            f"A step computes at most {self.token_budget:,} tokens (the token budget; vLLM calls it max_num_batched_tokens).",
            "Each step first gives one token to every sequence past its prefill, in the order they were admitted; "
            "if they outnumber the budget, the later ones wait a step.",
            "The rest of the budget goes to prompts: the one part-way through its prefill (there is at most one) first, "
            "then requests from the queue, first come, first served; a prompt longer than what is left is split over "
            "several steps (chunked prefill).",
            "A request arriving at step t joins the queue at step t; a prompt's last chunk also produces the first output "
            "token, each later step produces one more, and a finished sequence frees its memory at the end of its last step.",
        ]
        if self.policy == "contiguous":
            reserved = f"{self.max_len:,} slots" if self.max_new_tokens is None else (
                f"its prompt plus {self.max_new_tokens:,} output slots (at most {self.max_len:,})")
            lines += [
                "Contiguous: a reservation never runs out, so nothing is preempted.",
                f"An admitted request reserves {reserved} in one run of adjacent slots, the first that fits; "
                "the head of the queue waits until such a run is free, and the requests behind it wait too.",
            ]
        else:
            lines += [
                f"Paged: blocks of {self.block_size} slots are taken as tokens are computed; a request is admitted when "
                "the blocks for its first chunk are free, and the requests behind the head of the queue wait with it.",
                "When a sequence needs a block and none is free, the most recently admitted sequence (perhaps the one "
                "asking) is preempted and put back at the front of the queue, and no request is admitted in that step.",
            ]
            if self.preemption == "recompute":
                lines.append(
                    "Preemption by recompute: the victim's blocks are freed and its keys and values are lost, but its "
                    "output so far is kept; readmitted, it prefills its prompt and that output again through the token "
                    "budget, and then continues where it stopped.")
            else:
                lines.append(
                    f"Preemption by swap: the victim's blocks are copied to a host memory of {self.swap_blocks:,} blocks "
                    "and copied back when it is readmitted, so nothing is recomputed; when host memory cannot hold "
                    "them, the victim is recomputed instead (counted as a swap fallback).")
                lines.append(
                    "The copies to and from host memory take no time here; on a real server they cross the bus between "
                    "GPU and host, and a step may wait for them.")
        lines.append(
            "Not modelled: the time a real step takes, which grows with its tokens and their contexts and depends on "
            "the kernels; prefix caching; a cap on the sequences per step (vLLM's max_num_seqs); memory outside the "
            "KV cache; requests cancelled by their clients.")
        return lines


def _first_fit(free_runs: list[list[int]], size: int) -> int | None:
    for run in free_runs:
        if run[1] - run[0] >= size:
            start = run[0]
            run[0] += size
            return start
    return None


def _release(free_runs: list[list[int]], start: int, size: int) -> list[list[int]]:
    runs = sorted(free_runs + [[start, start + size]])
    merged = []
    for run in runs:
        if merged and merged[-1][1] == run[0]:
            merged[-1][1] = run[1]
        elif run[1] > run[0]:
            merged.append(run)
    return merged


@dataclass
class _Seq:
    """A request inside the simulation."""

    req: Request
    out: RequestOutcome
    computed: int = 0  # tokens whose K/V is in the cache (or in host memory while swapped out)
    blocks: int = 0  # paged: blocks held on the device
    start: int = 0  # contiguous: first reserved slot
    size: int = 0  # contiguous: reserved slots
    swapped: int = 0  # blocks held in host memory while it waits

    @property
    def pending(self) -> int:
        """Tokens to compute before it can produce its next output token: prompt and output so far, less those cached."""
        return self.req.prompt_len + self.out.generated - self.computed


def _check_requests(requests: list[Request], max_len: int) -> None:
    seen = set()
    for r in requests:
        if r.id in seen:
            raise ValueError(f"request ids must be unique: {r.id} appears twice")
        seen.add(r.id)
        for name in ("arrival", "prompt_len", "output_len"):
            require_positive_int(f"request {r.id}'s {name}", getattr(r, name), allow_zero=name == "arrival")
    if any(r.prompt_len + r.output_len > max_len for r in requests):
        raise ValueError("every request must fit in max_len tokens")


def simulate(requests: list[Request], capacity: int, policy: str = "paged", block_size: int = 16, max_len: int = 2048, max_new_tokens: int | None = None, max_steps: int = 100_000, token_budget: int = 2048, preemption: str = "recompute", swap_blocks: int | None = None) -> SimResult:
    """Serve ``requests`` with ``capacity`` token slots of cache, at most ``token_budget`` tokens computed per step.

    Each step gives one decode token to every sequence past its prefill, then the rest
    of the budget to prompt chunks (the prompt part-way through first, then the queue,
    first come, first served). A prompt's last chunk produces the first output token.

    contiguous: each admitted request reserves the most it may need in adjacent slots
    (first fit in one address space), as a system that does not know the final length
    must: prompt + ``max_new_tokens`` (capped at ``max_len``), or ``max_len`` when
    ``max_new_tokens`` is None. Nothing is preempted.
    paged: blocks of ``block_size`` as tokens are computed; if the pool runs dry, the
    most recently admitted sequence is preempted and requeued at the front. With
    ``preemption="recompute"`` (vLLM's V1 engine) its blocks are dropped and it prefills
    its prompt and the output it already has again; with ``"swap"`` its blocks go to host
    memory of ``swap_blocks`` blocks and come back unchanged (recompute when they do not fit).
    ``SimResult.assumptions()`` lists all of it in sentences.
    """
    if policy not in ("paged", "contiguous"):
        raise ValueError(f"policy must be 'paged' or 'contiguous', got {policy!r}")
    if preemption not in PREEMPTION_MODES:
        raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
    require_positive_int("capacity", capacity)
    require_positive_int("block_size", block_size)
    require_positive_int("token_budget", token_budget)
    require_positive_int("max_steps", max_steps)
    if preemption == "swap":
        if policy == "contiguous":
            raise ValueError("preemption='swap' needs policy='paged': contiguous reservations are never preempted")
        if swap_blocks is None:
            raise ValueError("preemption='swap' needs swap_blocks, the host memory for swapped-out blocks, in blocks")
        require_positive_int("swap_blocks", swap_blocks, allow_zero=True)
    elif swap_blocks is not None:
        raise ValueError(f"swap_blocks is used only with preemption='swap', got preemption={preemption!r}")
    _check_requests(requests, max_len)
    if max_new_tokens is not None:
        require_positive_int("max_new_tokens", max_new_tokens)
        if any(r.output_len > max_new_tokens for r in requests):
            raise ValueError("max_new_tokens must cover every request's output (it is the reservation)")

    def reservation(r: Request) -> int:
        """Adjacent slots a contiguous system reserves for ``r``."""
        return max_len if max_new_tokens is None else min(max_len, r.prompt_len + max_new_tokens)

    # A request that cannot fit even alone would wait (contiguous) or be preempted (paged) forever.
    num_blocks = capacity // block_size
    for r in requests:
        if policy == "contiguous" and reservation(r) > capacity:
            raise ValueError(
                f"every request's reservation must fit in the capacity: request {r.id} reserves "
                f"{reservation(r)} slots, more than the whole capacity of {capacity}"
            )
        # The last output token is never fed back, so the cache holds at most prompt + output - 1 tokens.
        most = math.ceil((r.prompt_len + r.output_len - 1) / block_size)
        if policy == "paged" and most > num_blocks:
            raise ValueError(
                f"every request must fit in the capacity: request {r.id} grows to {most} blocks of {block_size}, "
                f"more than the whole capacity of {num_blocks} blocks ({capacity} slots)"
            )
    result = SimResult(policy, capacity, block_size, token_budget, preemption, swap_blocks, max_len, max_new_tokens)
    result.requests = {r.id: RequestOutcome(r.arrival, r.prompt_len, r.output_len) for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival)
    queue: list[_Seq] = []
    running: dict[int, _Seq] = {}  # in order of admission (a readmitted sequence goes to the end)
    free_runs = [[0, capacity]]
    free_blocks = num_blocks
    swap_used = 0
    step = 0
    while (pending or queue or running) and step < max_steps:
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            queue.append(_Seq(r, result.requests[r.id]))
        budget = token_budget
        scheduled: list[tuple[_Seq, int]] = []
        preempted_now = False

        def preempt(victim: _Seq) -> None:
            nonlocal free_blocks, swap_used, preempted_now
            del running[victim.req.id]
            free_blocks += victim.blocks
            result.preempted += 1
            victim.out.preemptions += 1
            if preemption == "swap" and swap_used + victim.blocks <= swap_blocks:
                victim.swapped = victim.blocks
                swap_used += victim.blocks
                result.swapped_out_blocks += victim.blocks
            else:
                if preemption == "swap":
                    result.swap_fallbacks += 1
                result.recomputed_tokens += victim.computed
                victim.out.recomputed_tokens += victim.computed
                victim.computed = 0  # the output tokens stay generated: it prefills them with its prompt
            victim.blocks = 0
            queue.insert(0, victim)
            preempted_now = True

        # Running sequences in order of admission: decodes (one token each), then at most one unfinished prompt
        # (a prompt cut short by the budget used all of it, so nothing was admitted after it).
        for rid in list(running):
            s = running.get(rid)
            if s is None:  # preempted earlier in this step
                continue
            if budget == 0:
                break
            n = min(s.pending, budget)
            if policy == "paged":
                need = math.ceil((s.computed + n) / block_size) - s.blocks
                while need > free_blocks:  # the latest admitted has not been scheduled yet in this step
                    preempt(running[next(reversed(running))])
                    if rid not in running:
                        break
                if rid not in running:
                    continue
                free_blocks -= need
                s.blocks += need
            scheduled.append((s, n))
            budget -= n
        # Then the queue, first come, first served, unless a preemption shows memory is short.
        while queue and budget > 0 and not preempted_now:
            s = queue[0]
            n = min(s.pending, budget)
            if policy == "contiguous":
                size = reservation(s.req)
                start = _first_fit(free_runs, size)
                if start is None:
                    break
                s.start, s.size = start, size
            else:
                need = math.ceil((s.computed + n) / block_size)
                if need > free_blocks:
                    break
                free_blocks -= need
                s.blocks = need
                if s.swapped:
                    result.swapped_in_blocks += s.swapped
                    swap_used -= s.swapped
                    s.swapped = 0
            queue.pop(0)
            running[s.req.id] = s
            scheduled.append((s, n))
            budget -= n
        # The step runs: every scheduled chunk is computed; a sequence whose prompt and output are all cached samples.
        for s, n in scheduled:
            s.computed += n
            result.max_table_entries = max(result.max_table_entries, s.blocks)
            if s.pending:
                continue
            s.out.generated += 1
            if s.out.first_token_step is None:
                s.out.first_token_step = step
            if s.out.generated == s.req.output_len:
                s.out.finish_step = step
                result.finished += 1
                del running[s.req.id]
                if policy == "contiguous":
                    free_runs = _release(free_runs, s.start, s.size)
                else:
                    free_blocks += s.blocks
        result.batched.append(token_budget - budget)
        result.running.append(len(running))
        result.used.append(sum(s.computed for s in running.values()))
        if policy == "contiguous":
            result.held.append(sum(s.size for s in running.values()))
            result.largest_hole.append(max((b - a for a, b in free_runs), default=0))
        else:
            result.held.append(sum(s.blocks for s in running.values()) * block_size)
            result.largest_hole.append(free_blocks * block_size)
        step += 1
    result.steps = step
    return result
