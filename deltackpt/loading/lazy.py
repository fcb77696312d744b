"""Lazy access to one snapshot: ``deltackpt.open_snapshot``, as safetensors' ``safe_open``.

:class:`SnapshotReader` reads the manifest once (validated, as every load does) and then reads,
per request, only the chunks that request touches, through the same steps as :func:`load`: the
entry and the wanted region become chunk targets (:mod:`deltackpt.loading.plan`, saved shards
through :mod:`deltackpt.loading.reshard`), the read engine fills and verifies them
(:mod:`deltackpt.store.chunks`). Peak memory is the request plus reader buffers: a slice of the
leading dimension reads exactly its rows' chunks; a slice of a later dimension reads the rows
covering it (a saved shard's bytes are C-order rows), then keeps the asked part.

>>> with deltackpt.open_snapshot("ckpts") as f:                     # doctest: +SKIP
...     w = f.get_tensor("model/embed.weight")
...     rows = f.get_slice("model/lm_head.weight")[1000:2000]

A reader also loads its snapshot whole into existing tensors, or incrementally from a snapshot
they already hold (:meth:`SnapshotReader.load` with ``since=``, as ``deltackpt.load``), and says
which keys changed since another snapshot without reading any tensor bytes
(:meth:`SnapshotReader.changed_since`).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from deltackpt.errors import InvalidArgumentError, KeyNotInSnapshotError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.format.tree import unflatten, value_leaves
from deltackpt.loading import assemble
from deltackpt.loading.changed import changed_keys
from deltackpt.loading.plan import Reads, read_entry, storage_view
from deltackpt.loading.reshard import Alloc, Box
from deltackpt.loading.select import KeySelection, key_filter
from deltackpt.loading.since import catch_up
from deltackpt.loading.stats import LoadStats
from deltackpt.options import LoadOptions
from deltackpt.store.packs import PackReaders
from deltackpt.store.store import LATEST, Store, open_store


def open_snapshot(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    *,
    options: LoadOptions | None = None,
    **kwargs: Any,
) -> SnapshotReader:
    """Open snapshot ``name`` (default: the latest committed one) for reading tensors one at a
    time: ``keys()``, ``get_tensor(key)``, ``get_slice(key)[rows, cols]``, ``metadata`` and
    ``values``. Keyword options are those of :class:`LoadOptions` (``verify``, ``threads``,
    ``allow_pickle``). Use it as a context manager, or call ``close()``.

    Many tensors at once: ``get_tensors(keys)`` reads a chunk they share once (small tensors
    are grouped into shared chunks; ``get_tensor`` in a loop reads such a chunk per tensor).

    >>> with deltackpt.open_snapshot("ckpts", "step-100") as f:          # doctest: +SKIP
    ...     experts = f.get_tensors([k for k in f.keys() if ".experts.3." in k])
    """
    opts = LoadOptions.from_kwargs(options, kwargs)
    st = open_store(store, create=False)
    return SnapshotReader(st, st.manifest(name), opts)


class SnapshotReader:
    """One committed snapshot, read on demand (see :func:`open_snapshot`). Safe to use from
    several threads; each call returns new tensors that share no memory with the reader."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        options: LoadOptions,
        packs: PackReaders | None = None,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.options = options
        self._index = {e.path: i for i, e in enumerate(manifest.tensors)}
        # the pack files, opened on first use (``packs``: readers of the caller's, such as
        # ones that count the bytes read)
        self._packs = store.pack_readers() if packs is None else packs

    @property
    def name(self) -> str:
        """The snapshot's name (``"latest"`` resolved when it was opened)."""
        return self.manifest.name

    @property
    def metadata(self) -> dict[str, Any]:
        """The ``metadata=`` dict the snapshot was saved with."""
        return dict(self.manifest.metadata)

    @property
    def values(self) -> dict[str, Any]:
        """The snapshot's non-tensor values (step counters, lr, ...) by key path. A value saved
        pickled needs ``allow_pickle=True``."""
        return {
            path: unflatten(node, _no_tensor, self.options.allow_pickle, path)
            for path, node in value_leaves(self.manifest.tree)
        }

    def keys(self) -> list[str]:
        """The key paths of the snapshot's tensors, in save order (e.g. ``"model/l1.weight"``)."""
        return [e.path for e in self.manifest.tensors]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def entry(self, key: str) -> TensorEntry:
        """The manifest entry of tensor ``key``."""
        i = self._index.get(key)
        if i is None:
            near = [k for k in self._index if key.split("/")[-1] in k][:5]
            raise KeyNotInSnapshotError(
                f"snapshot {self.name!r} has no tensor {key!r}"
                + (f"; similar keys: {near}" if near else "")
                + ". See .keys() for the key paths it holds"
            )
        return self.manifest.tensors[i]

    def get_tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as a new CPU tensor, bit-exact; reads only its own chunks."""
        e = self.entry(key)
        r = Reads(self.manifest)
        t = read_entry(r, e)
        self._run(r)
        if e.storage is not None and t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # a view of a larger shared storage: keep only its own bytes
        return t

    def get_tensors(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Tensors ``keys`` as new CPU tensors, bit-exact, in one pass over their chunks: a
        chunk several of them share (small tensors are grouped) is read and checked once,
        where ``get_tensor`` in a loop reads it once per tensor."""
        entries = [(k, self.entry(k)) for k in keys]
        r = Reads(self.manifest)
        out = {k: read_entry(r, e) for k, e in entries}
        self._run(r)
        for k, e in entries:
            t = out[k]
            if e.storage is not None and t.untyped_storage().nbytes() != t.nbytes:
                out[k] = t.clone()  # a view of a larger shared storage: its own bytes only
        return out

    def get_slice(self, key: str) -> TensorSlice:
        """A handle on tensor ``key``: ``shape``, ``dtype``, and ``[...]`` reads a region."""
        return TensorSlice(self, self.entry(key))

    def read_box(self, e: TensorEntry, box: Box) -> torch.Tensor:
        """Box ``(offsets, shape)`` of entry ``e``'s tensor, as a new tensor."""
        return self.read_boxes([(e, box)])[0]

    def read_boxes(
        self,
        items: list[tuple[TensorEntry, Box]],
        into: list[torch.Tensor] | None = None,
        alloc: Alloc | None = None,
    ) -> list[torch.Tensor]:
        """``read_box`` of every ``(entry, box)`` in one pass over their chunks: a chunk several
        boxes need (small tensors share group chunks) is read and checked once. ``into``: host
        tensors of the boxes' shapes and dtypes to read into (written as the bytes arrive: a
        failed read leaves them partly written), one per item; ``alloc``: where the rows
        covering a box that is not whole rows are read first (default: new memory)."""
        r = Reads(self.manifest)
        outs: list[torch.Tensor] = []
        views: list[tuple[int, torch.Tensor, Box]] = []  # boxes of shared storages, cut after
        for i, (e, box) in enumerate(items):
            out = torch.empty(box[1], dtype=dtype_from_name(e.dtype)) if into is None else into[i]
            outs.append(out)
            if out.numel() == 0:
                continue
            if e.storage is not None:  # a view of a shared storage: its bytes are read whole
                views.append((len(outs) - 1, storage_view(e, r.storage(e.storage.id, e.path)), box))
            else:
                r.box(e, out, box, alloc)
        self._run(r)
        for i, view, box in views:
            for d, (o, n) in enumerate(zip(*box, strict=True)):
                view = view.narrow(d, o, n)
            outs[i].copy_(view)
        return outs

    def load(
        self,
        into: Any = None,
        *,
        since: str | None = None,
        keys: KeySelection = None,
        process_group: Any = None,
        stats: LoadStats | None = None,
    ) -> Any:
        """Load this snapshot as ``deltackpt.load(store, name, into=..., keys=...)`` does (same
        checks, same result), with this reader's options.

        ``since`` (with ``into``): ``into`` holds snapshot ``since``, and only what differs is
        read (an incremental load; unchanged chunks are not read, xor chunks whose chain reaches
        the held chunk are patched in place, the rest is read whole). It fails closed with
        :class:`~deltackpt.errors.HeldVersionMismatchError` before anything is written when
        ``into`` does not hold ``since``. With ``process_group`` every rank calls it (each with
        its own ``into``: plain tensors or DTensors of any placement); no rank writes unless
        every rank's checks passed. See ``deltackpt.load`` for the details.

        >>> with deltackpt.open_snapshot("ckpts") as f:                 # doctest: +SKIP
        ...     f.load(into=sd, since=held, stats=(st := deltackpt.LoadStats()))
        """
        if since is None:
            return assemble.load(
                self.store, self.name, into=into, options=self.options,
                process_group=process_group, keys=keys, stats=stats,
            )  # fmt: skip
        select = key_filter(keys)
        return catch_up(
            self.store, self.name, since, into, self.options, select, process_group, stats
        )

    def changed_since(self, held: str, keys: KeySelection = None) -> list[str]:
        """Key paths of this snapshot's tensors whose bytes may differ from snapshot ``held``'s
        (new keys included), from the two manifests only: a chunk list equal to ``held``'s means
        equal bytes. A small tensor grouped in one chunk with a changed one is listed too."""
        return changed_keys(self.manifest, self.store.manifest(held), key_filter(keys))

    def _run(self, r: Reads) -> None:
        o = self.options
        r.run(self._packs, o.verify, o.threads, "deltackpt-lazy")

    def close(self) -> None:
        """Close the pack files this reader opened (a closed reader reopens them on use)."""
        self._packs.close()

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SnapshotReader({self.name!r}, {len(self._index)} tensors)"


