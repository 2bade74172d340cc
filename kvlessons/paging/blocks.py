"""Blocks, block tables, copy-on-write and prefix hashing: the bookkeeping of paged attention (lesson 06).

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
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

from ..cache import _check_crop
from ..shape import require_positive_int


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
