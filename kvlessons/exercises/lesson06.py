"""Lesson 06's exercises: blocks and waste for one sequence, the block-table lookup built by hand, prefix reuse.

The build step has two parts. ``slot_of(position, block_table, block_size)`` returns
where one position lives, ``(block, offset)``; ``gather_sequence(pool, block_table,
seq_len)`` returns a sequence's rows (seq_len, H_kv, D) from a pool (num_blocks,
block_size, H_kv, D), one row per slot. The checkers compare them with a reference
gather on scattered tables and several block sizes (1 included, sequences ending
mid-block), recognise the classic mistakes by computing them too, and finally let the
tiny decoder generate through a ``kvlessons.paging`` pool that reads with the learner's
gather.
"""

from __future__ import annotations

import math
import operator

from .core import Feedback, NumericExercise, as_ints, check_parts, describe_error


__all__ = [
    "BLOCKS_2050", "WASTE_2050", "REUSE_B", "REUSE_C", "SLOT_HINTS", "GATHER_HINTS",
    "check_blocks_and_waste", "check_slot_of", "check_gather_sequence", "check_prefix_reuse",
]


# -- 06.1 blocks and waste of one sequence -------------------------------------------------------

SEQ_LEN, BLOCK_SIZE = 2050, 16


def _blocks_exercise() -> NumericExercise:
    blocks = math.ceil(SEQ_LEN / BLOCK_SIZE)
    return NumericExercise(
        name="blocks_2050",
        question=f"A sequence of {SEQ_LEN:,} tokens in blocks of {BLOCK_SIZE}: how many blocks does it hold?",
        answer=blocks,
        unit="blocks",
        rel_tol=1e-9,  # whole numbers: 128.125 must not pass for 128
        explanation=f"ceil({SEQ_LEN:,} / {BLOCK_SIZE}) = {blocks}: 128 full blocks hold 2,048 tokens, "
        f"and the last 2 tokens need one more block.",
        mistakes=[
            (SEQ_LEN // BLOCK_SIZE, f"That is {SEQ_LEN:,} // {BLOCK_SIZE}, rounded down: 128 blocks hold only "
             f"2,048 tokens. The 2 tokens left over need a block of their own (round up)."),
            (SEQ_LEN / BLOCK_SIZE, "Blocks come whole: a sequence cannot hold an eighth of a block. Round up."),
            (SEQ_LEN, "That many blocks would be needed with blocks of 1 slot; here each block holds 16 tokens."),
            (math.ceil(SEQ_LEN / BLOCK_SIZE) * BLOCK_SIZE, "That is the slots those blocks hold; the question asks for blocks."),
        ],
        hints=[
            "Each block holds 16 positions, and a block is taken as soon as one position needs it.",
            "128 blocks hold 128 x 16 = 2,048 positions. Where do positions 2,048 and 2,049 go?",
            "ceil(2,050 / 16) = 129 blocks (in Python: -(-2050 // 16) or math.ceil(2050 / 16)).",
        ],
    )


def _waste_exercise() -> NumericExercise:
    blocks = math.ceil(SEQ_LEN / BLOCK_SIZE)
    wasted = blocks * BLOCK_SIZE - SEQ_LEN
    return NumericExercise(
        name="waste_2050",
        question=f"The same {SEQ_LEN:,} tokens in blocks of {BLOCK_SIZE}: how many slots are held but empty?",
        answer=wasted,
        unit="slots",
        rel_tol=1e-9,
        explanation=f"{blocks} blocks x {BLOCK_SIZE} = {blocks * BLOCK_SIZE:,} slots held for {SEQ_LEN:,} tokens: "
        f"{wasted} empty, all in the last block, which holds 2 tokens.",
        mistakes=[
            (SEQ_LEN % BLOCK_SIZE, f"{SEQ_LEN:,} % {BLOCK_SIZE} = 2 is how many slots of the last block are filled. "
             f"The waste is the rest of that block: {BLOCK_SIZE} - 2."),
            (0, "128 blocks would waste nothing, but they hold only 2,048 tokens; with the 129th block the waste is "
             "that block's empty slots."),
            (-2, "A negative waste means the blocks hold fewer slots than the tokens need: 128 blocks are 2 slots short. "
             "Count the 129th block."),
            (BLOCK_SIZE, "Not a whole block: the last block holds 2 tokens, so only part of it is empty."),
        ],
        hints=[
            "Waste = slots held - tokens stored. How many slots do the blocks from the first part hold?",
            "129 blocks x 16 slots = 2,064 slots for 2,050 tokens.",
            "2,064 - 2,050 = 14 empty slots, all in the last block (16 slots, 2 of them filled).",
        ],
    )


