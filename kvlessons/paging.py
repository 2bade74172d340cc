"""Paged attention: a pool of fixed-size blocks, a block table per sequence, prefix sharing.

As in vLLM (Kwon et al. 2023, arXiv 2309.06180): the cache of every sequence lives in
blocks of ``block_size`` token slots taken from one shared pool; a sequence's block
table maps its positions to blocks (position p is slot p % block_size of block
table[p // block_size]). A sequence wastes at most the unused tail of its last block.

Blocks are reference counted, so a forked sequence or a second request with the same
prompt prefix shares blocks instead of copying them. One rule keeps sharing safe:
**a sequence only writes into a block it alone holds.** Positions are reserved
(:meth:`BlockTables.reserve`) before they are written and counted
(:meth:`BlockTables.advance`) after; reserving room in a shared block copies it first
(copy-on-write), and a fork shares only the blocks that hold written positions.

Prefix sharing finds full blocks by a hash of (the parent block's hash, this block's
token ids), and only blocks whose every id is known at its position qualify. The hash
is sha256: Python's ``hash()`` is predictable and not built to resist a collision
search, which let a crafted prompt plant keys and values that vLLM then served to
another user's prompt (advisory CVE-2025-25183).

``BlockTables`` is the bookkeeping alone (used by the simulations and the widget);
``PagedKVCache`` adds the K/V pools and plugs into the model through ``view(seq)``.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .attention import attend
from .cache import KVCache, LayerCache, _check_crop, _check_kv
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

    def state(self) -> tuple[list[int], list[int]]:
        """Copies of the reference counts and the free list (in order), for :meth:`set_state`."""
        return list(self.ref_counts), list(self._free)

    def set_state(self, state: tuple[list[int], list[int]]) -> None:
        ref_counts, free = state
        self.ref_counts, self._free = list(ref_counts), list(free)


# -- prefix hashing --------------------------------------------------------------------------------

ROOT_HASH = bytes(32)  # the "parent hash" of a sequence's first block


def chain_hash(parent: bytes, ids) -> bytes:
    """Return the sha256 digest naming a full block: its parent block's hash, then its token ids.

    Every id is written as 8 bytes, so two different (parent, ids) pairs never give the
    same input, and finding two inputs with the same sha256 is infeasible. Python's
    ``hash()`` is no substitute: an int hashes to itself modulo 2**61 - 1, so colliding
    prompts are easy to construct.
    """
    return hashlib.sha256(parent + b"".join(i.to_bytes(8, "little") for i in ids)).digest()


def _token_ids(name: str, ids) -> list[int]:
    """Return ``ids`` (any iterable) as a list of ints, or raise ValueError naming ``name`` unless each is a token id."""
    out = []
    for j, t in enumerate(ids):
        try:
            # ints, NumPy ints, one-element integer tensors; not floats, and not bools (True is no token)
            token = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            token = None
        if token is None or not 0 <= token < 2**64:
            raise ValueError(f"{name}[{j}] must be a token id (an integer, 0 <= id < 2**64), got {t!r}; "
                             f"{name} is a 1-D sequence of ids, e.g. ids[0].tolist() for ids of shape (1, T)")
        out.append(token)
    return out


class _BlockKey(NamedTuple):
    """What a block in the prefix cache holds: the chain hash it is found by, and what that hash covers."""

    hash: bytes
    parent: bytes  # the previous block's chain hash (ROOT_HASH for a first block)
    ids: tuple[int, ...]  # the token ids at the block's positions


@dataclass
class _Sequence:
    """One sequence: positions 0..length-1 are written, the next ``reserved`` may be written."""

    table: list[int] = field(default_factory=list)  # blocks covering the written and reserved positions
    length: int = 0
    reserved: int = 0  # positions after ``length`` made writable by reserve(), not yet written
    ids: list[int | None] = field(default_factory=list)  # the token id at each written position, None if unknown
    prompt: list[int] = field(default_factory=list)  # ids add_sequence declared for positions 0..len(prompt)-1

    def copy(self) -> _Sequence:
        return _Sequence(list(self.table), self.length, self.reserved, list(self.ids), list(self.prompt))


class BlockTables:
    """Per-sequence block tables over one allocator, with copy-on-write and prefix sharing.

    A sequence writes only into blocks it alone holds: :meth:`reserve` makes the next
    positions writable (all or nothing, copying a shared block first), :meth:`advance`
    counts them once written, :meth:`abandon` gives back what was reserved but not
    written. With ``prefix_sharing``, a full block whose every token id is known joins
    the prefix cache, where later prompts starting with the same ids find it.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_sharing: bool = True):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._hash_to_block: dict[bytes, int] = {}  # the prefix cache: chain hash -> a live block holding it
        self._block_key: dict[int, _BlockKey] = {}  # each block in the prefix cache -> what it holds, to verify
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies made by copy-on-write

    # -- sequences ----------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        if seq_id not in self.sequences:
            raise ValueError(f"seq_id {seq_id} is not a live sequence")
        return self.sequences[seq_id]

    def add_sequence(self, prompt=None) -> tuple[int, int]:
        """Start a sequence; return (seq_id, tokens already cached by prefix sharing).

        ``prompt`` declares the token ids of the sequence's first positions: ids given
        later for those positions must match them. With prefix sharing on, every full
        leading block of the prompt found in the prefix cache is shared (reference
        count + 1) instead of recomputed; the caller only runs the model on the rest.
        """
        prompt = _token_ids("prompt", [] if prompt is None else prompt)
        shared = self._cached_prefix(prompt) if self.prefix_sharing else []
        if shared and len(shared) * self.block_size == len(prompt):
            shared.pop()  # keep at least the last prompt token to compute: its logits start generation
        for b in shared:
            self.allocator.incref(b)
        reused = len(shared) * self.block_size
        return self._add(_Sequence(table=shared, length=reused, ids=prompt[:reused], prompt=prompt)), reused

    def _cached_prefix(self, prompt: list[int]) -> list[int]:
        """Blocks of the prefix cache holding the prompt's leading full blocks, as far as the chain matches."""
        blocks, parent, bs = [], ROOT_HASH, self.block_size
        for i in range(len(prompt) // bs):
            ids = tuple(prompt[i * bs : (i + 1) * bs])
            h = chain_hash(parent, ids)
            block = self._hash_to_block.get(h)
            # Compare what the block holds too: a hash only names it.
            if block is None or self._block_key[block] != (h, parent, ids):
                break
            blocks.append(block)
            parent = h
        return blocks

    def _add(self, seq: _Sequence) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = seq
        return seq_id

    def fork(self, seq_id: int) -> int:
        """Return a new sequence with the written positions (and blocks) of ``seq_id``.

        Blocks holding written positions are shared; reserved, unwritten ones are not.
        If ``seq_id`` has room reserved in its partly filled last block, the fork gets
        its own copy of that block, so neither writes into a block the other holds.
        Raises PoolExhaustedError, changing nothing, if that copy finds no free block.
        """
        parent = self._seq(seq_id)
        table = parent.table[: math.ceil(parent.length / self.block_size)]
        copy_last = parent.length % self.block_size and parent.reserved
        if copy_last:
            if not self.allocator.num_free:
                raise PoolExhaustedError(
                    f"fork of sequence {seq_id} needs 1 free block, the pool has none: the parent has room reserved "
                    f"in its partly filled last block, so the fork must get its own copy of that block"
                )
            table[-1] = self._copy_block(table[-1])  # taken with reference count 1: the fork's own
        for b in table[:-1] if copy_last else table:
            self.allocator.incref(b)
        return self._add(_Sequence(table, parent.length, 0, list(parent.ids), list(parent.prompt)))

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (shared ones stay for their other holders) and end it."""
        self.clear(seq_id)
        del self.sequences[seq_id]

    def clear(self, seq_id: int) -> None:
        """Release a sequence's blocks; it stays alive, empty and without a prompt, as add_sequence() made it."""
        for b in self._seq(seq_id).table:
            self._release(b)
        self.sequences[seq_id] = _Sequence()

    def abandon(self, seq_id: int) -> int:
        """Give back the positions reserved but not written (after a failed write); return the blocks freed."""
        seq = self._seq(seq_id)
        seq.reserved = 0
        return self._drop_blocks_after(seq, seq.length)

    def crop(self, seq_id: int, length: int) -> None:
        """Keep only the first ``length`` written positions of a sequence (and no reservation).

        Blocks wholly past ``length`` are released. The declared prompt is cut at
        ``length`` too, so different ids may follow. A now partly filled last block
        that this sequence alone holds leaves the prefix cache (its tail will be
        overwritten); a shared one stays, and copy-on-write protects it.
        """
        seq = self._seq(seq_id)
        _check_crop(length, seq.length)
        seq.length, seq.reserved = length, 0
        del seq.ids[length:]
        del seq.prompt[length:]
        self._drop_blocks_after(seq, length)
        if length % self.block_size and self.allocator.ref_counts[seq.table[-1]] == 1:
            self._forget_hash(seq.table[-1])

    def _drop_blocks_after(self, seq: _Sequence, positions: int) -> int:
        """Release the table's blocks past the first ``positions`` positions; return how many."""
        keep = math.ceil(positions / self.block_size)
        dropped = seq.table[keep:]
        del seq.table[keep:]
        for b in dropped:
            self._release(b)
        return len(dropped)

    def _release(self, block: int) -> None:
        """Drop one reference to ``block``; a block nobody holds leaves the prefix cache."""
        if self.allocator.decref(block):
            self._forget_hash(block)

    def _forget_hash(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None and self._hash_to_block.get(key.hash) == block:
            del self._hash_to_block[key.hash]

    def _copy_block(self, src: int) -> int:
        """Return a newly allocated block that starts as a copy of ``src`` (the pools copy the data)."""
        (dst,) = self.allocator.allocate(1)
        self.copies.append((src, dst))
        return dst

    # -- growth --------------------------------------------------------------------------------

    def _writable(self, block: int) -> bool:
        """True if a sequence holding ``block`` may write into it: no other table holds it, and no prefix lookup can find it."""
        return self.allocator.ref_counts[block] == 1 and block not in self._block_key

    def _plan(self, seq: _Sequence, new_tokens: int) -> tuple[list[int], int]:
        """(table indices of blocks to replace, blocks to add) so positions length..length+new_tokens-1 are writable."""
        bs = self.block_size
        end = math.ceil((seq.length + new_tokens) / bs)
        held = range(seq.length // bs, min(end, len(seq.table)))
        return [i for i in held if not self._writable(seq.table[i])], max(0, end - len(seq.table))

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Free blocks a reservation of ``new_tokens`` positions would take (new blocks plus copies)."""
        replace, add = self._plan(self._seq(seq_id), require_positive_int("new_tokens", new_tokens))
        return len(replace) + add

    def check_room(self, seq_id: int, new_tokens: int) -> None:
        """Raise PoolExhaustedError, changing nothing, if ``new_tokens`` positions cannot be reserved."""
        need, free = self.blocks_needed(seq_id, new_tokens), self.allocator.num_free
        if need > free:
            raise PoolExhaustedError(
                f"sequence {seq_id} needs {need} more blocks for {new_tokens} tokens; "
                f"{free} of {self.allocator.num_blocks} are free"
            )

    def reserve(self, seq_id: int, new_tokens: int) -> list[tuple[int, int]]:
        """Make positions length .. length + new_tokens - 1 writable; return the (src, dst) copies made.

        Every block those positions fall in ends up held by this sequence alone: a shared
        (or prefix-cached) block holding written positions is copied (copy-on-write), one
        holding none is replaced by a fresh block. A larger reservation already made is
        kept. Raises PoolExhaustedError, changing nothing, if the pool cannot supply the blocks.
        """
        self.check_room(seq_id, new_tokens)
        seq, bs = self._seq(seq_id), self.block_size
        replace, add = self._plan(seq, new_tokens)
        copies = []
        for i in replace:
            old = seq.table[i]
            if i * bs < seq.length:  # it holds written positions: they must come along
                seq.table[i] = self._copy_block(old)
                copies.append((old, seq.table[i]))
            else:
                (seq.table[i],) = self.allocator.allocate(1)
            self._release(old)
        if add:
            seq.table.extend(self.allocator.allocate(add))
        seq.reserved = max(seq.reserved, new_tokens)
        return copies

    def _new_ids(self, seq: _Sequence, new_tokens: int, tokens=None) -> list[int | None]:
        """The ids of the next ``new_tokens`` positions: those given, else those the prompt declared, else None.

        Raises ValueError for a count that is not positive, a ``tokens`` list of another
        length, or an id that contradicts the prompt declared in add_sequence.
        """
        require_positive_int("new_tokens", new_tokens)
        declared = seq.prompt[seq.length : seq.length + new_tokens]
        declared += [None] * (new_tokens - len(declared))
        if tokens is None:
            return declared
        tokens = _token_ids("tokens", tokens)
        if len(tokens) != new_tokens:
            raise ValueError(f"tokens must hold one id per new position: new_tokens={new_tokens}, got {len(tokens)} ids")
        for j, (given, expected) in enumerate(zip(tokens, declared)):
            if expected is not None and given != expected:
                raise ValueError(
                    f"tokens must match the prompt declared in add_sequence: position {seq.length + j} "
                    f"was declared as id {expected}, got {given}. If the first positions were reused from the "
                    f"prefix cache (add_sequence returned how many), feed only the ids after them"
                )
        return tokens

    def advance(self, seq_id: int, new_tokens: int, tokens=None) -> None:
        """Count ``new_tokens`` reserved positions as written, with their ``tokens`` ids if known.

        Full blocks whose every id is known, and whose parent block is in the prefix
        cache, join it. Raises ValueError, changing nothing, for a count that is not
        positive, more positions than are reserved, or ids that do not fit (see above).
        """
        seq = self._seq(seq_id)
        ids = self._new_ids(seq, new_tokens, tokens)
        if new_tokens > seq.reserved:
            raise ValueError(
                f"new_tokens must be <= the positions reserved ({seq.reserved}), got {new_tokens}: "
                f"reserve() positions before writing them"
            )
        start = seq.length
        seq.length += new_tokens
        seq.reserved -= new_tokens
        seq.ids.extend(ids)
        if self.prefix_sharing:
            for i in range(start // self.block_size, seq.length // self.block_size):  # blocks filled just now
                self._publish(seq, i)

    def append(self, seq_id: int, new_tokens: int = 1, tokens=None) -> None:
        """Reserve and count ``new_tokens`` positions (a block is taken only when the last one is full)."""
        self._new_ids(self._seq(seq_id), new_tokens, tokens)  # refuse bad ids before reserving anything
        self.reserve(seq_id, new_tokens)
        self.advance(seq_id, new_tokens, tokens)

    def _publish(self, seq: _Sequence, i: int) -> None:
        """Put full block ``i`` of ``seq`` in the prefix cache if its ids are known and its parent is there."""
        bs = self.block_size
        ids = seq.ids[i * bs : (i + 1) * bs]
        if None in ids:
            return  # its K/V came from ids nobody told us: no prompt can be matched against it
        if i == 0:
            parent = ROOT_HASH
        else:
            parent_key = self._block_key.get(seq.table[i - 1])
            if parent_key is None:
                return  # the chain is broken: a lookup could never reach this block
            parent = parent_key.hash
        h = chain_hash(parent, ids)
        if h not in self._hash_to_block:  # else another block already holds this prefix
            self._hash_to_block[h] = seq.table[i]
            self._block_key[seq.table[i]] = _BlockKey(h, parent, tuple(ids))

    # -- undo --------------------------------------------------------------------------------------

    def state(self) -> dict:
        """A copy of all the bookkeeping (tables, counts, free list, prefix cache), for :meth:`set_state` or comparing."""
        return {
            "allocator": self.allocator.state(),
            "sequences": {i: s.copy() for i, s in self.sequences.items()},
            "next_id": self._next_id,
            "hash_to_block": dict(self._hash_to_block),
            "block_key": dict(self._block_key),
            "copies": len(self.copies),
        }

    def set_state(self, state: dict) -> None:
        """Return the bookkeeping to what :meth:`state` recorded (blocks taken since are free again)."""
        sequences = {i: s.copy() for i, s in state["sequences"].items()}
        self.allocator.set_state(state["allocator"])
        self.sequences, self._next_id = sequences, state["next_id"]
        self._hash_to_block, self._block_key = dict(state["hash_to_block"]), dict(state["block_key"])
        del self.copies[state["copies"] :]

    # -- measures -------------------------------------------------------------------------------

    def slots_used(self) -> int:
        """Token positions stored, counting a shared block's positions once."""
        filled: dict[int, int] = {}
        for seq in self.sequences.values():
            for i, b in enumerate(seq.table):
                filled[b] = max(filled.get(b, 0), min(self.block_size, max(0, seq.length - i * self.block_size)))
        return sum(filled.values())

    def slots_held(self) -> int:
        """Token slots in blocks that are allocated."""
        return (self.allocator.num_blocks - self.allocator.num_free) * self.block_size

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        bs, counts = self.block_size, self.allocator.ref_counts
        holders = [0] * self.allocator.num_blocks
        for sid, seq in self.sequences.items():
            assert seq.length >= 0 and seq.reserved >= 0, f"sequence {sid}: a negative length or reservation"
            assert len(seq.table) == math.ceil((seq.length + seq.reserved) / bs), (
                f"sequence {sid}: {len(seq.table)} blocks for {seq.length} written and {seq.reserved} reserved positions"
            )
            assert len(set(seq.table)) == len(seq.table), f"sequence {sid}: a block appears twice in one table"
            assert len(seq.ids) == seq.length, f"sequence {sid}: {len(seq.ids)} ids for {seq.length} positions"
            known = min(seq.length, len(seq.prompt))
            assert seq.ids[:known] == seq.prompt[:known], f"sequence {sid}: ids differ from the declared prompt"
            for b in seq.table:
                holders[b] += 1
            if seq.reserved:  # the blocks from the one holding position `length` on are writable
                for b in seq.table[seq.length // bs :]:
                    assert counts[b] == 1, f"sequence {sid} may write into block {b}, which {counts[b]} tables hold"
                    assert b not in self._block_key, f"sequence {sid} may write into block {b}, which is in the prefix cache"
        free = self.allocator.free_blocks()
        assert len(free) == self.allocator.num_free, "a block is on the free list twice"
        for b, (count, held) in enumerate(zip(counts, holders)):
            assert count == held, f"block {b}: reference count {count}, held by {held} tables"
            assert (b in free) == (count == 0), f"block {b} is both free and owned, or neither"
        self._check_prefix_cache()

    def _check_prefix_cache(self) -> None:
        bs = self.block_size
        for h, b in self._hash_to_block.items():
            assert b in self._block_key and self._block_key[b].hash == h, f"block {b} is cached under a hash it does not hold"
        for b, key in self._block_key.items():
            assert self.allocator.ref_counts[b] > 0, f"block {b} is free but still in the prefix cache"
            assert self._hash_to_block.get(key.hash) == b, f"block {b} has a key but no prefix-cache entry"
            assert len(key.ids) == bs and key.hash == chain_hash(key.parent, key.ids), f"block {b}: hash does not match its key"
        for sid, seq in self.sequences.items():
            for i, b in enumerate(seq.table):
                key = self._block_key.get(b)
                if key is None:
                    continue
                written = seq.ids[i * bs : min(seq.length, (i + 1) * bs)]
                assert list(key.ids[: len(written)]) == written, f"sequence {sid}: block {b} is cached with other ids"
                parent = ROOT_HASH if i == 0 else getattr(self._block_key.get(seq.table[i - 1]), "hash", None)
                assert key.parent == parent, f"sequence {sid}: block {b} is cached under another parent block"


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

    The blocks are gathered whole (one index per block, not per token) and seen, through
    a transposed view, in the (1, H_kv, S, D) layout attention expects; then
    :func:`~kvlessons.attention.attend` runs on them as it does on a contiguous cache,
    with the bottom-right causal mask for T > 1. The only difference from contiguous
    attention is the gather and the strided layout it leaves the keys in.
    """
    k, v = gather_kv(k_pool, block_table, seq_len), gather_kv(v_pool, block_table, seq_len)  # (1, H_kv, S, D)
    return attend(q, k, v)


def paged_attention_blockwise(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The same result, one block at a time with a running softmax, as a paged kernel computes it.

    Never materialises the whole sequence's K/V: each block's scores update a running
    maximum, denominator and weighted sum (the online softmax of FlashAttention, Dao et
    al. 2022, arXiv 2205.14135; Milakov and Gimelshein 2018, arXiv 1805.02867).
    Decode form: one query per sequence (T = 1).

    This is a different algorithm from the package's one attention, kept on purpose
    because lesson 06 teaches it: the softmax is never taken over all the scores at
    once. The tests hold it equal to
    :func:`~kvlessons.attention.reference_attention` over the gathered keys.
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
        """Bytes one block takes across every layer's K and V pools."""
        return self.nbytes() // self.allocator.num_blocks

    def _copy_block(self, src: int) -> int:
        dst = super()._copy_block(src)
        with torch.no_grad():  # copy-on-write: the new block starts as the shared one's copy, in every layer
            for pool in (*self.k_pools.values(), *self.v_pools.values()):
                pool[dst] = pool[src]
        return dst

    def _check_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ValueError unless k, v (1, H_kv, T, D) fit ``layer``'s pools."""
        if layer not in self.k_pools:
            raise ValueError(f"layer must be one of this pool's cache layers {sorted(self.k_pools)}, got {layer}")
        _check_kv(k, v)
        _, _, kv_heads, head_dim = self.k_pools[layer].shape
        if k.shape[0] != 1:
            raise ValueError(f"k must hold batch size 1 (a paged sequence is one sequence), got batch {k.shape[0]}")
        if k.shape[1] != kv_heads:
            raise ValueError(f"k must have the pool's kv_heads={kv_heads} heads, got {k.shape[1]}")
        if k.shape[3] != head_dim:
            raise ValueError(f"k must have the pool's head_dim={head_dim}, got {k.shape[3]}")

    def write(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V (1, H_kv, T, D) at the sequence's next T positions, which must be reserved, in ``layer``'s pools."""
        self._check_write(layer, k, v)
        seq, t = self._seq(seq_id), k.shape[2]
        if t > seq.reserved:
            raise ValueError(
                f"k holds {t} new tokens but sequence {seq_id} has {seq.reserved} positions reserved: "
                f"reserve() them first (a view's forward pass does)"
            )
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        nb, bs, h, d = k_pool.shape
        idx = slot_indices(seq.table, seq.length + t, bs, k_pool.device)[seq.length :]
        with torch.no_grad():
            k_pool.view(nb * bs, h, d)[idx] = k[0].transpose(0, 1).to(k_pool)
            v_pool.view(nb * bs, h, d)[idx] = v[0].transpose(0, 1).to(v_pool)

    def append(self, seq_id: int, keys, values=None, tokens=None) -> None:
        """Append K/V for every cache layer: ``keys[i]``, ``values[i]`` shaped (1, H_kv, T, D), in layer order.

        (``BlockTables.append(seq_id, n)`` counts positions without data; here the data is written.)
        Everything is checked before anything is reserved or written.
        """
        if isinstance(keys, int):  # the bookkeeping-only form
            return super().append(seq_id, keys, tokens)
        layers = list(self.k_pools)
        if values is None or len(keys) != len(layers) or len(values) != len(layers):
            raise ValueError(f"keys and values must give one (1, H_kv, T, D) tensor per cache layer ({len(layers)})")
        for layer, k, v in zip(layers, keys, values):
            self._check_write(layer, k, v)
        t = keys[0].shape[2]
        if any(k.shape[2] != t for k in keys):
            raise ValueError("keys must hold the same number of new tokens in every layer")
        self._new_ids(self._seq(seq_id), t, tokens)  # refuse bad ids before reserving anything
        self.reserve(seq_id, t)
        for layer, k, v in zip(layers, keys, values):
            self.write(layer, seq_id, k, v)
        self.advance(seq_id, t, tokens)

    def gather(self, layer: int, seq_id: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's first ``seq_len`` keys and values in ``layer``, each (1, H_kv, seq_len, D)."""
        seq = self._seq(seq_id)
        return gather_kv(self.k_pools[layer], seq.table, seq_len), gather_kv(self.v_pools[layer], seq.table, seq_len)

    def view(self, seq_id: int) -> PagedSequenceView:
        """A cache object for ``model(ids, cache=...)`` that reads and writes this sequence's blocks."""
        self._seq(seq_id)
        return PagedSequenceView(self, seq_id)


class _PagedLayer(LayerCache):
    """One layer of a paged sequence: its slice of every block in the sequence's table."""

    def __init__(self, paged: PagedKVCache, seq_id: int, layer: int):
        # Not LayerCache.__init__: this layer keeps no counter of its own (see seq_len).
        self.paged, self.seq_id, self.layer_index = paged, seq_id, layer
        self.bytes_written = 0

    @property
    def seq_len(self):  # the table is the truth; no second counter to keep in step
        return self.paged._seq(self.seq_id).length

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
        """This layer's share of the blocks in the sequence's table (shared blocks count for every holder)."""
        blocks = len(self.paged._seq(self.seq_id).table)
        return blocks * self.paged.bytes_per_block() // len(self.paged.k_pools)

    def reset(self):
        raise ValueError("the layers of a paged sequence share one block table: reset() the view, not a layer")

    def crop(self, length):
        raise ValueError("the layers of a paged sequence share one block table: crop() the view, not a layer")


class PagedSequenceView(KVCache):
    """One sequence of a PagedKVCache, seen through the foundation's cache interface.

    A forward pass reserves its positions in ``_prepare`` (refusing ids that contradict
    the declared prompt), the layers write through the block table, and ``advance``
    records the ids, so the blocks of generated tokens can serve the prefix cache too.
    If the pass raises, the pool's bookkeeping returns to its state before the pass:
    blocks it took are free again, and what it wrote lies past the sequence's length,
    where nobody reads it.
    """

    def __init__(self, paged: PagedKVCache, seq_id: int):
        super().__init__()
        self.paged, self.seq_id = paged, seq_id
        self._layers = {i: _PagedLayer(paged, seq_id, i) for i in paged.k_pools}
        self._pass_ids: list[int] | None = None  # the token ids of the forward pass in progress

    @property
    def seq_len(self):  # the block table is the truth: the sequence's written length
        return self.paged._seq(self.seq_id).length

    def new_layer(self, window=None):
        # Every layer the pool stores was made in __init__; any other index has no pool.
        raise ValueError(
            f"this PagedKVCache stores layers {sorted(self.paged.k_pools)} (full attention); "
            f"asked for another layer (window={window})"
        )

    def check_room(self, new_tokens):
        super().check_room(new_tokens)
        self.paged.check_room(self.seq_id, new_tokens)

    def _prepare(self, ids):
        if ids.shape[0] != 1:
            raise ValueError(f"ids must hold one sequence (batch 1) for a paged sequence view, got batch {ids.shape[0]}")
        tokens = ids[0].tolist()
        self.paged._new_ids(self.paged._seq(self.seq_id), len(tokens), tokens)  # against the declared prompt
        self.paged.reserve(self.seq_id, len(tokens))
        self._pass_ids = tokens

    def advance(self, new_tokens):
        tokens, self._pass_ids = self._pass_ids, None  # None outside a forward pass: ids unknown
        self.paged.advance(self.seq_id, new_tokens, tokens)

    def _snapshot(self):
        return self.paged.state()

    def _restore(self, state):
        self._pass_ids = None
        self.paged.set_state(state)

    def _commit(self):
        self._pass_ids = None

    def reset(self):
        """Release the sequence's blocks: it stays alive and empty, without a declared prompt."""
        self._interrupted = None
        with self.atomic():
            self.paged.clear(self.seq_id)

    def crop(self, length):
        """Keep the first ``length`` positions (see :meth:`BlockTables.crop`)."""
        self._check_usable()
        with self.atomic():
            self.paged.crop(self.seq_id, length)


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


# ---------------------------------------------------------------------------------------------
# A scripted scenario for the block-table view
# ---------------------------------------------------------------------------------------------


def _scenario_state(tables: BlockTables, names: dict[int, str], event: str) -> dict:
    """What the block-table widget draws after one event: every table and reference count."""
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
    snaps = [_scenario_state(tables, names, "an empty pool")]

    def add(name, prompt):
        sid, reused = tables.add_sequence(prompt)
        names[sid] = name
        tables.append(sid, len(prompt) - reused)  # the prompt's ids were declared by add_sequence
        note = f", reusing {reused} cached prompt tokens" if reused else ""
        snaps.append(_scenario_state(tables, names, f"{name} arrives with a {len(prompt)}-token prompt{note}"))
        return sid

    def grow(sid, n, token=0):
        for _ in range(n):
            tables.append(sid, 1, [token])
        snaps.append(_scenario_state(tables, names, f"{names[sid]} generates {n} token{'s' if n > 1 else ''}"))

    system = list(range(100, 108))  # an 8-token system prompt shared by A and D
    a = add("A", system + [1, 2])
    b = add("B", [7, 7, 7])
    grow(a, 3)
    c = tables.fork(a)
    names[c] = "C"
    snaps.append(_scenario_state(tables, names, "A is forked into C (parallel sampling): C shares all of A's blocks, each holding written tokens"))
    grow(c, 1, token=9)
    snaps[-1]["event"] = (
        "C writes its first own token: the partly filled block it would write into is shared with A, "
        "so C gets a copy first (copy-on-write)"
    )
    grow(b, 2)
    tables.free(b)
    snaps.append(_scenario_state(tables, names, "B finishes: its blocks return to the free list"))
    add("D", system + [5])
    tables.free(a)
    snaps.append(_scenario_state(tables, names, "A finishes: blocks still used by C or D stay allocated"))
    return snaps
