"""A serving simulation (lesson 06): contiguous reservation against paging, at one memory budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..shape import require_positive_int


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
class SimResult:
    """Per-step records of one simulated run and its summary."""

    policy: str
    capacity: int  # token slots in the budget
    steps: int = 0
    running: list[int] = field(default_factory=list)  # sequences decoding at each step
    used: list[int] = field(default_factory=list)  # token slots holding K/V at each step
    held: list[int] = field(default_factory=list)  # token slots reserved/allocated at each step
    largest_hole: list[int] = field(default_factory=list)  # biggest run of free slots one request could use
    finished: int = 0
    preempted: int = 0
    max_table_entries: int = 0

    @property
    def waste(self) -> float:
        """Held-but-unused slots as a fraction of held slots, averaged over steps with anything held."""
        fractions = [(h - u) / h for h, u in zip(self.held, self.used) if h]
        return sum(fractions) / len(fractions) if fractions else 0.0

    @property
    def mean_running(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0

    def fragmentation(self) -> list[float]:
        """Per step, the share of free slots outside the largest usable run (0 = none)."""
        out = []
        for held, hole in zip(self.held, self.largest_hole):
            free = self.capacity - held
            out.append(1 - hole / free if free > 0 else 0.0)
        return out


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


def simulate(requests: list[Request], capacity: int, policy: str = "paged", block_size: int = 16, max_len: int = 2048, max_new_tokens: int | None = None, max_steps: int = 100_000) -> SimResult:
    """Serve ``requests`` with ``capacity`` token slots of cache, one decode token per running sequence per step.

    contiguous: each admitted request reserves the most it may need in adjacent slots
    (first fit in one address space), as a system that does not know the final length
    must: prompt + ``max_new_tokens`` (capped at ``max_len``), or ``max_len`` when
    ``max_new_tokens`` is None.
    paged: blocks of ``block_size`` on demand; if the pool runs dry mid-generation,
    the most recently admitted sequence is preempted (freed and queued again).
    Admission is first come, first served.
    """
    if policy not in ("paged", "contiguous"):
        raise ValueError(f"policy must be 'paged' or 'contiguous', got {policy!r}")
    require_positive_int("capacity", capacity)
    require_positive_int("block_size", block_size)
    if any(r.prompt_len + r.output_len > max_len for r in requests):
        raise ValueError("every request must fit in max_len tokens")
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
        most = math.ceil(max(r.prompt_len + r.output_len, r.prompt_len + 1) / block_size)
        if policy == "paged" and most > num_blocks:
            raise ValueError(
                f"every request must fit in the capacity: request {r.id} grows to {most} blocks of {block_size}, "
                f"more than the whole capacity of {num_blocks} blocks ({capacity} slots)"
            )
    result = SimResult(policy, capacity)
    pending = sorted(requests, key=lambda r: r.arrival)
    queue: list[Request] = []
    running: dict[int, dict] = {}  # id -> {"req", "len", "start" | "blocks"}
    free_runs = [[0, capacity]]
    free_blocks = num_blocks
    step = 0
    while (pending or queue or running) and step < max_steps:
        while pending and pending[0].arrival <= step:
            queue.append(pending.pop(0))
        # Admit in order while the head of the queue fits.
        while queue:
            r = queue[0]
            if policy == "contiguous":
                size = reservation(r)
                start = _first_fit(free_runs, size)
                if start is None:
                    break
                running[r.id] = {"req": r, "len": r.prompt_len, "start": start, "size": size}
            else:
                need = math.ceil((r.prompt_len + 1) / block_size)
                if need > free_blocks:
                    break
                free_blocks -= need
                running[r.id] = {"req": r, "len": r.prompt_len, "blocks": need}
            queue.pop(0)
        # One decode step for every running sequence.
        for rid in list(running):
            s = running.get(rid)
            if s is None:
                continue
            if policy == "paged" and s["len"] + 1 > s["blocks"] * block_size:
                if free_blocks == 0:  # preempt the latest arrival (perhaps this one): it restarts later
                    # (never a sequence running alone: it would hold every block, and the checks above
                    # made sure no request needs more)
                    victim = max(running, key=lambda i: (running[i]["req"].arrival, i))
                    gone = running.pop(victim)
                    free_blocks += gone["blocks"]
                    queue.insert(0, gone["req"])
                    result.preempted += 1
                    if victim == rid:
                        continue
                free_blocks -= 1
                s["blocks"] += 1
            s["len"] += 1
            result.max_table_entries = max(result.max_table_entries, s.get("blocks", 0))
            if s["len"] >= s["req"].prompt_len + s["req"].output_len:
                done = running.pop(rid)
                result.finished += 1
                if policy == "contiguous":
                    free_runs = _release(free_runs, done["start"], done["size"])
                else:
                    free_blocks += done["blocks"]
        result.running.append(len(running))
        result.used.append(sum(s["len"] for s in running.values()))
        if policy == "contiguous":
            result.held.append(sum(s["size"] for s in running.values()))
            result.largest_hole.append(max((b - a for a, b in free_runs), default=0))
        else:
            result.held.append(sum(s["blocks"] for s in running.values()) * block_size)
            result.largest_hole.append(free_blocks * block_size)
        step += 1
    result.steps = step
    return result