class TensorSlice:
    """``get_slice(key)``: the tensor's ``shape`` and ``dtype`` without reading it; indexing
    with ints and ``start:stop[:step]`` slices (and ``...``) reads only the region asked."""

    def __init__(self, reader: SnapshotReader, entry: TensorEntry) -> None:
        self.reader, self.entry = reader, entry

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.entry.dtype)

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        offsets, lengths, post = _parse_index(index, self.entry.shape, self.entry.path)
        region = self.reader.read_box(self.entry, (offsets, lengths))
        if not post:
            return region
        out = region[tuple(post)]
        return out.contiguous() if not out.is_contiguous() else out.clone()


def _parse_index(
    index: Any, shape: tuple[int, ...], key: str
) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    """(box offsets, box lengths, what to apply to the box) for ``tensor[index]``; the last is
    empty when the box is the answer as it is."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in idx):
        at = idx.index(Ellipsis)
        if Ellipsis in idx[at + 1 :]:
            raise InvalidArgumentError(f"slice of {key!r}: an index can hold one '...' only")
        fill = (slice(None),) * (len(shape) - len(idx) + 1)
        idx = idx[:at] + fill + idx[at + 1 :]
    if len(idx) > len(shape):
        raise InvalidArgumentError(
            f"slice of {key!r}: {len(idx)} indices for a tensor of shape {list(shape)}; use at "
            f"most {len(shape)}"
        )
    offsets, lengths, post, changed = [], [], [], False
    for d, n in enumerate(shape):
        ix = idx[d] if d < len(idx) else slice(None)
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step <= 0:
                raise InvalidArgumentError(
                    f"slice of {key!r}: step {ix.step} on dim {d}; only positive steps are "
                    "supported (flip the result instead)"
                )
            count = len(range(start, stop, step))
            span = (count - 1) * step + 1 if count else 0
            offsets.append(start if count else 0)
            lengths.append(span)
            post.append(slice(None, None, step))
            changed = changed or step != 1
        else:
            try:
                i = operator.index(ix)
            except TypeError:
                raise InvalidArgumentError(
                    f"slice of {key!r}: index {ix!r} on dim {d} is a {type(ix).__name__}; use "
                    "ints, start:stop[:step] slices and ..."
                ) from None
            if not -n <= i < n:
                raise IndexError(
                    f"slice of {key!r}: index {i} is out of range for dim {d} of size {n}"
                )
            offsets.append(i % n)
            lengths.append(1)
            post.append(0)
            changed = True
    return tuple(offsets), tuple(lengths), post if changed else []


def _no_tensor(i: int) -> torch.Tensor:
    raise AssertionError("unreachable: a value holds no tensor")
