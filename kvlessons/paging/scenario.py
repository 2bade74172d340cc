"""A scripted scenario of requests, forks and shared prefixes, one snapshot per event, for lesson 06's block-table widget."""

from __future__ import annotations

from .blocks import BlockTables


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
