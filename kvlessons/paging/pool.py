"""The K/V pools shared by every sequence, and one sequence's view of them as a cache (lesson 06).

``PagedKVCache`` holds one pool per cache layer, the keys and values of every block,
(2, kv_heads, num_blocks, block_size, head_dim) (the layout is explained in
``kvlessons.paging.attention``), or for a latent (MLA) model the one latent row of every
slot, (1, 1, num_blocks, block_size, latent_dim), on top of the block tables; ``view(seq_id)`` is a cache
with the course's interface, so the model runs on a paged sequence unchanged.
"""

from __future__ import annotations

import torch

from ..cache import KVCache, LayerCache, _check_kv
from ..shape import ModelShape
from .attention import gather_kv, slot_indices
from .blocks import BlockTables


class PagedKVCache(BlockTables):
    """One K/V pool per layer, (2, kv_heads, num_blocks, block_size, head_dim), shared by all sequences.

    Run the model on one sequence through ``view(seq_id)``, a cache with the
    foundation's interface: the model is unchanged.
    """

    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int = 16, dtype=torch.float32, device=None, prefix_sharing: bool = True):
        super().__init__(num_blocks, block_size, prefix_sharing)
        if any(shape.window(i) is not None for i in range(shape.layers)):
            raise ValueError("PagedKVCache stores full-attention layers (shape must have no windows)")
        self.shape = shape
        if shape.latent_dim is None:
            pool = (2, shape.kv_heads, num_blocks, block_size, shape.head_dim)  # K and V, head-major: see .attention
        else:
            pool = (1, 1, num_blocks, block_size, shape.latent_dim)  # keys only: one latent row per slot
        self.kv_pools = {i: torch.zeros(pool, dtype=dtype, device=device) for i in shape.cache_layers}

    def nbytes(self) -> int:
        """Bytes of the pools: all blocks, free or not (a serving system allocates the pool up front)."""
        return sum(p.nbytes for p in self.kv_pools.values())

    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer's pool (its keys and values)."""
        return self.nbytes() // self.allocator.num_blocks

    def _copy_block(self, src: int) -> int:
        dst = super()._copy_block(src)
        with torch.no_grad():  # copy-on-write: the new block starts as the shared one's copy, in every layer
            for pool in self.kv_pools.values():
                pool[:, :, dst] = pool[:, :, src]
        return dst

    def _check_write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Raise ValueError unless k, v (1, H_kv, T, D) fit ``layer``'s pools (v None: a latent pool's keys only)."""
        if layer not in self.kv_pools:
            raise ValueError(f"layer must be one of this pool's cache layers {sorted(self.kv_pools)}, got {layer}")
        _check_kv(k, v)
        parts, kv_heads, _, _, head_dim = self.kv_pools[layer].shape
        if (v is None) != (parts == 1):
            raise ValueError(f"v must be {'None: this pool stores latents only' if parts == 1 else 'a tensor: this pool stores K and V'}")
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
        pool = self.kv_pools[layer]
        parts, h, nb, bs, d = pool.shape
        idx = slot_indices(seq.table, seq.length + t, bs, pool.device)[seq.length :]
        slots = pool.view(parts, h, nb * bs, d)  # every head's slots in flat order: slot s of block b is b * bs + s
        with torch.no_grad():
            slots[0][:, idx] = k[0].to(pool)  # k[0]: (H_kv, T, D)
            if v is not None:
                slots[1][:, idx] = v[0].to(pool)

    def append(self, seq_id: int, keys, values=None, tokens=None) -> None:
        """Append K/V for every cache layer: ``keys[i]``, ``values[i]`` shaped (1, H_kv, T, D), in layer order.

        (``BlockTables.append(seq_id, n)`` counts positions without data; here the data is written.)
        Everything is checked before anything is reserved or written.
        """
        if isinstance(keys, int):  # the bookkeeping-only form
            return super().append(seq_id, keys, tokens)
        layers = list(self.kv_pools)
        if values is None and self.shape.latent_dim is not None:
            values = [None] * len(keys)  # a latent pool stores keys only
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

    def gather(self, layer: int, seq_id: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sequence's first ``seq_len`` keys and values in ``layer``, each (1, H_kv, seq_len, D) (values None in a latent pool)."""
        seq = self._seq(seq_id)
        return gather_kv(self.kv_pools[layer], seq.table, seq_len)

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
        return blocks * self.paged.bytes_per_block() // len(self.paged.kv_pools)

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
        self._layers = {i: _PagedLayer(paged, seq_id, i) for i in paged.kv_pools}
        self._pass_ids: list[int] | None = None  # the token ids of the forward pass in progress

    @property
    def seq_len(self):  # the block table is the truth: the sequence's written length
        return self.paged._seq(self.seq_id).length

    def new_layer(self, window=None):
        # Every layer the pool stores was made in __init__; any other index has no pool.
        raise ValueError(
            f"this PagedKVCache stores layers {sorted(self.paged.kv_pools)} (full attention); "
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