BLOCKS_2050 = _blocks_exercise()
WASTE_2050 = _waste_exercise()


def check_blocks_and_waste(blocks, wasted) -> Feedback:
    """Exercise 06.1: blocks held and slots wasted by a 2,050-token sequence in blocks of 16."""
    return check_parts(("Blocks", BLOCKS_2050, blocks), ("Wasted slots", WASTE_2050, wasted))


# -- 06.2 slot_of: where one position lives -------------------------------------------------------

SLOT_HINTS = [
    "Position p is in the (p // block_size)-th block of the sequence, at offset p % block_size inside it.",
    "The sequence's i-th block is not block i of the pool: the table says which pool block it is, block_table[i].",
    "return block_table[position // block_size], position % block_size",
]


def _slot(p: int, table: list[int], bs: int) -> tuple[int, int]:
    return table[p // bs], p % bs


def _slot_cases() -> list[tuple[int, list[int], int]]:
    """(block_size, block_table, sequence length) for the lookups tried: small and readable first."""
    import torch

    g = torch.Generator().manual_seed(6)
    cases = [(4, [7, 2, 9, 4, 0], 18)]  # 18 positions: the last block is half full
    for bs, n in [(16, 13), (1, 23), (5, 9), (3, 7)]:
        cases.append((bs, torch.randperm(64, generator=g)[:n].tolist(), bs * n - (1 if bs > 1 else 0)))
    return cases




def _read_pair(got):
    """``got`` as (block, offset) ints, or the flat slot as an int, or None."""
    try:
        return operator.index(got) if not isinstance(got, bool) else None
    except TypeError:
        pass
    pair = as_ints(got)
    return tuple(pair) if pair is not None and len(pair) == 2 else None


def _slot_diagnosis(got: dict[int, object], table: list[int], bs: int) -> str | None:
    """Name the mistake that explains every answer in ``got`` (position -> what fn returned), if one does."""
    n = len(table) * bs
    candidates = [
        (lambda p: (table[p % bs], p // bs) if p % bs < len(table) else None,
         "You swapped // and %: the block is the position // block_size (which block of the sequence), "
         "the offset is position % block_size (where inside it)."),
        (lambda p: (p // bs, p % bs),
         "You returned the sequence's own block number, not the pool's. The sequence's blocks are scattered: "
         "look the number up in the table, block_table[position // block_size]."),
        (lambda p: (p % bs, table[p // bs]), "You returned (offset, block); return (block, offset)."),
        (lambda p: table[p // bs] * bs + p % bs,
         "You returned the flat slot block * block_size + offset. Return the pair (block, offset) instead."),
        (lambda p: _slot(p + 1, table, bs) if p + 1 < n else None,
         "Off by one: you return where the next position lives. Positions count from 0, and position "
         "block_size - 1 is still in the first block."),
        (lambda p: _slot(p - 1, table, bs) if p >= 1 else None,
         "Off by one: you return where the previous position lives. Position 0 is the first slot of the first block."),
        (lambda p: (table[p // bs], p % bs + 1), "Offsets count from 0: the first position of a block is at offset 0."),
        (lambda p: (table[-(-p // bs)], p % bs) if -(-p // bs) < len(table) else None,
         "You rounded the block number up: position p is in block p // block_size of the sequence, rounded down "
         "(positions 1 .. block_size - 1 are still in the first block)."),
    ]
    for wrong, why in candidates:
        tried = [(p, g) for p, g in got.items() if wrong(p) is not None]
        if tried and all(g == wrong(p) for p, g in tried):
            return why
    bad = [p for p, g in got.items() if g != _slot(p, table, bs)]
    if bad and bs > 1 and all(p % bs in (0, bs - 1) for p in bad):
        return (f"Wrong only at block boundaries (the first or last position of a block, e.g. position {bad[0]}): "
                f"check how you round; position // block_size already gives the right block, without +1 or -1.")
    return None


def check_slot_of(fn) -> Feedback:
    """Exercise 06.2: ``fn(position, block_table, block_size)`` must return ``(block, offset)`` in the pool."""
    if not callable(fn):
        return Feedback(False, f"Expected a function slot_of(position, block_table, block_size), got {fn!r}.")
    for bs, table, seq_len in _slot_cases():
        got, raised = {}, None
        for p in range(seq_len):
            try:
                answer = fn(p, list(table), bs)
            except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
                raised = raised or (p, err)
                continue
            pair = _read_pair(answer)
            if pair is None:
                return Feedback(False, f"slot_of({p}, {table}, {bs}) returned {answer!r:.80}; expected a pair of ints "
                                       f"(block, offset), e.g. {_slot(p, table, bs)}.")
            got[p] = pair
        why = _slot_diagnosis(got, table, bs) if got else None  # a mistake that also raises is named first
        bad = [p for p, pair in got.items() if pair != _slot(p, table, bs)]
        if why and bad:
            p = bad[0]
            return Feedback(False, f"slot_of({p}, {table}, {bs}) = {got[p]}, expected {_slot(p, table, bs)}. {why}")
        if raised:
            p, err = raised
            extra = ""
            if isinstance(err, IndexError):
                extra = " An index past the end of the table often means // and % are swapped."
            return Feedback(False, f"slot_of({p}, {table}, {bs}) raised {describe_error(err)}{extra} "
                                   f"Hint: {SLOT_HINTS[0]}")
        if bad:
            p = bad[0]
            return Feedback(False, f"slot_of({p}, {table}, {bs}) = {got[p]}, expected {_slot(p, table, bs)}. "
                                   f"Hint: {SLOT_HINTS[0]}")
    return Feedback(True, "Correct: (block_table[p // block_size], p % block_size) for every position tried, "
                          "with block sizes 1, 3, 4, 5 and 16 and scattered tables.")


# -- 06.3 gather_sequence: a sequence's rows, in order --------------------------------------------

GATHER_HINTS = [
    "Row p of the result is pool[block, offset] with (block, offset) = slot_of(p, block_table, block_size).",
    "Whole blocks at a time: pool[block_table[:n]] with n = ceil(seq_len / block_size) stacks the sequence's "
    "blocks in order; merge the first two dimensions, then keep only the first seq_len rows.",
    "n = -(-seq_len // block_size); rows = pool[torch.as_tensor(block_table[:n])]; "
    "return rows.reshape(-1, *pool.shape[2:])[:seq_len]",
]

_HEADS, _DIM = 2, 3  # the labelled pools of the checks: small rows whose values say where they come from


def _rows(pool, block_table, seq_len: int):
    """The reference answer: a sequence's rows (seq_len, H_kv, D) from a pool (num_blocks, block_size, H_kv, D)."""
    import torch

    n = -(-seq_len // pool.shape[1])
    blocks = pool.index_select(0, torch.as_tensor(block_table[:n], dtype=torch.long, device=pool.device))
    return blocks.reshape(-1, *pool.shape[2:])[:seq_len]


def _labelled_pool(num_blocks: int, bs: int):
    """A pool (num_blocks, bs, 2, 3) whose row at flat slot s holds 1000 s + 100 h + d: a row says where it lives."""
    import torch

    slot = torch.arange(num_blocks * bs, dtype=torch.float32).view(num_blocks, bs, 1, 1)
    h = torch.arange(_HEADS, dtype=torch.float32).view(1, 1, _HEADS, 1)
    d = torch.arange(_DIM, dtype=torch.float32).view(1, 1, 1, _DIM)
    return 1000 * slot + 100 * h + d


def _gather_cases() -> list[tuple[int, list[int], int, int]]:
    """(block_size, block_table, seq_len, num_blocks): a sequence ending mid-block first, then the edge cases."""
    import torch

    g = torch.Generator().manual_seed(7)
    # 23 tokens in blocks of 5: four full blocks and 3 slots of the fifth (as many blocks as slots per
    # block, so even // and % swapped stay inside the pool and can be named rather than crash)
    cases = [(5, [6, 1, 8, 3, 9], 23, 10)]
    for bs, seq_len, extra in [(16, 203, 0), (1, 23, 0), (4, 40, 1), (3, 1, 1), (16, 16, 0)]:
        n = -(-seq_len // bs) + extra  # extra: a table may already hold a block for the next tokens
        cases.append((bs, torch.randperm(48, generator=g)[:n].tolist(), seq_len, 48))
    return cases


def _slots_read(rows, pool) -> list[int] | None:
    """The flat slot each row of ``rows`` (R, 2, 3) was copied from in a labelled pool, or None if one was not."""
    import torch

    flat = pool.reshape(-1, _HEADS, _DIM)
    slots = []
    for row in rows:
        s = int(torch.round(row[0, 0] / 1000).item())
        if not 0 <= s < len(flat) or not torch.equal(row, flat[s]):
            return None
        slots.append(s)
    return slots


def _gather_diagnosis(slots: list[int], table: list[int], bs: int, seq_len: int) -> str | None:
    """Name the mistake whose reading order is ``slots``, if one is."""
    n = -(-seq_len // bs)
    want = [table[p // bs] * bs + p % bs for p in range(seq_len)]
    whole = [table[p // bs] * bs + p % bs for p in range(n * bs)]
    in_table = [table[p // bs] * bs + p % bs for p in range(len(table) * bs)]
    if slots in (whole, in_table) and len(slots) > seq_len:
        return (f"You returned {len(slots)} rows for a sequence of {seq_len}: whole blocks, including the empty "
                f"slots after its last token (or blocks the table holds for later tokens). Keep the first seq_len rows.")
    candidates = [
        ([p for p in range(seq_len)],
         "You read the pool's first blocks, 0, 1, 2, ..., in place of the sequence's: the sequence's i-th block "
         "is pool block block_table[i]. Index the pool through the table."),
        ([table[p % bs] * bs + p // bs if p % bs < len(table) else -1 for p in range(seq_len)],
         "You swapped // and %: position p is at offset p % block_size of block block_table[p // block_size]."),
        ([s for b in sorted(table[:n]) for s in range(b * bs, b * bs + bs)][:seq_len],
         "You took the right blocks but in the order they sit in the pool. The table's order is the sequence's order."),
        ([table[(p + 1) // bs] * bs + (p + 1) % bs if p + 1 < len(table) * bs else -1 for p in range(seq_len)],
         "Off by one: row p holds position p + 1. Row 0 is position 0, the first slot of block block_table[0]."),
        ([want[p - 1] if p else -1 for p in range(seq_len)],
         "Off by one: row p holds position p - 1. Row 0 is position 0, the first slot of block block_table[0]."),
    ]
    for wrong, why in candidates:
        if slots == wrong:
            return why
    if len(slots) == seq_len:
        bad = [p for p in range(seq_len) if slots[p] != want[p]]
        if bad and bs > 1 and all(p % bs in (0, bs - 1) for p in bad):
            return (f"Wrong only at block boundaries (row {bad[0]}): position p is in table entry p // block_size, "
                    f"at offset p % block_size, without +1 or -1.")
    return None


def _describe_gather(fn, bs, table, seq_len, num_blocks) -> str | None:
    """What is wrong with ``fn`` on one labelled case, or None if it returns the right rows."""
    import torch

    pool = _labelled_pool(num_blocks, bs)
    call = f"gather_sequence(pool, {table}, seq_len={seq_len}) with blocks of {bs}"
    try:
        got = fn(pool.clone(), list(table), seq_len)
    except Exception as err:  # noqa: BLE001
        extra = " An index out of range often means // and % are swapped." if isinstance(err, IndexError) else ""
        return f"{call} raised {describe_error(err)}{extra} Hint: {GATHER_HINTS[0]}"
    if not isinstance(got, torch.Tensor):
        return f"{call} returned {type(got).__name__} {got!r:.80}; expected a tensor (seq_len, H_kv, D)."
    want = _rows(pool, table, seq_len)
    if got.shape == (1, _HEADS, seq_len, _DIM):
        return (f"{call} has shape {tuple(got.shape)}: that is the layout attention reads (1, H_kv, seq_len, D). "
                f"Return the rows as the pool stores them, (seq_len, H_kv, D); the checker transposes.")
    if got.dim() != 3 or tuple(got.shape[1:]) != (_HEADS, _DIM):
        return f"{call} has shape {tuple(got.shape)}; expected (seq_len, H_kv, D) = {tuple(want.shape)}."
    if got.dtype != pool.dtype:
        return f"{call} returned {got.dtype}, the pool holds {pool.dtype}: keep the pool's dtype."
    if torch.equal(got, want):
        return None
    slots = _slots_read(got, pool)
    if slots is None:
        return (f"{call}: some rows are not rows of the pool as stored (a row's heads and head_dim must come "
                f"along unchanged). Hint: {GATHER_HINTS[1]}")
    why = _gather_diagnosis(slots, table, bs, seq_len)
    if why:
        return f"{call}: {why}"
    want_slots = _slots_read(want, pool)
    p = next((i for i, (a, b) in enumerate(zip(slots, want_slots)) if a != b), min(len(slots), len(want_slots)))
    if p < min(len(slots), len(want_slots)):
        got_at, want_at = divmod(slots[p], bs), divmod(want_slots[p], bs)
        return (f"{call}: row {p} came from block {got_at[0]}, offset {got_at[1]}; position {p} lives in block "
                f"{want_at[0]}, offset {want_at[1]}. Hint: {GATHER_HINTS[0]}")
    return f"{call} returned {len(slots)} rows, expected {seq_len}. Hint: {GATHER_HINTS[1]}"


def _paged_with(gather_fn):
    """A PagedKVCache class whose layers read a sequence back with ``gather_fn`` (rows), not the package's gather.

    The package's pool is (2, H_kv, num_blocks, block_size, D); ``gather_fn`` gets the
    exercise's layout, one row per slot: a copy of the K or V pool as (num_blocks, block_size, H_kv, D).
    """
    from ..paging import PagedKVCache

    class LearnerPagedKVCache(PagedKVCache):
        def gather(self, layer, seq_id, seq_len):
            table = list(self._seq(seq_id).table)
            k_rows, v_rows = self.kv_pools[layer].permute(0, 2, 3, 1, 4).contiguous()  # each (num_blocks, bs, H_kv, D)
            k = gather_fn(k_rows, table, seq_len)  # (seq_len, H_kv, D)
            v = gather_fn(v_rows, table, seq_len)
            return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, H_kv, seq_len, D)

    return LearnerPagedKVCache


def _decoder_run(fn, block_size: int = 4, new_tokens: int = 20) -> str | None:
    """What differs when the tiny decoder generates through a scattered paged pool read by ``fn``, or None."""
    import torch

    from ..cache import StaticCache
    from ..generate import generate
    from ..model import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig()).eval()  # weights from the config's own seed: the notebook's RNG is untouched
    prompt = torch.arange(3, 14).view(1, 11) * 7 % 96  # 11 tokens: the prompt ends mid-block
    pool = _paged_with(fn)(model.shape, num_blocks=24, block_size=block_size)
    # Other sequences come and go first, so this one's blocks are scattered and out of order.
    others = [pool.add_sequence()[0] for _ in range(10)]
    for sid in others:
        pool.append(sid, block_size)
    for sid in others[::2]:
        pool.free(sid)
    seq, _ = pool.add_sequence()
    reference = generate(model, prompt, new_tokens, cache=StaticCache(prompt.shape[1] + new_tokens))
    try:
        run = generate(model, prompt, new_tokens, cache=pool.view(seq))
    except Exception as err:  # noqa: BLE001
        return (f"Generating through a paged pool that reads with your gather_sequence raised "
                f"{type(err).__name__}: {err}.")
    table = pool.sequences[seq].table
    for step in range(new_tokens):
        if not torch.allclose(run.logits[:, step], reference.logits[:, step], atol=1e-4, rtol=1e-4):
            return (f"Your gather_sequence passes the small cases, but the tiny decoder reading through it (blocks of "
                    f"{block_size}, block table {table}) predicts differently from a contiguous cache at new token "
                    f"{step}. Hint: {GATHER_HINTS[1]}")
    if not torch.equal(run.tokens, reference.tokens):  # close logits can still break a near tie differently
        return "Generating through your gather_sequence chose other tokens than a contiguous cache."
    return None


def check_gather_sequence(fn) -> Feedback:
    """Exercise 06.3: ``fn(pool, block_table, seq_len)`` must return the sequence's rows (seq_len, H_kv, D) in order.

    Tried on labelled pools (each row's values say which slot it came from), then by
    generating with the tiny decoder through a paged pool that reads with ``fn``.
    """
    if not callable(fn):
        return Feedback(False, f"Expected a function gather_sequence(pool, block_table, seq_len), got {fn!r}.")
    for bs, table, seq_len, num_blocks in _gather_cases():
        problem = _describe_gather(fn, bs, table, seq_len, num_blocks)
        if problem:
            return Feedback(False, problem)
    problem = _decoder_run(fn)
    if problem:
        return Feedback(False, problem)
    return Feedback(True, "Correct: every row in order for block sizes 1, 3, 4, 5 and 16 and sequences ending "
                          "mid-block; and the tiny decoder, reading its keys and values through your gather from "
                          "blocks scattered across the pool, generates the same tokens with the same logits "
                          "(within 1e-4) as on a contiguous cache.")


# -- 06.4 prefix reuse -----------------------------------------------------------------------------

SYSTEM_LEN, QUESTION_A, QUESTION_B, REUSE_BLOCK = 90, 22, 7, 16


def _reused(prompt_a: list[int], prompt_new: list[int]) -> int:
    """Tokens of ``prompt_new`` a pool reuses once ``prompt_a`` is cached (computed by kvlessons.paging)."""
    from ..paging import BlockTables

    tables = BlockTables(num_blocks=32, block_size=REUSE_BLOCK)
    a, _ = tables.add_sequence(prompt_a)
    tables.append(a, len(prompt_a))
    return tables.add_sequence(prompt_new)[1]


def _reuse_exercises() -> tuple[NumericExercise, NumericExercise]:
    system = list(range(1000, 1000 + SYSTEM_LEN))
    prompt_a = system + list(range(2000, 2000 + QUESTION_A))
    prompt_b = system + list(range(3000, 3000 + QUESTION_B))
    reuse_b, reuse_c = _reused(prompt_a, prompt_b), _reused(prompt_a, list(prompt_a))
    bs, full = REUSE_BLOCK, SYSTEM_LEN // REUSE_BLOCK
    b = NumericExercise(
        name="reuse_b",
        question=f"A's prompt ({SYSTEM_LEN}-token system prompt + {QUESTION_A}-token question) is cached, blocks of {bs}. "
        f"B sends the same system prompt + a {QUESTION_B}-token question: how many of B's tokens are reused?",
        answer=reuse_b,
        unit="tokens",
        rel_tol=1e-9,
        explanation=f"{SYSTEM_LEN} // {bs} = {full} full blocks hold only system-prompt tokens: {full} x {bs} = "
        f"{reuse_b} tokens reused. Block {full} mixes the system prompt's last {SYSTEM_LEN - full * bs} tokens with "
        f"A's question, so B computes it itself.",
        mistakes=[
            (SYSTEM_LEN, f"Reuse goes by whole blocks. The system prompt ends inside block {full}, which also holds "
             f"A's question: its hash covers A's ids, not B's, so B cannot find it."),
            ((full + 1) * bs, f"You counted block {full} too, but it is not the same block for B: it holds "
             f"{SYSTEM_LEN - full * bs} system-prompt tokens and then A's question."),
            (SYSTEM_LEN + QUESTION_B, "Only what A's cache already holds can be reused; B's question is new."),
            (full, f"{full} is the number of blocks; the question asks for tokens ({bs} per block)."),
        ],
        hints=[
            "A block is found by the ids it holds (its hash covers all of them), and only full blocks are shared.",
            f"Which of A's blocks hold only system-prompt tokens? The system prompt fills {SYSTEM_LEN} / {bs} = "
            f"{SYSTEM_LEN / bs:.3g} blocks.",
            f"{full} full blocks x {bs} = {reuse_b} tokens.",
        ],
    )
    blocks_a = len(prompt_a) // bs
    c = NumericExercise(
        name="reuse_c",
        question=f"C sends exactly A's {len(prompt_a)}-token prompt again: how many of C's tokens are reused?",
        answer=reuse_c,
        unit="tokens",
        rel_tol=1e-9,
        explanation=f"all {blocks_a} blocks of the prompt are cached, but the last prompt token must still run "
        f"(its logits choose the first answer token), so the block holding it is computed again: "
        f"{blocks_a - 1} x {bs} = {reuse_c}.",
        mistakes=[
            (len(prompt_a), "The whole prompt is cached, but the model must still run on the last prompt token: "
             "its logits choose the first answer token. Nothing else produces them."),
            (len(prompt_a) - 1, "Right that the last token runs again, but reuse goes by whole blocks: the block "
             f"holding that token is computed again, all {bs} positions of it."),
            (blocks_a - 1, f"{blocks_a - 1} is the number of blocks; the question asks for tokens ({bs} per block)."),
            (blocks_a, "That counts blocks, and all of them; the question asks for tokens, and one block is computed again."),
        ],
        hints=[
            f"{len(prompt_a)} = {blocks_a} x {bs}: every block of C's prompt is in the cache. What must the model "
            "still compute before it can answer?",
            "The first answer token is chosen from the last prompt token's logits, so that token must run; "
            "and a block is reused whole or not at all.",
            f"{blocks_a - 1} blocks x {bs} = {reuse_c} tokens reused; the last block ({bs} tokens) is computed again.",
        ],
    )
    return b, c


REUSE_B, REUSE_C = _reuse_exercises()


def check_prefix_reuse(reused_b, reused_c) -> Feedback:
    """Exercise 06.4: prompt tokens B and C reuse from A's cached prompt (blocks of 16, prefix sharing)."""
    return check_parts(("B", REUSE_B, reused_b), ("C", REUSE_C, reused_c))
