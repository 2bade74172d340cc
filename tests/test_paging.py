import random

import pytest
import torch

from conftest import HEAD_LAYOUTS, random_ids, small_model
from kvlessons.attention import attend
from kvlessons.cache import StaticCache
from kvlessons.generate import generate
from kvlessons.paging import (
    BlockAllocator,
    BlockTables,
    PagedKVCache,
    PoolExhaustedError,
    block_scenario,
    gather_kv,
    make_workload,
    paged_attention,
    paged_attention_blockwise,
    simulate,
)


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
    """Random add / append / fork / free (with prefix sharing) never break the bookkeeping."""
    rng = random.Random(seed)
    t = BlockTables(num_blocks=rng.randint(4, 24), block_size=rng.choice([1, 2, 4, 8]))
    prompts = [[rng.randint(0, 3) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    for _ in range(120):
        op = rng.random()
        live = list(t.sequences)
        try:
            if op < 0.25 or not live:
                prompt = rng.choice(prompts)
                sid, reused = t.add_sequence(prompt)
                rest = len(prompt) - reused
                try:
                    t.reserve(sid, rest)
                except PoolExhaustedError:
                    t.free(sid)
                    t.check_invariants()
                    continue
                t.advance(sid, rest)
            elif op < 0.65:
                sid = rng.choice(live)
                n = rng.randint(1, 6)
                before = {s: (list(q.table), q.length) for s, q in t.sequences.items()}
                free_before = t.allocator.num_free
                try:
                    t.reserve(sid, n)
                except PoolExhaustedError:
                    after = {s: (list(q.table), q.length) for s, q in t.sequences.items()}
                    assert after == before and t.allocator.num_free == free_before  # refused, unchanged
                    continue
                t.advance(sid, n, [rng.randint(0, 3) for _ in range(n)])
            elif op < 0.8:
                t.fork(rng.choice(live))
            else:
                t.free(rng.choice(live))
        finally:
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


# --- paged attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_equals_contiguous(seed):
    """Through a shuffled block table, attention equals attention over the same keys held contiguously."""
    rng = random.Random(seed)
    h_q, h_kv = rng.choice(list(HEAD_LAYOUTS.values()))
    bs = rng.choice([1, 3, 4, 16])
    s = rng.randint(1, 70)
    t = rng.randint(1, min(s, 5))
    n = -(-s // bs)
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(n + 5, bs, h_kv, 8, generator=g)
    v_pool = torch.randn(n + 5, bs, h_kv, 8, generator=g)
    table = torch.randperm(n + 5, generator=g)[:n].tolist()
    q = torch.randn(1, h_q, t, 8, generator=g)
    k, v = gather_kv(k_pool, table, s).contiguous(), gather_kv(v_pool, table, s).contiguous()
    torch.testing.assert_close(paged_attention(q, k_pool, v_pool, table, s), attend(q, k, v))
    torch.testing.assert_close(paged_attention_blockwise(q[:, :, -1:], k_pool, v_pool, table, s), attend(q[:, :, -1:], k, v))


def test_gather_order_follows_the_table():
    pool = torch.arange(6 * 2.0).view(6, 2, 1, 1)  # block b holds 2b, 2b+1
    assert gather_kv(pool, [4, 1, 3], 5).flatten().tolist() == [8, 9, 2, 3, 6]


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
