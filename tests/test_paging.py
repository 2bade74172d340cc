import dataclasses
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from conftest import HEAD_LAYOUTS, random_ids, small_model
from kvlessons import ModelShape
from kvlessons.attention import reference_attention
from kvlessons.cache import StaticCache
from kvlessons.generate import generate
from kvlessons.paging import (
    BlockAllocator,
    BlockTables,
    PagedKVCache,
    PoolExhaustedError,
    Request,
    block_scenario,
    gather_kv,
    make_workload,
    paged_attention,
    paged_attention_blockwise,
    simulate,
)


def public_state(tables):
    """Every table, length, reference count and the free list, read through public attributes."""
    sequences = {s: (list(q.table), q.length) for s, q in tables.sequences.items()}
    return sequences, list(tables.allocator.ref_counts), sorted(tables.allocator.free_blocks())


# --- the allocator and the tables --------------------------------------------------------------

def test_allocator_all_or_nothing():
    """Allocating more than is free raises and changes nothing; freed blocks come back."""
    a = BlockAllocator(4, 16)
    got = a.allocate(3)
    assert got == [0, 1, 2] and a.num_free == 1
    with pytest.raises(PoolExhaustedError, match="need 2"):
        a.allocate(2)
    assert a.num_free == 1 and a.ref_counts == [1, 1, 1, 0]
    a.incref(1)
    assert not a.decref(1) and a.decref(1)
    assert a.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        a.decref(1)


