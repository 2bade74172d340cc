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

One concept per module:

- ``blocks``: the allocator and the block tables (reserve, advance, fork, free, crop,
  copy-on-write, prefix hashing, invariants): the bookkeeping alone;
- ``attention``: attention through a block table, gathered or block by block;
- ``pool``: ``PagedKVCache``, the K/V pools, and ``view(seq)``, a sequence seen as a cache;
- ``simulate``: a serving simulation, contiguous reservation against paging;
- ``scenario``: the scripted events lesson 06's block-table widget plays.
"""

from .attention import gather_kv, gather_rows, paged_attention, paged_attention_blockwise, slot_indices
from .blocks import ROOT_HASH, BlockAllocator, BlockTables, PoolExhaustedError, chain_hash
from .pool import PagedKVCache, PagedSequenceView
from .scenario import block_scenario
from .simulate import Request, SimResult, make_workload, simulate

__all__ = [
    "ROOT_HASH", "BlockAllocator", "BlockTables", "PagedKVCache", "PagedSequenceView", "PoolExhaustedError",
    "Request", "SimResult", "block_scenario", "chain_hash", "gather_kv", "gather_rows", "make_workload",
    "paged_attention", "paged_attention_blockwise", "simulate", "slot_indices",
]
