"""Paged attention: a pool of fixed-size blocks, a block table per sequence, prefix sharing.

As in vLLM (Kwon et al. 2023, arXiv 2309.06180): the cache of every sequence lives in
blocks of ``block_size`` token slots taken from one shared pool; a sequence's block
table maps its positions to blocks (position p is slot p % block_size of block
table[p // block_size]). A sequence wastes at most the unused tail of its last block.
Blocks are reference counted, so a forked sequence or a second request with the same
prompt prefix shares blocks instead of copying them; the first write into a shared,
partly filled block copies it (copy-on-write).

``BlockTables`` is the bookkeeping alone (used by the simulations and the widget);
``PagedKVCache`` adds the K/V pools and plugs into the model through ``view(seq)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .attention import causal_mask
from .cache import KVCache, LayerCache, _check_kv
from .shape import ModelShape, require_positive_int


class PoolExhaustedError(ValueError):
    """The pool has too few free blocks for a request; nothing was changed."""


class BlockAllocator:
    """A free list and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = require_positive_int("num_blocks", num_blocks)
        self.block_size = require_positive_int("block_size", block_size)
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each); all or nothing."""
        require_positive_int("n", n)
        if n > len(self._free):
            raise PoolExhaustedError(f"need {n} free blocks, the pool has {len(self._free)} of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        self._check_live(block)
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; return True if the block became free."""
        self._check_live(block)
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
            return True
        return False

    def _check_live(self, block: int) -> None:
        if not 0 <= block < self.num_blocks or self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated")

    def free_blocks(self) -> set[int]:
        return set(self._free)


@dataclass
class _Sequence:
    table: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] = field(default_factory=list)  # known token ids (for prefix hashing), may lag length