@pytest.mark.parametrize("seed", range(25))
def test_random_operations_keep_the_invariants(seed):
    """Random add / reserve / advance / abandon / fork / crop / free (with prefix sharing) never break the bookkeeping."""
    rng = random.Random(seed)
    t = BlockTables(num_blocks=rng.randint(4, 24), block_size=rng.choice([1, 2, 4, 8]))
    system = [rng.randint(0, 3) for _ in range(8)]
    prompts = [system[: rng.randint(1, 8)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    for _ in range(120):
        op = rng.random()
        live = list(t.sequences)
        if op < 0.2 or not live:
            prompt = rng.choice(prompts + [None])
            sid, reused = t.add_sequence(prompt)
            rest = len(prompt or []) - reused
            if rest:
                try:
                    t.append(sid, rest)  # the prompt's ids were declared: no need to repeat them
                except PoolExhaustedError:
                    t.free(sid)
        elif op < 0.55:
            sid = rng.choice(live)
            n = rng.randint(1, 6)
            before = t.state()
            try:
                t.reserve(sid, n)
            except PoolExhaustedError:
                assert t.state() == before  # refused, unchanged
                continue
            if rng.random() < 0.2:
                t.abandon(sid)  # the pass that was to write them failed
            else:
                seq = t.sequences[sid]
                ids = [seq.prompt[p] if p < len(seq.prompt) else rng.randint(0, 3) for p in range(seq.length, seq.length + n)]
                t.advance(sid, n, ids if rng.random() < 0.7 else None)
        elif op < 0.7:
            try:
                t.fork(rng.choice(live))
            except PoolExhaustedError:
                pass
        elif op < 0.8:
            sid = rng.choice(live)
            t.crop(sid, rng.randint(0, t.sequences[sid].length))
        else:
            t.free(rng.choice(live))
        t.check_invariants()
        assert t.slots_used() <= t.slots_held()


def test_exhausted_pool_leaves_every_table_as_it_was():
    t = BlockTables(num_blocks=3, block_size=4)
    a, _ = t.add_sequence()
    t.reserve(a, 10)
    t.advance(a, 10)
    b = t.fork(a)
    snapshot = {s: (list(q.table), q.length) for s, q in t.sequences.items()}
    with pytest.raises(PoolExhaustedError):
        t.reserve(b, 8)  # needs a copy-on-write block and two more
    assert {s: (list(q.table), q.length) for s, q in t.sequences.items()} == snapshot
    t.check_invariants()


def test_blocks_are_taken_only_when_the_last_is_full():
    t = BlockTables(num_blocks=8, block_size=4)
    s, _ = t.add_sequence()
    sizes = []
    for _ in range(9):
        t.reserve(s, 1)
        t.advance(s, 1)
        sizes.append(len(t.sequences[s].table))
    assert sizes == [1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_prefix_sharing_reuses_full_blocks_only():
    """A second request with the same prompt shares its full blocks; the last token is always computed."""
    t = BlockTables(num_blocks=16, block_size=4)
    prompt = list(range(11))
    a, reused_a = t.add_sequence(prompt)
    t.reserve(a, 11)
    t.advance(a, 11)
    b, reused_b = t.add_sequence(prompt)
    assert (reused_a, reused_b) == (0, 8)
    assert t.sequences[b].table == t.sequences[a].table[:2]
    c, reused_c = t.add_sequence(prompt[:8])
    assert reused_c == 4  # 8 tokens = 2 full blocks, but the last token must run: share one
    d, reused_d = t.add_sequence([0, 1, 2, 99] + prompt[4:])
    assert reused_d == 0  # the first block differs, so the chain of hashes breaks at once
    t.check_invariants()


def test_a_fork_never_shares_a_block_either_will_write():
    """A fork made while its parent has room reserved (say, after a failed pass) never writes into the parent's blocks."""
    pool = PagedKVCache(ModelShape(layers=1, q_heads=1, kv_heads=1, head_dim=1), num_blocks=8, block_size=4)
    a, _ = pool.add_sequence()
    ones = torch.ones(1, 1, 2, 1)
    pool.append(a, [ones], [ones])  # positions 0, 1
    pool.reserve(a, 6)  # room for positions 2..7: the rest of block 0 and all of the next block, unwritten
    b = pool.fork(a)
    pool.check_invariants()
    for seq, value in ((a, 10.0), (b, 20.0)):  # each writes its own positions 2..7
        kv = torch.full((1, 1, 6, 1), value)
        pool.reserve(seq, 6)
        pool.write(0, seq, kv, kv)
        pool.advance(seq, 6)
    assert pool.gather(0, a, 8)[0].flatten().tolist() == [1.0, 1.0] + [10.0] * 6
    assert pool.gather(0, b, 8)[0].flatten().tolist() == [1.0, 1.0] + [20.0] * 6
    pool.check_invariants()


def test_abandon_gives_back_the_unwritten_reservation():
    """abandon() frees the blocks a reservation added and keeps the written positions; nothing is left to advance into."""
    t = BlockTables(num_blocks=6, block_size=4)
    a, _ = t.add_sequence()
    t.append(a, 5)  # blocks 0 and 1
    t.reserve(a, 8)  # positions 5..12: the rest of block 1, then two more blocks
    assert len(t.sequences[a].table) == 4
    assert t.abandon(a) == 2
    assert t.sequences[a].table == [0, 1] and t.sequences[a].length == 5 and t.allocator.num_free == 4
    with pytest.raises(ValueError, match="reserved"):
        t.advance(a, 1)
    t.check_invariants()


def test_token_ids_stay_at_their_positions():
    """Ids given for positions 4..7 after four positions without ids never make block 0 look like those ids."""
    t = BlockTables(num_blocks=8, block_size=4)
    a, _ = t.add_sequence()
    t.append(a, 4)  # ids unknown
    t.append(a, 4, [1, 2, 3, 4])  # the ids of positions 4..7
    b, reused = t.add_sequence([1, 2, 3, 4, 5])
    assert reused == 0  # block 0 holds unknown ids: it must not serve a prompt starting 1, 2, 3, 4
    c, _ = t.add_sequence()
    t.append(c, 4, [1, 2, 3, 4])  # the same ids at positions 0..3: now block 0 of c can serve
    d, reused = t.add_sequence([1, 2, 3, 4, 5])
    assert reused == 4 and t.sequences[d].table[0] == t.sequences[c].table[0]
    t.check_invariants()


@pytest.mark.parametrize(
    "args, rule",
    [
        ((-1,), "new_tokens must be positive"),
        ((0,), "new_tokens must be positive"),
        ((2, [1]), "one id per new position"),
        ((4,), "reserved"),
        ((2, [1, 9]), "declared"),
    ],
    ids=["negative", "zero", "ids-of-wrong-length", "past-the-reservation", "contradicts-the-prompt"],
)
def test_inconsistent_advance_is_refused_and_changes_nothing(args, rule):
    """advance refuses counts that are not positive, id lists of the wrong length, unreserved positions and ids against the prompt."""
    t = BlockTables(num_blocks=8, block_size=4)
    a, _ = t.add_sequence([1, 2, 3, 4, 5, 6])
    t.reserve(a, 3)
    before = public_state(t)
    with pytest.raises(ValueError, match=rule):
        t.advance(a, *args)
    assert public_state(t) == before


def test_prefix_cache_names_blocks_by_sha256_so_python_hash_collisions_do_no_harm():
    """Two prompts whose tuples collide under Python's hash() each get their own prefix-cache entry."""
    m = 2**61 - 1  # on 64-bit CPython an int hashes to itself modulo 2**61 - 1, so hash(m) == hash(0)
    first, crafted = [0, 0, 0, 0, 7], [m, m, m, m, 7]
    assert hash((0, tuple(first[:4]))) == hash((0, tuple(crafted[:4])))  # the collision a hash() chain would suffer
    t = BlockTables(num_blocks=8, block_size=4)
    writers = []
    for prompt in (first, crafted):
        sid, reused = t.add_sequence(prompt)
        assert reused == 0
        t.append(sid, len(prompt))
        writers.append(sid)
    for prompt, writer in zip((first, crafted), writers):
        sid, reused = t.add_sequence(prompt)
        assert reused == 4 and t.sequences[sid].table[0] == t.sequences[writer].table[0]
    t.check_invariants()
    from kvlessons.paging import ROOT_HASH, chain_hash

    assert len(chain_hash(ROOT_HASH, first[:4])) == 32
    assert chain_hash(ROOT_HASH, first[:4]) != chain_hash(ROOT_HASH, crafted[:4])


def test_crop_takes_a_no_longer_full_block_out_of_the_prefix_cache():
    """After crop(6) with blocks of 4, block 0 still serves the prompt, block 1 (2 positions left) does not."""
    t = BlockTables(num_blocks=8, block_size=4)
    prompt = list(range(9))
    a, _ = t.add_sequence(prompt)
    t.append(a, 9)
    t.reserve(a, 4)
    t.crop(a, 6)
    with pytest.raises(ValueError, match="reserved"):
        t.advance(a, 1)  # crop gave back the reservation too
    assert len(t.sequences[a].table) == 2
    b, reused = t.add_sequence(prompt)
    assert reused == 4
    t.check_invariants()


def test_a_cached_block_is_copied_before_a_write_even_when_one_sequence_holds_it():
    """A block in the prefix cache is never written: a sequence that cropped into it, and now holds it alone, copies it."""
    one_layer = ModelShape(layers=1, q_heads=1, kv_heads=1, head_dim=1)
    pool = PagedKVCache(one_layer, num_blocks=8, block_size=4)
    a, _ = pool.add_sequence([1, 2, 3, 4, 5])
    k = torch.arange(5.0).view(1, 1, 5, 1)
    pool.append(a, [k], [k])  # block 0 (ids 1, 2, 3, 4) joins the prefix cache
    b = pool.fork(a)
    pool.crop(b, 2)  # b keeps two positions of block 0, which a still holds in full
    pool.free(a)  # now b alone holds block 0, and it is still cached for prompts starting 1, 2, 3, 4
    new = torch.full((1, 1, 2, 1), 9.0)
    pool.append(b, [new], [new], tokens=[8, 9])
    pool.check_invariants()
    assert pool.gather(0, b, 4)[0].flatten().tolist() == [0.0, 1.0, 9.0, 9.0]
    c, reused = pool.add_sequence([1, 2, 3, 4, 5])
    assert reused == 0  # the cached block went with the copy: no block holds ids 1, 2, 3, 4 any more


def test_check_invariants_catches_shared_writable_blocks_and_mislabelled_cached_blocks():
    """A writable block held by two tables, or a cached block whose holder has other ids there, is reported."""
    t = BlockTables(num_blocks=8, block_size=4)
    a, _ = t.add_sequence()
    t.append(a, 5, [1, 2, 3, 4, 5])
    t.reserve(a, 2)
    t.check_invariants()
    seq = t.sequences[a]
    b, _ = t.add_sequence()
    t.sequences[b] = dataclasses.replace(seq, table=list(seq.table))  # every block shared, as a careless fork would
    for block in seq.table:
        t.allocator.incref(block)
    with pytest.raises(AssertionError, match="may write into block"):
        t.check_invariants()
    t.free(b)
    t.abandon(a)
    t.check_invariants()
    t.sequences[a].ids[2] = 9  # block 0 is cached as ids 1, 2, 3, 4
    with pytest.raises(AssertionError, match="cached with other ids"):
        t.check_invariants()


# --- property-based: random operations on a pool whose data says what it should hold -------------

PROMPTS = [None, [5, 6, 7], [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def fingerprints(ids):
    """One number per position that depends on every id up to it, as a position's K/V depends on its prefix."""
    out, h = [], 0
    for token in ids:
        h = (h * 31 + token + 1) % 2**21  # small enough to be exact in float32
        out.append(float(h))
    return out


class PagedPoolMachine(RuleBasedStateMachine):
    """Add, reserve, write, abandon, fork, crop, clear and free at random on a one-layer pool.

    Each position stores the fingerprint of the true ids up to it (K) and its negation
    (V), so reading a sequence back checks that forks, copy-on-write and prefix reuse
    never hand it data that is not its own. The bookkeeping invariants hold after
    every step, and every refused call changes nothing.
    """

    @initialize(num_blocks=st.integers(3, 10), block_size=st.sampled_from([1, 2, 3, 4]))
    def start(self, num_blocks, block_size):
        self.pool = PagedKVCache(ModelShape(layers=1, q_heads=1, kv_heads=1, head_dim=1), num_blocks, block_size)
        self.true_ids = {}  # seq_id -> the id at every written position, whether or not the tables were told

    def pick(self, data, where=lambda seq: True):
        return data.draw(st.sampled_from(sorted(s for s, q in self.pool.sequences.items() if where(q))))

    def refused(self, call, error):
        """``call`` raises ``error`` and leaves every table, count and map as it was."""
        before = self.pool.state()
        with pytest.raises(error):
            call()
        assert self.pool.state() == before

    def tried(self, call, need):
        """Run ``call``; if the pool is exhausted, it must have been short of ``need`` blocks and changed nothing."""
        before, free = self.pool.state(), self.pool.allocator.num_free
        try:
            return call()
        except PoolExhaustedError:
            assert need > free
            assert self.pool.state() == before
            return None

    @precondition(lambda self: len(self.pool.sequences) < 5)  # a few sequences; steps go to what they do
    @rule(prompt=st.sampled_from(PROMPTS))
    def add(self, prompt):
        sid, reused = self.pool.add_sequence(prompt)
        self.true_ids[sid] = (prompt or [])[:reused]

    def grow(self, data, sid):
        """Reserve some positions, then write some of the reservation (perhaps none: a pass that failed)."""
        n = data.draw(st.integers(1, 6))
        if self.tried(lambda: self.pool.reserve(sid, n), self.pool.blocks_needed(sid, n)) is None:
            return
        seq = self.pool.sequences[sid]
        written = seq.reserved if data.draw(st.booleans()) else data.draw(st.integers(0, seq.reserved))
        if written:
            # Inside the declared prompt the true ids are the prompt's (that is what declaring means).
            new = [seq.prompt[p] if p < len(seq.prompt) else data.draw(st.integers(0, 3)) for p in range(seq.length, seq.length + written)]
            k = torch.tensor(fingerprints(self.true_ids[sid] + new)[-written:]).view(1, 1, written, 1)
            self.pool.write(0, sid, k, -k)
            self.pool.advance(sid, written, new if data.draw(st.booleans()) else None)
            self.true_ids[sid] += new

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def reserve_and_write(self, data):
        self.grow(data, self.pick(data))

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def refused_advances(self, data):
        sid = self.pick(data)
        seq = self.pool.sequences[sid]
        self.refused(lambda: self.pool.advance(sid, seq.reserved + 1), ValueError)
        self.refused(lambda: self.pool.advance(sid, 0), ValueError)
        if seq.reserved >= 2:
            self.refused(lambda: self.pool.advance(sid, 2, [0]), ValueError)
        if seq.reserved and seq.length < len(seq.prompt):
            self.refused(lambda: self.pool.advance(sid, 1, [seq.prompt[seq.length] + 1]), ValueError)

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def fork(self, data):
        sid = self.pick(data)
        seq = self.pool.sequences[sid]
        child = self.tried(lambda: self.pool.fork(sid), int(bool(seq.length % self.pool.block_size and seq.reserved)))
        if child is not None:
            self.true_ids[child] = list(self.true_ids[sid])
            self.grow(data, data.draw(st.sampled_from([sid, child])))  # one of the two writes on at once

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data(), how=st.sampled_from(["abandon", "crop", "clear", "free"]))
    def let_go(self, data, how):
        """Give back a sequence's reservation, rewind it, empty it, or end it."""
        sid = self.pick(data)
        if how == "abandon":
            self.pool.abandon(sid)
        elif how == "crop":
            length = data.draw(st.integers(0, self.pool.sequences[sid].length))
            self.pool.crop(sid, length)
            del self.true_ids[sid][length:]
        elif how == "clear":
            self.pool.clear(sid)
            self.true_ids[sid] = []
        else:
            self.pool.free(sid)
            del self.true_ids[sid]

    @invariant()
    def every_sequence_reads_what_it_wrote(self):
        self.pool.check_invariants()
        assert self.pool.slots_used() <= self.pool.slots_held()
        for sid, seq in self.pool.sequences.items():
            truth = self.true_ids[sid]
            assert len(truth) == seq.length
            assert all(known in (None, true) for known, true in zip(seq.ids, truth))
            if seq.length:
                k, v = self.pool.gather(0, sid, seq.length)
                assert k.flatten().tolist() == fingerprints(truth)
                assert (-v).flatten().tolist() == fingerprints(truth)


def test_random_pool_operations_keep_the_invariants_and_the_data():
    """Hypothesis drives the pool: invariants hold, refusals change nothing, every sequence reads its own K/V."""
    run_state_machine_as_test(
        PagedPoolMachine,
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None, database=None, derandomize=True),
    )


# --- paged attention ---------------------------------------------------------------------------

def scattered_pool(k, v, block_size, g, spare=5):
    """A pool (2, H_kv, blocks, block_size, D) holding k, v (1, H_kv, S, D) through a shuffled table, noise elsewhere.

    Position p of head h is written where the documented layout puts it: slot p % block_size
    of block table[p // block_size], K at pool[0, h, ...] and V at pool[1, h, ...].
    """
    h_kv, s, d = k.shape[1:]
    n = -(-s // block_size)
    pool = torch.randn(2, h_kv, n + spare, block_size, d, generator=g)  # other sequences' rows everywhere else
    table = torch.randperm(n + spare, generator=g)[:n].tolist()
    for p in range(s):
        pool[0, :, table[p // block_size], p % block_size] = k[0, :, p]
        pool[1, :, table[p // block_size], p % block_size] = v[0, :, p]
    return pool, table


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_equals_contiguous(seed):
    """Through a shuffled block table, both paged forms equal attention over the same keys held contiguously."""
    rng = random.Random(seed)
    h_q, h_kv = rng.choice(list(HEAD_LAYOUTS.values()))
    bs = rng.choice([1, 3, 4, 16])
    s = rng.randint(1, 70)
    t = rng.randint(1, min(s, 5))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, h_kv, s, 8, generator=g), torch.randn(1, h_kv, s, 8, generator=g)  # (B, H_kv, S, D)
    pool, table = scattered_pool(k, v, bs, g)
    q = torch.randn(1, h_q, t, 8, generator=g)
    torch.testing.assert_close(paged_attention(q, pool, table, s), reference_attention(q, k, v))
    last = q[:, :, -1:]  # the blockwise form is the decode step: one query
    torch.testing.assert_close(paged_attention_blockwise(last, pool, table, s), reference_attention(last, k, v))


@pytest.mark.parametrize("t", [1, 3])
def test_paged_attention_gqa_partial_block_and_new_tokens(t):
    """8 query heads on 2 KV heads, 37 keys in blocks of 16 (the last block 5/16 full), a shuffled table given as a
    tensor: the last t queries see exactly the keys at or before their own position (bottom-right causal mask)."""
    g = torch.Generator().manual_seed(t)
    k, v = torch.randn(1, 2, 37, 16, generator=g), torch.randn(1, 2, 37, 16, generator=g)
    pool, table = scattered_pool(k, v, 16, g)
    q = torch.randn(1, 8, t, 16, generator=g)
    got = paged_attention(q, pool, torch.tensor(table), 37)
    want = torch.cat([reference_attention(q[:, :, i : i + 1], k[:, :, : 37 - t + 1 + i], v[:, :, : 37 - t + 1 + i])
                      for i in range(t)], dim=2)  # query i sits at position 37 - t + i and sees keys 0 .. itself
    torch.testing.assert_close(got, want)


def test_gather_order_follows_the_table():
    pool = torch.arange(6 * 2.0).view(1, 1, 6, 2, 1) * torch.tensor([1.0, -1.0]).view(2, 1, 1, 1, 1)  # block b: 2b, 2b+1
    k, v = gather_kv(pool, [4, 1, 3], 5)
    assert k.flatten().tolist() == [8, 9, 2, 3, 6] and v.flatten().tolist() == [-8, -9, -2, -3, -6]


def test_gather_yields_attention_layout_and_refuses_a_short_table():
    """Each head's gathered keys are one run of rows (D apart), as a contiguous cache's: nothing left to copy."""
    pool = torch.randn(2, 3, 10, 4, 8)
    k, v = gather_kv(pool, [7, 2, 5], 10)
    for x in (k, v):
        assert x.shape == (1, 3, 10, 8) and x.stride()[2:] == (8, 1)
    with pytest.raises(ValueError, match="3 blocks"):
        gather_kv(pool, [7, 2], 10)


def test_paged_pool_stores_what_each_head_wrote_where_the_table_says():
    """K and V of position p, head h, land in pool[0 or 1, h, table[p // block_size], p % block_size]."""
    pool = PagedKVCache(ModelShape(layers=1, q_heads=2, kv_heads=2, head_dim=3), num_blocks=6, block_size=4)
    other, _ = pool.add_sequence()
    pool.append(other, 4)  # block 0 taken by another sequence: ours starts elsewhere
    a, _ = pool.add_sequence()
    k = torch.arange(2 * 6 * 3, dtype=torch.float32).view(1, 2, 6, 3)
    pool.append(a, [k], [-k])
    table, stored = pool.sequences[a].table, pool.kv_pools[0]
    for h in range(2):
        for p in range(6):
            assert torch.equal(stored[0, h, table[p // 4], p % 4], k[0, h, p])
            assert torch.equal(stored[1, h, table[p // 4], p % 4], -k[0, h, p])


# --- the model on a paged cache -----------------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tiny_decoder_same_tokens_paged_and_static(layout, block_size, dev):
    model = small_model(*HEAD_LAYOUTS[layout], dev=dev)
    prompt = random_ids(1, 11, dev=dev)
    paged = PagedKVCache(model.shape, num_blocks=40, block_size=block_size, device=dev)
    sid, _ = paged.add_sequence()
    fast = generate(model, prompt, 14, cache=paged.view(sid))
    ref = generate(model, prompt, 14, cache=StaticCache(25))
    assert torch.equal(fast.tokens, ref.tokens)
    torch.testing.assert_close(fast.logits, ref.logits, atol=1e-5, rtol=1e-5)
    paged.check_invariants()


def test_chunked_prefill_on_a_paged_view(dev):
    model = small_model(dev=dev)
    ids = random_ids(1, 23, dev=dev)
    paged = PagedKVCache(model.shape, num_blocks=10, block_size=4, device=dev)
    sid, _ = paged.add_sequence()
    view = paged.view(sid)
    with torch.inference_mode():
        pieces = [model(ids[:, a:b], cache=view) for a, b in [(0, 7), (7, 8), (8, 20), (20, 23)]]
        torch.testing.assert_close(torch.cat(pieces, 1), model(ids), atol=1e-5, rtol=1e-5)


def test_copy_on_write_leaves_the_parent_untouched(dev):
    """A fork's first token copies the shared partial block; the parent's K/V stay bit-identical."""
    model = small_model(dev=dev)
    paged = PagedKVCache(model.shape, num_blocks=12, block_size=4, device=dev)
    a, _ = paged.add_sequence()
    ids = random_ids(1, 10, dev=dev)
    with torch.inference_mode():
        model(ids, cache=paged.view(a))
        parent_k = paged.view(a).layer(0).keys.clone()
        b = paged.fork(a)
        model(random_ids(1, 1, seed=5, dev=dev), cache=paged.view(b))
        assert torch.equal(paged.view(a).layer(0).keys, parent_k)
        assert paged.sequences[a].table[:2] == paged.sequences[b].table[:2]  # full blocks still shared
        assert paged.sequences[a].table[2] != paged.sequences[b].table[2]  # the partial one was copied
        torch.testing.assert_close(paged.view(b).layer(0).keys[:, :, :10], parent_k)
    paged.check_invariants()


def test_prefix_sharing_with_the_model_gives_the_same_tokens(dev):
    """A second chat reusing a cached system prompt generates what it would from scratch."""
    model = small_model(dev=dev)
    system = random_ids(1, 20, seed=1, dev=dev)
    paged = PagedKVCache(model.shape, num_blocks=30, block_size=4, device=dev)
    a, _ = paged.add_sequence(system[0].tolist())
    generate(model, system, 5, cache=paged.view(a))
    b, reused = paged.add_sequence(system[0].tolist())
    assert reused == 16
    shared = generate(model, system[:, reused:], 5, cache=paged.view(b))
    alone = generate(model, system, 5, cache=StaticCache(30))
    assert torch.equal(shared.new_tokens, alone.new_tokens)
    paged.check_invariants()


def test_full_paged_pool_refuses_before_writing(dev):
    model = small_model(dev=dev)
    paged = PagedKVCache(model.shape, num_blocks=2, block_size=4, device=dev)
    sid, _ = paged.add_sequence()
    with torch.inference_mode():
        model(random_ids(1, 6, dev=dev), cache=paged.view(sid))
        with pytest.raises(PoolExhaustedError):
            model(random_ids(1, 5, dev=dev), cache=paged.view(sid))
    assert paged.sequences[sid].length == 6 and len(paged.sequences[sid].table) == 2
    paged.check_invariants()


def raise_in_middle_block(model, exc):
    """A hook that raises ``exc`` after the middle block has written its cache."""

    def hook(*_):
        raise exc

    return model.blocks[len(model.blocks) // 2].register_forward_hook(hook)


def held_kv(pool, seq_ids):
    """Copies of the keys and values every layer of each sequence holds."""
    layers = [pool.view(s).layer(i) for s in seq_ids for i in pool.kv_pools]
    return [t.clone() for layer in layers for t in (layer.keys, layer.values)]


def test_a_failed_pass_leaves_a_shared_pool_exactly_as_it_was(dev):
    """A pass that copied a shared block and wrote half its layers, then failed, leaves every table, count and K/V as before."""
    model = small_model(dev=dev, layers=4)
    ids = random_ids(1, 12, dev=dev)
    pool = PagedKVCache(model.shape, num_blocks=12, block_size=4, device=dev)
    a, _ = pool.add_sequence(ids[0, :10].tolist())
    with torch.inference_mode():
        model(ids[:, :10], cache=pool.view(a))
        b = pool.fork(a)  # shares A's three blocks, the last one partly filled
        before, held = public_state(pool), held_kv(pool, (a, b))
        handle = raise_in_middle_block(model, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 10:12], cache=pool.view(b))  # copies the shared block, writes two layers, fails
        handle.remove()
        assert public_state(pool) == before
        assert all(torch.equal(x, y) for x, y in zip(held_kv(pool, (a, b)), held))
        pool.check_invariants()
        torch.testing.assert_close(model(ids[:, 10:12], cache=pool.view(b)), model(ids)[:, 10:], atol=1e-5, rtol=1e-5)
    pool.check_invariants()


def test_a_view_refuses_ids_that_contradict_the_declared_prompt(dev):
    """Feeding other ids than add_sequence(prompt) declared raises ValueError and changes nothing."""
    model = small_model(dev=dev)
    prompt = random_ids(1, 6, dev=dev)
    pool = PagedKVCache(model.shape, num_blocks=8, block_size=4, device=dev)
    a, _ = pool.add_sequence(prompt[0].tolist())
    wrong = prompt.clone()
    wrong[0, 3] = (wrong[0, 3] + 1) % 50
    before = public_state(pool)
    with torch.inference_mode(), pytest.raises(ValueError, match="declared"):
        model(wrong, cache=pool.view(a))
    assert public_state(pool) == before
    pool.check_invariants()


def test_generated_tokens_fill_reusable_blocks(dev):
    """A view records the ids it is fed, so a prompt repeating a whole conversation reuses its generated part too."""
    model = small_model(dev=dev)
    pool = PagedKVCache(model.shape, num_blocks=20, block_size=4, device=dev)
    prompt = random_ids(1, 6, dev=dev)
    a, _ = pool.add_sequence(prompt[0].tolist())
    conversation = generate(model, prompt, 10, cache=pool.view(a)).tokens  # 6 + 10 tokens; 15 were fed
    follow_up = torch.cat([conversation, random_ids(1, 2, seed=4, dev=dev)], dim=1)
    b, reused = pool.add_sequence(follow_up[0].tolist())
    assert reused == 12  # positions 0..11: three full blocks, two of them generated
    shared = generate(model, follow_up[:, reused:], 5, cache=pool.view(b))
    alone = generate(model, follow_up, 5, cache=StaticCache(follow_up.shape[1] + 5))
    assert torch.equal(shared.new_tokens, alone.new_tokens)
    pool.check_invariants()


def test_crop_rewinds_one_sequence_and_copy_on_write_protects_its_fork(dev):
    """Cropping into a block shared with a fork and continuing with edited ids leaves the fork's K/V untouched."""
    model = small_model(dev=dev)
    ids = random_ids(1, 14, dev=dev)
    edited = ids.clone()
    edited[0, 6] = (edited[0, 6] + 1) % 50
    pool = PagedKVCache(model.shape, num_blocks=16, block_size=4, device=dev)
    a, _ = pool.add_sequence()
    with torch.inference_mode():
        model(ids[:, :10], cache=pool.view(a))
        b = pool.fork(a)
        fork_keys = pool.view(b).layer(0).keys.clone()
        view = pool.view(a)
        view.crop(6)  # inside block 1 (positions 4..7), which b also holds
        assert view.seq_len == 6 and pool.sequences[a].table == pool.sequences[b].table[:2]
        torch.testing.assert_close(model(edited[:, 6:], cache=view), model(edited)[:, 6:], atol=1e-5, rtol=1e-5)
        assert pool.sequences[a].table[1] != pool.sequences[b].table[1]  # copied before the write
        assert torch.equal(pool.view(b).layer(0).keys, fork_keys)
        torch.testing.assert_close(model(ids[:, 10:], cache=pool.view(b)), model(ids)[:, 10:], atol=1e-5, rtol=1e-5)
    pool.check_invariants()


def test_a_view_has_every_layer_measures_its_blocks_and_resets(dev):
    """layers() gives one object per cache layer; nbytes() is the blocks the table holds; reset() frees them."""
    model = small_model(dev=dev)  # two layers
    pool = PagedKVCache(model.shape, num_blocks=8, block_size=4, device=dev)
    a, _ = pool.add_sequence()
    view = pool.view(a)
    assert len(view.layers()) == 2 and view.nbytes() == 0
    with torch.inference_mode():
        model(random_ids(1, 6, dev=dev), cache=view)
    assert [layer.seq_len for layer in view.layers()] == [6, 6]
    assert view.nbytes() == 2 * pool.bytes_per_block()
    view.reset()
    assert view.seq_len == 0 and view.nbytes() == 0 and pool.allocator.num_free == 8 and a in pool.sequences
    pool.check_invariants()


@pytest.mark.parametrize(
    "shape, rule",
    [((1, 3, 2, 8), "kv_heads=2"), ((1, 2, 2, 4), "head_dim=8"), ((2, 2, 2, 8), "batch size 1")],
    ids=["kv-heads", "head-dim", "batch"],
)
def test_paged_write_refuses_keys_of_the_wrong_shape(shape, rule):
    """K/V that do not fit the pool's (kv_heads, head_dim), or a batch of several sequences, raise ValueError naming the rule."""
    pool = PagedKVCache(ModelShape(layers=1, q_heads=4, kv_heads=2, head_dim=8), num_blocks=4, block_size=4)
    a, _ = pool.add_sequence()
    pool.reserve(a, 2)
    k = torch.ones(shape)
    with pytest.raises(ValueError, match=rule):
        pool.write(0, a, k, k)
    with pytest.raises(ValueError, match=rule):
        pool.view(a).layer(0).update(k, k)
    assert not pool.kv_pools[0].any()


def test_nbytes_is_the_pool():
    model = small_model(q_heads=4, kv_heads=2)
    paged = PagedKVCache(model.shape, num_blocks=10, block_size=4)
    assert paged.nbytes() == 2 * 2 * 10 * 4 * 2 * 8 * 4  # K and V, 2 layers, blocks x slots x heads x dim x 4 B


# --- simulation and scenario --------------------------------------------------------------------

def test_paged_waste_stays_below_one_block_per_sequence():
    """In the simulated workload, paged held-minus-used slots never exceed one block per running sequence."""
    reqs = make_workload(80, seed=3)
    r = simulate(reqs, capacity=8 * 2048, policy="paged", block_size=16)
    assert r.finished == 80
    for running, used, held in zip(r.running, r.used, r.held):
        assert held - used <= 16 * running
    contiguous = simulate(reqs, capacity=8 * 2048, policy="contiguous")
    assert contiguous.finished == 80 and contiguous.waste > 0.3 > 0.05 > r.waste
    assert r.mean_running > contiguous.mean_running


def test_simulation_rejects_bad_arguments():
    reqs = make_workload(5)
    with pytest.raises(ValueError, match="policy"):
        simulate(reqs, 4096, policy="buddy")
    with pytest.raises(ValueError, match="capacity"):
        simulate(reqs, 0)
    with pytest.raises(ValueError, match="preemption must be 'recompute' or 'swap', got 'evict'"):
        simulate(reqs, 4096, preemption="evict")
    with pytest.raises(ValueError, match="token_budget must be positive, got 0"):
        simulate(reqs, 4096, token_budget=0)
    with pytest.raises(ValueError, match="token_budget must be an integer"):
        simulate(reqs, 4096, token_budget=2048.0)
    with pytest.raises(ValueError, match="preemption='swap' needs swap_blocks"):
        simulate(reqs, 4096, preemption="swap")
    with pytest.raises(ValueError, match="swap_blocks must be non-negative, got -1"):
        simulate(reqs, 4096, preemption="swap", swap_blocks=-1)
    with pytest.raises(ValueError, match="swap_blocks is used only with preemption='swap'"):
        simulate(reqs, 4096, swap_blocks=64)
    with pytest.raises(ValueError, match="needs policy='paged'"):
        simulate(reqs, 4096, policy="contiguous", preemption="swap", swap_blocks=64)
    with pytest.raises(ValueError, match="request ids must be unique: 0 appears twice"):
        simulate([Request(0, 0, 5, 5), Request(0, 1, 5, 5)], 4096)
    with pytest.raises(ValueError, match="request 1's output_len must be positive, got 0"):
        simulate([Request(0, 0, 5, 5), Request(1, 1, 5, 0)], 4096)
    with pytest.raises(ValueError, match="q must be a percentage"):
        simulate(reqs, 4096).ttft_percentile(0)


# The three hand-worked runs below write out every step; a step index counts from 0, and time to first
# token (TTFT) counts the steps from arrival to the first output token, that step included.

def test_prefill_costs_steps_under_a_token_budget():
    """Budget 8 tokens per step, blocks of 4 (plenty of them). A: arrives 0, prompt 10, output 3;
    B: arrives 0, prompt 6, output 2; C: arrives 2, prompt 9, output 2.

    step 0: A's prompt, first chunk of 8 (budget spent; B waits)                         -> 8 tokens
    step 1: A's last 2 prompt tokens (A's 1st token); B's whole prompt, 6 (B's 1st token)  -> 8
    step 2: decodes first: A (2nd), B (2nd, B done); then C's prompt, 6 of 9             -> 8
    step 3: A decodes (3rd, A done); C's last 3 prompt tokens (C's 1st token)            -> 4
    step 4: C decodes (2nd, C done)                                                      -> 1
    """
    requests = [Request(0, 0, 10, 3), Request(1, 0, 6, 2), Request(2, 2, 9, 2)]
    r = simulate(requests, capacity=64, policy="paged", block_size=4, token_budget=8)
    assert r.batched == [8, 8, 8, 4, 1] and r.steps == 5
    assert {i: (o.first_token_step, o.ttft, o.finish_step) for i, o in r.requests.items()} == {
        0: (1, 2, 3), 1: (1, 2, 2), 2: (3, 2, 4)}
    assert r.mean_ttft == 2 and r.ttft_percentile(50) == 2 and r.throughput == 7 / 5
    assert r.preempted == r.recomputed_tokens == 0
    # A budget no step can use up makes prefill cost no extra step: each first token comes in the arrival
    # step, the last one output_len - 1 steps later (how this simulation treated prefill before it had a cost).
    free = simulate(requests, capacity=64, policy="paged", block_size=4, token_budget=64)
    assert {i: (o.ttft, o.finish_step) for i, o in free.requests.items()} == {0: (1, 2), 1: (1, 1), 2: (1, 3)}
    assert free.batched == [10 + 6, 1 + 1, 1 + 9, 1]


PREEMPTED = [Request(0, 0, 3, 4), Request(1, 0, 3, 3)]  # A and B, in a pool of 4 blocks of 2 slots


def test_recompute_preemption_keeps_the_output_and_prefills_it_again():
    """A: prompt 3, output 4; B: prompt 3, output 3; both arrive at step 0; 4 blocks of 2 slots; budget 100.

    step 0: A and B prefill 3 tokens each (2 blocks each; pool full); both produce their 1st token -> 6
    step 1: both decode (4 tokens each: still 2 blocks each); 2nd tokens                          -> 2
    step 2: A's 5th token needs a 3rd block, none is free: B (admitted last) is preempted; its
            4 cached tokens are dropped, its 2 output tokens kept; A decodes its 3rd token        -> 1
    step 3: A decodes its 4th token and is done (frees its 3 blocks at the end of the step);
            B needs 3 blocks for prompt 3 + output 2 and only 1 is free: it waits                 -> 1
    step 4: B prefills its prompt and its 2 output tokens, 5 tokens, and produces its 3rd: done   -> 5
    """
    r = simulate(PREEMPTED, capacity=8, policy="paged", block_size=2, token_budget=100)
    assert r.batched == [6, 2, 1, 1, 5]
    assert r.preempted == 1 and r.recomputed_tokens == 4 and r.swapped_out_blocks == r.swapped_in_blocks == 0
    a, b = r.requests[0], r.requests[1]
    assert (a.finish_step, a.preemptions) == (3, 0)
    assert (b.generated, b.first_token_step, b.finish_step, b.preemptions, b.recomputed_tokens) == (3, 0, 4, 1, 4)
    # Every token of every prompt and output is computed once (the last output token never), plus the recomputed ones.
    assert sum(r.batched) == (3 + 4 - 1) + (3 + 3 - 1) + 4


def test_no_request_is_admitted_in_a_step_that_preempted():
    """A: prompt 1, output 3; B: prompt 3, output 3; both arrive at step 0; 4 blocks of 2 slots; budget 4.

    step 0: A prefills 1 token (1 block), B 3 tokens (2 blocks); both produce their 1st token       -> 4
    step 1: both decode, their 2nd tokens, in the blocks they hold                                  -> 2
    step 2: A takes the last free block, decodes its 3rd token and is done; B needs a 3rd block,
            none is free, and B itself is the latest admitted: B is preempted. Its 2 blocks are
            free now, but nothing is admitted in this step                                          -> 1
    step 3: B prefills 4 of its 5 tokens (prompt 3 + output 2; the budget is 4)                     -> 4
    step 4: B's 5th token, and its 3rd output token: done                                           -> 1
    Readmitting B at step 2 with a chunk of 3 would give 4, 2, 4, 2: memory just found short, refilled at once.
    """
    r = simulate([Request(0, 0, 1, 3), Request(1, 0, 3, 3)], capacity=8, policy="paged", block_size=2, token_budget=4)
    assert r.batched == [4, 2, 1, 4, 1]
    assert (r.preempted, r.recomputed_tokens, r.requests[1].finish_step, r.requests[0].finish_step) == (1, 4, 4, 2)


@pytest.mark.parametrize("swap_blocks", [2, 5])
def test_swap_preemption_moves_the_victims_blocks_and_recomputes_nothing(swap_blocks):
    """The same run with swap: at step 2, B's 2 blocks (4 tokens) go to host memory; at step 3 B needs
    3 blocks (its 4 cached tokens and the next one) and 1 is free; at step 4 its 2 blocks come back
    and it decodes 1 token, its 3rd, instead of prefilling 5."""
    r = simulate(PREEMPTED, capacity=8, policy="paged", block_size=2, token_budget=100, preemption="swap", swap_blocks=swap_blocks)
    assert r.batched == [6, 2, 1, 1, 1]
    assert (r.preempted, r.swapped_out_blocks, r.swapped_in_blocks, r.recomputed_tokens, r.swap_fallbacks) == (1, 2, 2, 0, 0)
    b = r.requests[1]
    assert (b.generated, b.finish_step, b.recomputed_tokens) == (3, 4, 0)


def test_swap_falls_back_to_recompute_when_host_memory_is_full():
    """With room for 1 block in host memory, B's 2 blocks do not fit: B is recomputed, step for step as above."""
    r = simulate(PREEMPTED, capacity=8, policy="paged", block_size=2, token_budget=100, preemption="swap", swap_blocks=1)
    assert r.batched == [6, 2, 1, 1, 5]
    assert (r.swap_fallbacks, r.swapped_out_blocks, r.swapped_in_blocks, r.recomputed_tokens) == (1, 0, 0, 4)
    assert any("recomputed instead" in line for line in r.assumptions())


@pytest.mark.parametrize("token_budget", [16, 64])
@pytest.mark.parametrize("policy, preemption, swap_blocks", [
    ("contiguous", "recompute", None), ("paged", "recompute", None), ("paged", "swap", 8), ("paged", "swap", 1000),
], ids=["contiguous", "recompute", "swap-small", "swap-large"])
def test_simulation_conserves_every_request_and_token(token_budget, policy, preemption, swap_blocks):
    """On a workload that preempts often: every request finishes with exactly its output length; the tokens
    computed are every prompt and output token once (the last output token never) plus those recomputed; no
    step goes over the budget or the cache; every swapped-out block comes back."""
    requests = make_workload(60, seed=1, mean_prompt=60, mean_output=40, max_len=256, arrivals_per_step=0.5)
    r = simulate(requests, capacity=512, policy=policy, block_size=8, max_len=256, token_budget=token_budget,
                 preemption=preemption, swap_blocks=swap_blocks)
    assert r.finished == len(requests) == len(r.requests)
    for q in requests:
        o = r.requests[q.id]
        assert o.generated == q.output_len
        assert q.arrival <= o.first_token_step <= o.finish_step < r.steps
        assert o.finish_step - o.first_token_step >= q.output_len - 1  # one output token per step at most
    assert sum(r.batched) == sum(q.prompt_len + q.output_len - 1 for q in requests) + r.recomputed_tokens
    assert r.recomputed_tokens == sum(o.recomputed_tokens for o in r.requests.values())
    assert max(r.batched) <= token_budget and max(r.held) <= 512
    assert all(u <= h for u, h in zip(r.used, r.held))
    assert r.swapped_in_blocks == r.swapped_out_blocks
    assert r.throughput == sum(q.output_len for q in requests) / r.steps
    if policy == "paged":
        assert r.preempted > 0
        assert (r.swapped_out_blocks > 0) == (preemption == "swap")
        assert (r.recomputed_tokens > 0) == (swap_blocks != 1000)  # a small host memory falls back to recompute
        assert (r.swap_fallbacks > 0) == (swap_blocks == 8)
    else:
        assert r.preempted == 0


def test_assumptions_name_the_settings_of_the_run():
    requests = make_workload(5)
    paged = simulate(requests, 4096, token_budget=512, preemption="swap", swap_blocks=64).assumptions()
    contiguous = simulate(requests, 4096, policy="contiguous", max_len=2048, max_new_tokens=2000).assumptions()
    for lines in (paged, contiguous):
        assert all(line[0].isupper() and line.endswith(".") for line in lines)
        assert any("Not modelled" in line for line in lines)
    assert any("at most 512 tokens" in line for line in paged)
    assert any("blocks of 16 slots" in line for line in paged)
    assert any("host memory of 64 blocks" in line for line in paged)
    assert any("plus 2,000 output slots" in line for line in contiguous)
    assert any("nothing is preempted" in line for line in contiguous)
    recompute = simulate(requests, 4096).assumptions()
    assert any("output so far is kept" in line for line in recompute)


@pytest.mark.parametrize(
    "policy, big, max_new_tokens",
    [("contiguous", Request(1, 0, 100, 50), 60), ("paged", Request(1, 0, 200, 10), None), ("paged", Request(1, 0, 100, 50), None)],
    ids=["contiguous-reservation", "paged-prompt", "paged-prompt-and-output"],
)
def test_simulation_refuses_a_request_larger_than_the_capacity(policy, big, max_new_tokens):
    """A request that could not run even alone is refused up front, instead of waiting until max_steps."""
    requests = [Request(0, 0, 10, 5), big]
    with pytest.raises(ValueError, match="whole capacity"):
        simulate(requests, capacity=128, policy=policy, block_size=16, max_len=256, max_new_tokens=max_new_tokens, max_steps=2000)
    fits = simulate(requests[:1], capacity=128, policy=policy, block_size=16, max_len=256, max_new_tokens=max_new_tokens)
    assert fits.finished == 1


def test_block_scenario_events():
    """The scripted scenario shows growth, a fork sharing blocks, copy-on-write and prefix reuse."""
    snaps = block_scenario()
    events = [s["event"] for s in snaps]
    assert any("forked" in e for e in events) and any("copy-on-write" in e for e in events)
    fork = next(s for s in snaps if "forked" in s["event"])
    assert fork["sequences"]["A"]["table"] == fork["sequences"]["C"]["table"]
    d = next(s for s in snaps if s["event"].startswith("D arrives"))
    assert "reusing 8" in d["event"] and max(d["ref_counts"]) == 3


def test_append_writes_every_layer_and_reads_back():
    """PagedKVCache.append stores K/V for all layers; gather returns them in order; blocks only when full."""
    from kvlessons import ModelShape

    shape = ModelShape(layers=2, q_heads=2, kv_heads=1, head_dim=4)
    paged = PagedKVCache(shape, num_blocks=4, block_size=2)
    sid, _ = paged.add_sequence()
    ks = [torch.randn(1, 1, 3, 4) for _ in range(2)]
    vs = [torch.randn(1, 1, 3, 4) for _ in range(2)]
    paged.append(sid, ks, vs)
    assert len(paged.sequences[sid].table) == 2 and paged.sequences[sid].length == 3
    for layer in (0, 1):
        k, v = paged.gather(layer, sid, 3)
        assert torch.equal(k, ks[layer]) and torch.equal(v, vs[layer])
    paged.append(sid, 1)  # bookkeeping form: fills the second block without a new one
    assert len(paged.sequences[sid].table) == 2
    with pytest.raises(ValueError, match="one"):
        paged.append(sid, ks[:1], vs[:1])
    t = BlockTables(4, 2)
    s2, _ = t.add_sequence()
    t.append(s2, 3)
    assert t.sequences[s2].length == 3 and len(t.sequences[s2].table) == 2
