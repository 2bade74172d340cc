"""Paged attention (lesson 06): a pool of fixed-size blocks, a block table per sequence, prefix sharing.

As in vLLM (Kwon et al. 2023, arXiv 2309.06180): the cache of every sequence lives in
blocks of ``block_size`` token slots taken from one shared pool; a sequence's block
table maps its positions to blocks (position p is slot p % block_size of block
table[p // block_size]). A sequence wastes at most the unused tail of its last block.

Blocks are reference counted and shared (forks, common prompt prefixes); a sequence only
writes into a block it alone holds (see ``blocks``).

One concept per module:

- ``blocks``: the allocator and the block tables (reserve, advance, fork, free, crop,
  copy-on-write, prefix hashing, invariants): the bookkeeping alone;
- ``attention``: attention through a block table, gathered or block by block;
- ``pool``: ``PagedKVCache``, one K/V pool per layer, and ``view(seq)``, a sequence seen as a cache;
- ``simulate``: a serving simulation, contiguous reservation against paging, with a token
  budget per step (prefill costs steps) and preemption by recompute or swap;
- ``scenario``: the scripted events lesson 06's block-table widget plays.
"""

from .attention import gather_kv, paged_attention, paged_attention_blockwise, slot_indices
from .blocks import ROOT_HASH, BlockAllocator, BlockTables, PoolExhaustedError, chain_hash
from .pool import PagedKVCache, PagedSequenceView
from .scenario import block_scenario
from .simulate import Request, RequestOutcome, SimResult, make_workload, simulate

__all__ = [
    "ROOT_HASH", "BlockAllocator", "BlockTables", "PagedKVCache", "PagedSequenceView", "PoolExhaustedError",
    "Request", "RequestOutcome", "SimResult", "block_scenario", "chain_hash", "gather_kv", "make_workload",
    "paged_attention", "paged_attention_blockwise", "simulate", "slot_indices",
]
