"""The KV cache interface and its basic variants (lesson 01; every later lesson builds on it).

A cache is a container of per-layer objects plus one position counter:

    cache.layer(i).update(k, v) -> (k_all, v_all)   # store the new K/V, return everything held
    cache.seq_len                                    # positions processed so far
    with cache.transaction(ids):                     # one forward pass, all or nothing
        ...every layer updates...
        cache.advance(T)                             # once per forward pass, after the last layer
    cache.reset(), cache.crop(n), cache.nbytes()

Keys arrive already rotated (RoPE is applied before caching), shaped (B, H_kv, T, D).
Variants differ only in how a layer stores them: ``ConcatCache`` grows by ``torch.cat``,
``StaticCache`` preallocates and writes in place, and in either one a layer with a
sliding window (``cache.layer(i, window=W)``) is a :class:`SlidingWindowLayer` that keeps
only the newest W positions. ``kvlessons.fp4`` (quantized), ``kvlessons.paging`` (paged)
and ``kvlessons.crosslayer`` (layers that share a cache) build on the same interface.

**All or nothing.** A forward pass writes every layer before it advances the counter, so
an exception half way (Ctrl-C in a notebook, out of memory, a bad input reaching a later
layer) would leave the early layers one append ahead of ``seq_len``, and every later pass
would silently compute wrong logits. ``transaction`` prevents that: it snapshots each
layer before the pass and restores them all if anything raises. Snapshots are cheap
because most layers never write into a tensor they already hold (``torch.cat`` makes a new
one), so keeping references is enough; layers that write in place say how to undo it.
If even the restore is interrupted, the cache refuses further use until ``reset()``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .memory import measured_bytes
from .shape import require_positive_int


class CacheInterruptedError(RuntimeError):
    """A cache whose restore after a failed forward pass did not finish: only ``reset()`` is safe."""


def _check_kv(k: torch.Tensor, v: torch.Tensor | None, held: torch.Tensor | None = None, held_v=False) -> None:
    """k and v are (B, H_kv, T, D) alike, and match what a layer already ``held`` (but for T).

    ``v=None`` is a keys-only write (MLA's latent cache, :mod:`kvlessons.mla`): the layer
    stores one tensor per token, and a layer that holds keys only (``held_v`` is None)
    must stay so, as must one that holds both (``held_v`` a tensor). ``held_v=False``: not checked.
    """
    if k.dim() != 4:
        raise ValueError(f"k must be (batch, kv_heads, tokens, head_dim), got shape {tuple(k.shape)}")
    if v is not None:
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"k and v must share dtype and device, got {k.dtype}/{k.device} and {v.dtype}/{v.device}")
    if held is not None:
        if k.shape[:2] != held.shape[:2] or k.shape[3] != held.shape[3]:
            raise ValueError(
                f"new k {tuple(k.shape)} does not match the cached (batch, kv_heads, _, head_dim) {tuple(held.shape)}"
            )
        if k.dtype != held.dtype or k.device != held.device:
            raise ValueError(f"new k is {k.dtype} on {k.device}, the cache holds {held.dtype} on {held.device}")
        if held_v is not False and (held_v is None) != (v is None):
            stored = "keys only (a latent cache)" if held_v is None else "keys and values"
            raise ValueError(f"v must be {'None' if held_v is None else 'a tensor'}: this layer stores {stored}")


def _check_crop(length: int, held: int) -> None:
    require_positive_int("length", length, allow_zero=True)
    if length > held:
        raise ValueError(f"length must be <= seq_len ({held}), got {length}")


def _check_capacity(max_len: int, held: int, new_tokens: int) -> None:
    if held + new_tokens > max_len:
        raise ValueError(
            f"StaticCache is full: max_len={max_len}, holding {held}, cannot append {new_tokens} more"
        )


class LayerCache:
    """One layer's stored keys and values. Subclasses decide how they are stored.

    Every method that changes a layer validates first and writes after, so a call that
    raises ValueError leaves the layer as it was.
    """

    window: int | None = None  # sliding window in tokens; None keeps every position

    def __init__(self):
        self.seq_len = 0  # tokens appended to this layer; an explicit counter, never read off the data
        self.bytes_written = 0  # bytes of K/V memory written by updates (copies included)

    def update(self, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``k, v`` (B, H_kv, T, D) after what is held; return all held K and V.

        ``v=None`` stores keys only and returns (all keys, None): a latent (MLA) layer's
        one vector per token, whose first columns serve as its values (:mod:`kvlessons.mla`).
        """
        raise NotImplementedError

    @property
    def keys(self) -> torch.Tensor | None:
        """Held keys (B, H_kv, seq_len, D), or None when empty."""
        raise NotImplementedError

    @property
    def values(self) -> torch.Tensor | None:
        """Held values (B, H_kv, seq_len, D), or None when empty."""
        raise NotImplementedError

    def check_room(self, new_tokens: int) -> None:
        """Raise ValueError if ``new_tokens`` more cannot be stored. Unbounded by default."""

    def observe(self, q: torch.Tensor) -> None:
        """This pass's rotated queries, given just before ``update``. Ignored, except by layers that
        choose what to keep from attention (:mod:`kvlessons.eviction`)."""

    def check_crop(self, length: int) -> None:
        """Raise ValueError if this layer cannot be cropped to ``length`` (nothing is changed)."""
        _check_crop(length, self.seq_len)

    def nbytes(self) -> int:
        """Bytes of memory this layer holds: every tensor it keeps, measured, each storage once."""
        return measured_bytes(self)

    def reset(self) -> None:
        """Forget every stored token."""
        raise NotImplementedError

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (to rewind after an edit); 0 is a reset."""
        self.check_crop(length)
        if length == 0:
            self.reset()
        else:
            self._keep_first(length)
            self.seq_len = length

    def _keep_first(self, length: int) -> None:
        """Drop every stored token after the first ``length`` (0 < length <= seq_len, already checked)."""
        raise NotImplementedError

    # -- undo, for the cache's transactions --------------------------------------------------------

    def snapshot(self) -> dict:
        """What :meth:`restore` needs to undo the changes that follow.

        References and counters only: right for any layer that never writes into a
        tensor it already holds (it replaces tensors instead). A layer that writes in
        place where a reader can see it overrides this and :meth:`restore`.
        """
        return {name: list(value) if isinstance(value, list) else value for name, value in vars(self).items()}

    def restore(self, state: dict) -> None:
        """Return to the state :meth:`snapshot` recorded."""
        vars(self).clear()
        vars(self).update(state)

    def commit(self) -> None:
        """The changes since the last :meth:`snapshot` stand: drop whatever was kept to undo them."""


class HeldTensorsLayer(LayerCache):
    """A layer whose held keys and values are exactly its tensors ``_k`` and ``_v`` (None while empty)."""

    _k: torch.Tensor | None = None
    _v: torch.Tensor | None = None

    @property
    def keys(self):
        return self._k

    @property
    def values(self):
        return self._v


class ConcatLayer(HeldTensorsLayer):
    """Grows by ``torch.cat``: simple, and it copies the whole layer on every append."""

    def __init__(self):
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, k, v):
        _check_kv(k, v, self._k, self._v)
        # clone the first write: k may be a view that pins a larger tensor (and the caller may reuse it)
        new_k = k.clone() if self._k is None else torch.cat([self._k, k], dim=2)
        new_v = None if v is None else v.clone() if self._v is None else torch.cat([self._v, v], dim=2)
        self._k, self._v = new_k, new_v  # replaced, never written into: a snapshot can keep the old ones
        self.bytes_written += new_k.nbytes + (0 if new_v is None else new_v.nbytes)  # cat writes the whole new tensor
        self.seq_len += k.shape[2]
        return self._k, self._v

    def reset(self):
        self._k = self._v = None
        self.seq_len = 0

    def _keep_first(self, length):
        # clone: a slice would keep the whole old tensor alive behind a smaller view
        self._k = self._k[:, :, :length].clone()
        self._v = None if self._v is None else self._v[:, :, :length].clone()


class StaticLayer(LayerCache):
    """A buffer of ``max_len`` positions, allocated on the first write and written in place.

    Only positions below ``seq_len`` are ever read, so rewinding (``crop``, ``reset``, or
    undoing a failed pass) just moves the counter back: the next write overwrites what
    lies beyond it. That is also why the default snapshot (the counter and references)
    can undo a pass: the pass wrote only at positions the restored counter hides again.
    """

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = require_positive_int("max_len", max_len)
        self._k: torch.Tensor | None = None  # (B, H_kv, max_len, D)
        self._v: torch.Tensor | None = None

    def check_room(self, new_tokens):
        _check_capacity(self.max_len, self.seq_len, new_tokens)

    def update(self, k, v):
        _check_kv(k, v, self._k, self._v)
        t = k.shape[2]
        self.check_room(t)
        if self._k is None:
            b, h, _, d = k.shape
            # A normal (not inference-mode) tensor, so later writes work whether or not the
            # caller is inside torch.inference_mode().
            with torch.inference_mode(False):
                self._k = torch.zeros(b, h, self.max_len, d, dtype=k.dtype, device=k.device)
                self._v = None if v is None else torch.zeros(b, h, self.max_len, d, dtype=v.dtype, device=v.device)
        start = self.seq_len
        with torch.no_grad():  # the cache stores values, it is not part of a training graph
            self._k[:, :, start : start + t] = k
            if v is not None:
                self._v[:, :, start : start + t] = v
        self.bytes_written += k.nbytes + (0 if v is None else v.nbytes)  # only the new positions
        self.seq_len += t
        return self.keys, self.values

    @property
    def keys(self):
        return None if self._k is None or self.seq_len == 0 else self._k[:, :, : self.seq_len]

    @property
    def values(self):
        return None if self._v is None or self.seq_len == 0 else self._v[:, :, : self.seq_len]

    def reset(self):
        self.seq_len = 0  # keep the buffer: that is the point of preallocating

    def _keep_first(self, length):
        pass  # positions from `length` on become unreadable once seq_len says so; the next write overwrites them


class SlidingWindowLayer(LayerCache):
    """Keeps only the newest ``window`` positions, in a ring: position p lives in slot p % window.

    ``update`` returns the held positions followed by the new ones (T new queries need up
    to window - 1 earlier keys each); the attention mask applies the window. With
    ``preallocate`` the ring is allocated full-size on the first write (a static cache,
    which then also refuses to hold more than ``max_len`` positions in all); otherwise it
    grows with the sequence until it reaches the window, then wraps in place.
    """

    def __init__(self, window: int, preallocate: bool = False, max_len: int | None = None):
        super().__init__()
        self.window = require_positive_int("window", window)
        self.preallocate = preallocate
        self.max_len = None if max_len is None else require_positive_int("max_len", max_len)
        # A static cache never holds more than max_len positions, so never needs more slots.
        self._slots = window if max_len is None else min(window, max_len)
        self._first = 0  # oldest position still held; an explicit counter like seq_len
        self._k: torch.Tensor | None = None  # (B, H_kv, slots, D)
        self._v: torch.Tensor | None = None
        self._undo: list | None = None  # while a transaction is open: the ring rows it overwrote

    @property
    def held(self) -> int:
        """Positions currently stored (the window once it has filled)."""
        return self.seq_len - self._first

    def _ordered(self, buf: torch.Tensor | None) -> torch.Tensor | None:
        if buf is None or self.held == 0:
            return None
        if self.seq_len <= self.window:  # not wrapped: slot = position
            return buf[:, :, self._first : self.seq_len]
        slots = torch.arange(self._first, self.seq_len, device=buf.device) % self.window
        return buf.index_select(2, slots)

    @property
    def keys(self):
        return self._ordered(self._k)

    @property
    def values(self):
        return self._ordered(self._v)

    def check_room(self, new_tokens):
        if self.max_len is not None:
            _check_capacity(self.max_len, self.seq_len, new_tokens)

    def _write(self, first_position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store positions first_position .. first_position + T - 1 (the newest window of them)."""
        end = first_position + k.shape[2]
        b, h, _, d = k.shape
        want = self._slots if self.preallocate else min(end, self._slots)
        have = 0 if self._k is None else self._k.shape[2]
        if want > have:  # a new, larger ring: the old one is replaced, not written into
            with torch.inference_mode(False):  # a normal tensor, writable outside inference mode too
                grown_k = torch.zeros(b, h, want, d, dtype=k.dtype, device=k.device)
                grown_v = torch.zeros(b, h, want, d, dtype=v.dtype, device=v.device)
            if have:
                grown_k[:, :, :have] = self._k
                grown_v[:, :, :have] = self._v
            self._k, self._v = grown_k, grown_v
        keep = min(k.shape[2], self.window)
        slots = torch.arange(end - keep, end, device=k.device) % self.window
        if self._undo is not None:  # a transaction is open: remember what the ring held there
            self._undo.append((self._k, self._v, slots, self._k.index_select(2, slots), self._v.index_select(2, slots)))
        with torch.no_grad():
            self._k.index_copy_(2, slots, k[:, :, -keep:])
            self._v.index_copy_(2, slots, v[:, :, -keep:])
        self._first = max(self._first, end - self.window)

    def update(self, k, v):
        if v is None:
            raise ValueError("v must be a tensor: a sliding-window layer stores keys and values (no latent caches)")
        old_k, old_v = self.keys, self.values
        _check_kv(k, v, self._k)
        self.check_room(k.shape[2])
        k_all = k if old_k is None else torch.cat([old_k, k], dim=2)
        v_all = v if old_v is None else torch.cat([old_v, v], dim=2)
        self._write(self.seq_len, k, v)
        self.seq_len += k.shape[2]
        return k_all, v_all

    def reset(self):
        if not self.preallocate:
            self._k = self._v = None
        self.seq_len = self._first = 0

    def check_crop(self, length):
        _check_crop(length, self.seq_len)
        needed = max(0, length - self.window + 1)  # oldest key the next query (at `length`) can see
        if needed < length and self._first > needed:
            raise ValueError(
                f"cannot crop a sliding-window layer to length {length}: the next query needs position "
                f"{needed}, but positions before {self._first} were already dropped"
            )

    def _keep_first(self, length):
        keep_from = min(length, max(self._first, length - self.window))  # the newest window before `length`
        k = v = None
        if keep_from < length:
            lo, hi = keep_from - self._first, length - self._first
            k, v = self.keys[:, :, lo:hi].clone(), self.values[:, :, lo:hi].clone()
        # Rebuild into fresh tensors (the held ones are replaced, not written into), so an
        # interrupted crop leaves the old ring intact for the cache to restore.
        self._k = self._v = None
        self._first = self.seq_len = keep_from
        if k is not None:
            self._write(keep_from, k, v)
        self._first = keep_from

    def snapshot(self):
        state = super().snapshot()
        self._undo = []  # from now on _write records the ring rows it overwrites
        return state

    def restore(self, state):
        for buf_k, buf_v, slots, old_k, old_v in reversed(self._undo or []):
            if buf_k is state["_k"]:  # written into the ring the snapshot holds: put the old rows back
                with torch.no_grad():
                    buf_k.index_copy_(2, slots, old_k)
                    buf_v.index_copy_(2, slots, old_v)
        super().restore(state)

    def commit(self):
        self._undo = None


class KVCache:
    """Per-layer caches, created on first use, and the one position counter ``seq_len``."""

    supports_padding = True  # left-padded batches (a pad_mask) work: the held keys are the newest positions, in order

    def __init__(self):
        self._layers: dict[int, LayerCache] = {}
        self._seq_len = 0  # positions processed: the one position counter (see seq_len)
        self._interrupted: str | None = None  # why a restore could not finish, until reset()
        self._open = False  # a transaction is running

    @property
    def seq_len(self) -> int:
        """Positions processed so far: the next token's position. Changed only by advance, crop and reset."""
        return self._seq_len

    def new_layer(self, window: int | None = None) -> LayerCache:
        """Return a fresh, empty layer object of this cache's kind (sliding if ``window`` is set)."""
        raise NotImplementedError

    def layer(self, index: int, window: int | None = None) -> LayerCache:
        """Return the object layer ``index`` reads and writes, created on first use.

        ``window`` is the layer's sliding window (None: full attention); asking again
        with a different window is an error, since the stored layer could not serve it.
        """
        require_positive_int("index", index, allow_zero=True)
        if window is not None:
            require_positive_int("window", window)
        if index not in self._layers:
            self._layers[index] = self.new_layer(window)
        layer = self._layers[index]
        if layer.window != window:
            raise ValueError(f"layer {index} was created with window={layer.window}, asked for window={window}")
        return layer

    def layers(self) -> list[LayerCache]:
        """Distinct layer objects created so far, in layer order."""
        seen, out = set(), []
        for i in sorted(self._layers):
            obj = self._layers[i]
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
        return out

    def check_room(self, new_tokens: int) -> None:
        """Raise ValueError, changing nothing, if ``new_tokens`` cannot be appended."""
        require_positive_int("new_tokens", new_tokens)

    def advance(self, new_tokens: int) -> None:
        """Move the position counter past a forward pass of ``new_tokens`` tokens."""
        require_positive_int("new_tokens", new_tokens)
        self._seq_len += new_tokens

    def nbytes(self) -> int:
        """Bytes of memory held for K and V, summed over layers (each layer measures its tensors)."""
        return sum(layer.nbytes() for layer in self.layers())

    def bytes_written(self) -> int:
        """Bytes of K/V memory written so far by all layers (a concatenating cache rewrites everything)."""
        return sum(layer.bytes_written for layer in self.layers())

    # -- all or nothing ------------------------------------------------------------------------------

    @contextmanager
    def transaction(self, ids: torch.Tensor):
        """Run one forward pass over ``ids`` (B, T) all or nothing.

        Refuses (ValueError) before anything is written if T more tokens do not fit. If
        the body raises anything, Ctrl-C included, every layer and ``seq_len`` return to
        what they were, and the exception propagates::

            with cache.transaction(ids):
                ...                          # every layer: cache.layer(i).update(k, v)
                cache.advance(ids.shape[1])
        """
        self._check_usable()
        self.check_room(ids.shape[-1])
        with self.atomic():
            self._prepare(ids)
            yield self

    def _prepare(self, ids: torch.Tensor) -> None:
        """Called inside the transaction, before the layers write (a paged view reserves blocks here)."""

    def _check_usable(self) -> None:
        if self._interrupted is not None:
            raise CacheInterruptedError(
                f"this cache was interrupted while undoing a failed forward pass ({self._interrupted}), so its "
                f"layers may disagree with each other. Call cache.reset() (or make a new cache) to use it again."
            )

    @contextmanager
    def atomic(self):
        """Make everything in the ``with`` body one all-or-nothing change of this cache.

        Snapshots every layer; if the body raises (Ctrl-C included), restores them all and
        ``seq_len``, then re-raises. ``transaction`` uses it for one forward pass;
        ``generate`` wraps a whole generation in it, so an interrupted generation leaves
        the cache as it was before the call, not holding the steps that had finished.
        Inside an open ``atomic`` block, a nested one adds nothing: the outer snapshot covers it.
        """
        if self._open:  # inside an outer transaction: its snapshot already covers this change
            yield
            return
        state = self._snapshot()
        self._open = True
        try:
            yield
        except BaseException as failure:
            try:
                self._restore(state)
            except BaseException as err:  # e.g. a second Ctrl-C while restoring
                self._interrupted = f"{type(failure).__name__}, then {type(err).__name__} during the restore"
                raise
            raise
        finally:
            self._open = False
        self._commit()

    def _snapshot(self):
        """The counter, the layer objects, and each layer's own snapshot."""
        return self._seq_len, dict(self._layers), [(layer, layer.snapshot()) for layer in self.layers()]

    def _restore(self, state) -> None:
        seq_len, layers, layer_states = state
        for layer, layer_state in layer_states:
            layer.restore(layer_state)
        self._layers = dict(layers)  # layers first created by the failed pass are dropped
        self._seq_len = seq_len

    def _commit(self) -> None:
        for layer in self.layers():
            layer.commit()

    # -- rewinding ----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty every layer and restart positions at 0: afterwards the cache behaves as a new one."""
        self._interrupted = None  # the one way back from an interrupted restore
        with self.atomic():
            for layer in self.layers():
                layer.reset()
            self._seq_len = 0

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions, e.g. before re-running an edited suffix.

        Every layer is checked before any is changed, so a crop one layer cannot do
        (a sliding window that already dropped what the next query needs) changes nothing.
        """
        self._check_usable()
        _check_crop(length, self.seq_len)
        for layer in self.layers():
            layer.check_crop(length)
        with self.atomic():
            for layer in self.layers():
                layer.crop(length)
            self._seq_len = length

    def __repr__(self):
        return f"{type(self).__name__}(seq_len={self.seq_len}, layers={len(self._layers)}, nbytes={self.nbytes()})"


class ConcatCache(KVCache):
    """Grows with ``torch.cat``, as textbook code does. Unbounded; every append copies."""

    def new_layer(self, window=None):
        return ConcatLayer() if window is None else SlidingWindowLayer(window)


class StaticCache(KVCache):
    """Preallocates ``max_len`` positions per layer and writes in place; refuses to overflow."""

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = require_positive_int("max_len", max_len)

    def new_layer(self, window=None):
        if window is None:
            return StaticLayer(self.max_len)
        return SlidingWindowLayer(window, preallocate=True, max_len=self.max_len)

    def check_room(self, new_tokens):
        super().check_room(new_tokens)
        _check_capacity(self.max_len, self.seq_len, new_tokens)

    def __repr__(self):
        return f"StaticCache(max_len={self.max_len}, seq_len={self.seq_len}, nbytes={self.nbytes()})"