class BlockTables:
    """Per-sequence block tables over one allocator, with copy-on-write and prefix sharing.

    Positions are reserved with :meth:`reserve` (all or nothing) before they are
    written, and counted with :meth:`advance` after. ``prefix_sharing`` reuses full
    blocks whose (parent hash, tokens) match a live block's.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_sharing: bool = True):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._hash_to_block: dict[int, int] = {}  # full, hashed blocks that are alive
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens) for verification
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies made by copy-on-write

    # -- sequences ----------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        if seq_id not in self.sequences:
            raise ValueError(f"seq_id {seq_id} is not a live sequence")
        return self.sequences[seq_id]

    def add_sequence(self, prompt: list[int] | None = None) -> tuple[int, int]:
        """Start a sequence; return (seq_id, tokens already cached by prefix sharing).

        With ``prompt`` token ids and prefix sharing on, every full leading block of the
        prompt whose hash chain matches a live block is shared (reference count + 1)
        instead of recomputed; the caller only needs to run the model on the rest.
        """
        seq = _Sequence(tokens=list(prompt or []))
        reused = 0
        if self.prefix_sharing and prompt:
            for _, key, h in self._block_keys(prompt, len(prompt) // self.block_size):
                block = self._hash_to_block.get(h)
                if block is None or self._block_key[block] != key:
                    break
                self.allocator.incref(block)
                seq.table.append(block)
                reused += self.block_size
            # Keep at least the last prompt token to compute: its logits start generation.
            if reused == len(prompt) and reused:
                self.allocator.decref(seq.table.pop())
                reused -= self.block_size
        seq.length = reused
        return self._register(seq), reused

    def _register(self, seq: _Sequence) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = seq
        return seq_id

    def _block_keys(self, tokens: list[int], n_blocks: int):
        """(index, key, hash) of the first ``n_blocks`` full blocks; key = (parent block's hash, tokens)."""
        parent = 0
        for i in range(n_blocks):
            key = (parent, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))
            parent = hash(key)
            yield i, key, parent

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block (and the length) of ``seq_id``."""
        parent = self._seq(seq_id)
        for b in parent.table:
            self.allocator.incref(b)
        return self._register(_Sequence(list(parent.table), parent.length, list(parent.tokens)))

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (shared ones stay for their other holders)."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"seq_id {seq_id} is not a live sequence")
        for b in seq.table:
            if self.allocator.decref(b):
                self._forget_hash(b)

    def _forget_hash(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None:
            h = hash(key)
            if self._hash_to_block.get(h) == block:
                del self._hash_to_block[h]

    # -- growth --------------------------------------------------------------------------------

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Free blocks a ``new_tokens`` append would take (new blocks plus a copy-on-write)."""
        seq = self._seq(seq_id)
        bs = self.block_size
        total = math.ceil((seq.length + new_tokens) / bs) - len(seq.table)
        partial = seq.length % bs
        if partial and self.allocator.ref_counts[seq.table[seq.length // bs]] > 1:
            total += 1  # the shared, partly filled last block must be copied before the write
        return max(total, 0)

    def reserve(self, seq_id: int, new_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``new_tokens`` more positions; return the (src, dst) copies to perform.

        Raises PoolExhaustedError, changing nothing, if the pool cannot supply the blocks.
        """
        require_positive_int("new_tokens", new_tokens)
        seq = self._seq(seq_id)
        need = self.blocks_needed(seq_id, new_tokens)
        if need > self.allocator.num_free:
            raise PoolExhaustedError(
                f"sequence {seq_id} needs {need} more blocks for {new_tokens} tokens; "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free"
            )
        copies = []
        bs = self.block_size
        if seq.length % bs and self.allocator.ref_counts[seq.table[seq.length // bs]] > 1:
            old = seq.table[seq.length // bs]
            (new,) = self.allocator.allocate(1)
            self.allocator.decref(old)  # still held by the others
            seq.table[seq.length // bs] = new
            copies.append((old, new))
        missing = math.ceil((seq.length + new_tokens) / bs) - len(seq.table)
        if missing > 0:
            seq.table.extend(self.allocator.allocate(missing))
        self.copies.extend(copies)
        return copies

    def advance(self, seq_id: int, new_tokens: int, tokens: list[int] | None = None) -> None:
        """Count ``new_tokens`` written positions (optionally their ids, for prefix hashing)."""
        seq = self._seq(seq_id)
        if seq.length + new_tokens > len(seq.table) * self.block_size:
            raise ValueError("advance past the reserved blocks: call reserve() first")
        seq.length += new_tokens
        if tokens is not None:
            seq.tokens.extend(tokens)
        self._register_full_blocks(seq)

    def append(self, seq_id: int, new_tokens: int = 1, tokens: list[int] | None = None) -> None:
        """Reserve and count ``new_tokens`` positions (a block is taken only when the last one is full)."""
        self.reserve(seq_id, new_tokens)
        self.advance(seq_id, new_tokens, tokens)

    def _register_full_blocks(self, seq: _Sequence) -> None:
        if not self.prefix_sharing:
            return
        known = min(seq.length, len(seq.tokens))
        for i, key, h in self._block_keys(seq.tokens, known // self.block_size):
            block = seq.table[i]
            if block not in self._block_key and h not in self._hash_to_block:
                self._hash_to_block[h] = block
                self._block_key[block] = key

    # -- measures -------------------------------------------------------------------------------

    def slots_used(self) -> int:
        """Token positions stored, counting a shared block's positions once."""
        seen, used = set(), 0
        for seq in self.sequences.values():
            for i, b in enumerate(seq.table):
                if b not in seen:
                    seen.add(b)
                    used += min(self.block_size, max(0, seq.length - i * self.block_size))
        return used

    def slots_held(self) -> int:
        """Token slots in blocks that are allocated."""
        return (self.allocator.num_blocks - self.allocator.num_free) * self.block_size

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        holders = [0] * self.allocator.num_blocks
        for seq in self.sequences.values():
            assert len(seq.table) * self.block_size >= seq.length, "a sequence is longer than its blocks"
            assert len(set(seq.table)) == len(seq.table), "a block appears twice in one table"
            for b in seq.table:
                holders[b] += 1
        free = self.allocator.free_blocks()
        assert len(free) == self.allocator.num_free, "a block is on the free list twice"
        for b, (count, held) in enumerate(zip(self.allocator.ref_counts, holders)):
            assert count == held, f"block {b}: reference count {count}, held by {held} tables"
            assert (b in free) == (count == 0), f"block {b} is both free and owned, or neither"


# ---------------------------------------------------------------------------------------------
# Attention through a block table
# ---------------------------------------------------------------------------------------------


def slot_indices(block_table: list[int] | torch.Tensor, seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Flat pool slot of every position 0..seq_len-1: table[p // block_size] * block_size + p % block_size."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=device)
    pos = torch.arange(seq_len, device=table.device)
    return table[pos // block_size] * block_size + pos % block_size


def gather_rows(pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """A sequence's rows (seq_len, H_kv, D) from a pool (num_blocks, block_size, H_kv, D), whole blocks at a time."""
    num_blocks, block_size, h, d = pool.shape
    n = -(-seq_len // block_size)
    table = torch.as_tensor(block_table, dtype=torch.long, device=pool.device)[:n]
    return pool.index_select(0, table).view(n * block_size, h, d)[:seq_len]


def gather_kv(pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """One sequence's K or V (1, H_kv, seq_len, D), laid out as contiguous attention expects."""
    return gather_rows(pool, block_table, seq_len).transpose(0, 1).unsqueeze(0)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """Attention (1, H_q, T, D) of a sequence's last T queries over its keys, read through the block table.

    The blocks are gathered whole (one index per block, not per token) and attention
    is computed in the pool's (token, head, dim) layout, so nothing is transposed or
    copied a second time. The bottom-right causal mask applies for T > 1.
    """
    k, v = gather_rows(k_pool, block_table, seq_len), gather_rows(v_pool, block_table, seq_len)  # (S, H_kv, D)
    _, h_q, t, d = q.shape
    h_kv = k.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    g = h_q // h_kv
    qg = q[0].reshape(h_kv, g * t, d)  # each KV head's group of query heads, all T queries: one matmul per head
    scores = qg @ k.permute(1, 2, 0) / d**0.5  # (H_kv, g*T, S), reading k in place
    if t > 1:
        mask = causal_mask(t, seq_len, device=q.device)
        scores = scores.view(h_kv, g, t, seq_len).masked_fill(~mask, float("-inf")).view(h_kv, g * t, seq_len)
    out = scores.softmax(-1) @ v.transpose(0, 1)  # (H_kv, g*T, D)
    return out.reshape(1, h_q, t, d)


def paged_attention_blockwise(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The same result, one block at a time with a running softmax, as a paged kernel computes it.

    Never materialises the whole sequence's K/V: each block's scores update a running
    maximum, denominator and weighted sum (the online softmax of FlashAttention).
    Decode form: one query per sequence (T = 1).
    """
    if q.shape[2] != 1:
        raise ValueError("paged_attention_blockwise is the decode form: q must hold one token (T = 1)")
    _, block_size, h_kv, d = k_pool.shape
    g = q.shape[1] // h_kv
    qg = q[0, :, 0].view(h_kv, g, d).to(torch.float32) / d**0.5  # (H_kv, g, D)
    running_max = torch.full((h_kv, g), float("-inf"), device=q.device)
    denom = torch.zeros(h_kv, g, device=q.device)
    acc = torch.zeros(h_kv, g, d, device=q.device)
    for i, block in enumerate(block_table[: math.ceil(seq_len / block_size)]):
        n = min(block_size, seq_len - i * block_size)
        k = k_pool[block, :n].transpose(0, 1).to(torch.float32)  # (H_kv, n, D)
        v = v_pool[block, :n].transpose(0, 1).to(torch.float32)
        scores = qg @ k.transpose(-1, -2)  # (H_kv, g, n)
        new_max = torch.maximum(running_max, scores.amax(-1))
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + p @ v
        running_max = new_max
    return (acc / denom[..., None]).reshape(1, h_kv * g, 1, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The K/V pools and the model-facing view
# ---------------------------------------------------------------------------------------------


class PagedKVCache(BlockTables):
    """K/V pools of shape (num_blocks, block_size, kv_heads, head_dim) per layer, shared by all sequences.

    Run the model on one sequence through ``view(seq_id)``, a cache with the
    foundation's interface: the model is unchanged.
    """

    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int = 16, dtype=torch.float32, device=None, prefix_sharing: bool = True):
        super().__init__(num_blocks, block_size, prefix_sharing)
        if shape.latent_dim is not None or any(shape.window(i) is not None for i in range(shape.layers)):
            raise ValueError("PagedKVCache stores full-attention K/V layers (no windows, no latent caches)")
        self.shape = shape
        pool = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.k_pools = {i: torch.zeros(pool, dtype=dtype, device=device) for i in shape.cache_layers}
        self.v_pools = {i: torch.zeros(pool, dtype=dtype, device=device) for i in shape.cache_layers}

    def nbytes(self) -> int:
        """Bytes of the pools: all blocks, free or not (a serving system allocates the pool up front)."""
        return sum(p.nbytes for p in self.k_pools.values()) + sum(p.nbytes for p in self.v_pools.values())

    def bytes_per_block(self) -> int:
        return self.nbytes() // self.allocator.num_blocks

    def reserve(self, seq_id, new_tokens):
        copies = super().reserve(seq_id, new_tokens)
        for src, dst in copies:  # copy-on-write: the new block starts as the shared one's copy
            for pools in (self.k_pools, self.v_pools):
                for pool in pools.values():
                    pool[dst] = pool[src]
        return copies

    def write(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V (1, H_kv, T, D) at the sequence's next T positions in ``layer``'s pools."""
        _check_kv(k, v)
        if k.shape[0] != 1:
            raise ValueError("a paged sequence view takes batch size 1 (one sequence per view)")
        seq = self._seq(seq_id)
        t = k.shape[2]
        idx = slot_indices(seq.table, seq.length + t, self.block_size, k.device)[seq.length :]
        nb, bs, h, d = self.k_pools[layer].shape
        with torch.no_grad():
            self.k_pools[layer].view(nb * bs, h, d)[idx] = k[0].transpose(0, 1).to(self.k_pools[layer].dtype)
            self.v_pools[layer].view(nb * bs, h, d)[idx] = v[0].transpose(0, 1).to(self.v_pools[layer].dtype)

    def append(self, seq_id: int, keys, values=None, tokens: list[int] | None = None) -> None:
        """Append K/V for every cache layer: ``keys[i]``, ``values[i]`` shaped (1, H_kv, T, D), in layer order.

        (``BlockTables.append(seq_id, n)`` counts positions without data; here the data is written.)
        All or nothing: if the pool cannot hold the T tokens, nothing is written.
        """
        if isinstance(keys, int):  # the bookkeeping-only form
            return super().append(seq_id, keys, tokens)
        layers = list(self.k_pools)
        if values is None or len(keys) != len(layers) or len(values) != len(layers):
            raise ValueError(f"keys and values must give one (1, H_kv, T, D) tensor per cache layer ({len(layers)})")
        t = keys[0].shape[2]
        self.reserve(seq_id, t)
        for layer, k, v in zip(layers, keys, values):
            self.write(layer, seq_id, k, v)
        self.advance(seq_id, t, tokens)

    def gather(self, layer: int, seq_id: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._seq(seq_id)
        return gather_kv(self.k_pools[layer], seq.table, seq_len), gather_kv(self.v_pools[layer], seq.table, seq_len)

    def view(self, seq_id: int) -> PagedSequenceView:
        """A cache object for ``model(ids, cache=...)`` that reads and writes this sequence's blocks."""
        self._seq(seq_id)
        return PagedSequenceView(self, seq_id)


class _PagedLayer(LayerCache):
    def __init__(self, paged: PagedKVCache, seq_id: int, layer: int):
        super().__init__()
        self.paged, self.seq_id, self.layer_index = paged, seq_id, layer

    @property
    def seq_len(self):  # the table is the truth; no second counter to keep in step
        return self.paged._seq(self.seq_id).length

    @seq_len.setter
    def seq_len(self, value):
        pass  # LayerCache.__init__ assigns 0; the length lives in the block tables

    def update(self, k, v):
        self.paged.write(self.layer_index, self.seq_id, k, v)
        return self.paged.gather(self.layer_index, self.seq_id, self.seq_len + k.shape[2])

    @property
    def keys(self):
        return self.paged.gather(self.layer_index, self.seq_id, self.seq_len)[0] if self.seq_len else None

    @property
    def values(self):
        return self.paged.gather(self.layer_index, self.seq_id, self.seq_len)[1] if self.seq_len else None

    def nbytes(self):
        seq = self.paged._seq(self.seq_id)
        return len(seq.table) * self.paged.bytes_per_block() // len(self.paged.k_pools)

    def reset(self):
        raise ValueError("free() the sequence in the PagedKVCache instead of resetting a view")

    def crop(self, length):
        raise ValueError("paged views do not crop; fork or free sequences instead")


class PagedSequenceView(KVCache):
    """One sequence of a PagedKVCache, seen through the foundation's cache interface."""

    def __init__(self, paged: PagedKVCache, seq_id: int):
        super().__init__()
        self.paged, self.seq_id = paged, seq_id

    @property
    def seq_len(self):
        return self.paged._seq(self.seq_id).length

    @seq_len.setter
    def seq_len(self, value):
        pass  # KVCache.__init__ assigns 0; the length lives in the block tables

    def new_layer(self, window=None):
        raise AssertionError("unreachable: layer() is overridden")

    def layer(self, index, window=None):
        if window is not None:
            raise ValueError("paged sequences store full-attention layers only")
        if index not in self.paged.k_pools:
            raise ValueError(f"layer {index} has no cache of its own in this PagedKVCache")
        return _PagedLayer(self.paged, self.seq_id, index)

    def check_room(self, new_tokens):
        super().check_room(new_tokens)
        self.paged.reserve(self.seq_id, new_tokens)  # all or nothing, before any layer writes

    def advance(self, new_tokens):
        self.paged.advance(self.seq_id, new_tokens)

    def nbytes(self):
        seq = self.paged._seq(self.seq_id)
        return len(seq.table) * self.paged.bytes_per_block()

    def reset(self):
        raise ValueError("free() the sequence in the PagedKVCache instead of resetting a view")

    def crop(self, length):
        raise ValueError("paged views do not crop; fork or free sequences instead")


# ---------------------------------------------------------------------------------------------
# Serving simulation: contiguous reservation against paging, at one memory budget
# ---------------------------------------------------------------------------------------------


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
    result = SimResult(policy, capacity)
    pending = sorted(requests, key=lambda r: r.arrival)
    queue: list[Request] = []
    running: dict[int, dict] = {}  # id -> {"req", "len", "start" | "blocks"}
    free_runs = [[0, capacity]]
    free_blocks = capacity // block_size
    step = 0
    while (pending or queue or running) and step < max_steps:
        while pending and pending[0].arrival <= step:
            queue.append(pending.pop(0))
        # Admit in order while the head of the queue fits.
        while queue:
            r = queue[0]
            if policy == "contiguous":
                size = max_len if max_new_tokens is None else min(max_len, r.prompt_len + max_new_tokens)
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
                    victim = max(running, key=lambda i: (running[i]["req"].arrival, i))
                    if len(running) == 1:
                        raise ValueError("one sequence alone exceeds the capacity")
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


# ---------------------------------------------------------------------------------------------
# A scripted scenario for the block-table view
# ---------------------------------------------------------------------------------------------


def _snapshot(tables: BlockTables, names: dict[int, str], event: str) -> dict:
    return {
        "event": event,
        "block_size": tables.block_size,
        "num_blocks": tables.allocator.num_blocks,
        "ref_counts": list(tables.allocator.ref_counts),
        "sequences": {names[i]: {"table": list(s.table), "length": s.length} for i, s in tables.sequences.items()},
        "used": tables.slots_used(),
        "held": tables.slots_held(),
    }


def block_scenario(num_blocks: int = 12, block_size: int = 4) -> list[dict]:
    """Requests arriving, growing, forking, sharing a prefix and finishing, one snapshot per event."""
    tables = BlockTables(num_blocks, block_size)
    names: dict[int, str] = {}
    snaps = [_snapshot(tables, names, "an empty pool")]

    def add(name, prompt):
        sid, reused = tables.add_sequence(prompt)
        names[sid] = name
        tables.reserve(sid, len(prompt) - reused)
        tables.advance(sid, len(prompt) - reused)
        note = f", reusing {reused} cached prompt tokens" if reused else ""
        snaps.append(_snapshot(tables, names, f"{name} arrives with a {len(prompt)}-token prompt{note}"))
        return sid

    def grow(sid, n, token=0):
        for _ in range(n):
            tables.reserve(sid, 1)
            tables.advance(sid, 1, [token])
        snaps.append(_snapshot(tables, names, f"{names[sid]} generates {n} token{'s' if n > 1 else ''}"))

    system = list(range(100, 108))  # an 8-token system prompt shared by A and D
    a = add("A", system + [1, 2])
    b = add("B", [7, 7, 7])
    grow(a, 3)
    c = tables.fork(a)
    names[c] = "C"
    snaps.append(_snapshot(tables, names, "A is forked into C (parallel sampling): C shares all of A's blocks"))
    grow(c, 1, token=9)
    snaps[-1]["event"] = "C writes its first own token: the shared, partly filled block is copied first (copy-on-write)"
    grow(b, 2)
    tables.free(b)
    snaps.append(_snapshot(tables, names, "B finishes: its blocks return to the free list"))
    add("D", system + [5])
    tables.free(a)
    snaps.append(_snapshot(tables, names, "A finishes: blocks still used by C or D stay allocated"))
    return snaps
