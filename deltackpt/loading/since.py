"""``load(into=..., since=held)``: catch up from the snapshot ``into`` holds to another one.

Why: a follower (an evaluation worker, an inference engine, a restarted rollout worker) holds
snapshot ``held`` and wants a later one; most of the state is unchanged, and the store keeps
changed chunks as deltas against the previous save. Each chunk the target puts into ``into`` is:

* **unchanged**: ``held`` has the same chunk at the same bytes of the same key: not read;
* **patched**: a delta chunk (xor or patch) whose chain reaches the chunk ``held`` has there:
  only the payloads above it are read and applied to the bytes ``into`` holds;
* **read**: anything else, read whole (decoded down its chain) as a plain load reads it. So are
  the entries this cannot address byte by byte: views of a shared storage (tied weights), saved
  shards other than row blocks (:func:`rows_as_data`: the ``Shard(0)`` blocks of FSDP2 ranks
  are addressed as the whole tensor they tile), and targets whose bytes are not one contiguous
  CPU range of the tensor (DTensors sharded on another dimension than the first).

A whole contiguous tensor in GPU memory, or a DTensor whose local piece there is whole leading
rows, skips the chunks ``held`` has at the same bytes, as a CPU target does, and reads each other
chunk whole (its bytes are not on the host to patch), the part in its bytes staged in host
memory and copied in at the commit through two reused pinned buffers (with ``verify="full"`` it
is read whole).

A DTensor whose local piece is a contiguous CPU tensor of whole leading rows (``Shard(0)``,
``Replicate``: what FSDP2 holds) is a *window* of the tensor's bytes: chunks inside it are
skipped or patched, chunks outside it are not read, the (<= 2) straddling ones read and clipped.

Fail closed, at the cost of the change. :func:`prepare` rebuilds from ``into``'s bytes every
chunk of ``held`` that a patched chunk starts from, decodes the patches and checks each result;
the read engine verifies what it reads; all new bytes are staged, and last the chains of
``patch`` payloads on chunks ``into`` holds as one tensor's bytes are applied in place
(:mod:`deltackpt.loading.inplace`: only the changed elements written, old ones kept, all undone on
any failure or by :meth:`CatchUp.abort`). :meth:`CatchUp.commit` then only copies. So a failure
leaves ``into`` as it was; the price is staging memory the size of the changed chunks that are
decoded (a raw chunk of a local store is not staged: it is verified where it lies in the mapped
pack, which is never written in place, and copied from there at the commit).

What is checked (``verify``, docs/loading.md):

* ``True`` (default): a chunk patched in place is checked by its *linear digest*
  (:mod:`deltackpt.format.lindigest`), updated from the held chunk's by the words the patch
  rewrites (work in proportion to the change; a patch that rewrites more than
  1/:data:`~deltackpt.loading.inplace.LIN_WORD_COST` of the words: hashed whole, which is cheaper
  there and checks every byte); a chunk decoded into fresh memory (xor, or a
  patch on a chunk ``into`` holds in pieces) is hashed whole; a chunk without a linear digest
  (written by a save that wrote no deltas) too. Detected: a corrupt payload, and ``into``
  differing from ``held`` where a patch writes (:class:`HeldVersionMismatchError`, told apart by
  hashing the held bytes once the result failed). Not detected: ``into`` differing from
  ``held`` in bytes no patch touches (a flipped bit elsewhere, an ``into`` that holds another
  version there): those bytes are kept as they are.
* ``"full"``: first hashes every chunk of ``into`` the catch-up relies on (unchanged and patch
  bases) against ``held``'s digests, and every patched result whole: two passes over the state,
  detecting any byte of ``into`` that differs from ``held``.
* ``False``: as ``True`` for patched chunks; what is read whole is not re-hashed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from typing import Any, TypeVar

import numpy as np
import torch

from deltackpt.cuda import is_device
from deltackpt.errors import (
    CodecError,
    CorruptChunkError,
    DeltackptError,
    HeldVersionMismatchError,
    InvalidArgumentError,
)
from deltackpt.format import codecs
from deltackpt.format.dcp_nesting import nested_manifest
from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.format.tree import flatten
from deltackpt.loading import inplace
from deltackpt.loading.assemble import _agree, _assign_values, _check_into, _retrying
from deltackpt.loading.plan import Reads, copy_into, np_bytes, plain_cpu, read_entry
from deltackpt.loading.select import Select
from deltackpt.loading.stats import LoadStats, pack_readers
from deltackpt.loading.to_device import box_entry, copy_through
from deltackpt.options import LoadOptions, default_device_scan
from deltackpt.store.chunks import ChunkReader
from deltackpt.store.store import Store, open_store

Ref = tuple[str, int, int, int]  # (key path, byte offset in the tensor, start in chunk, length)
_T = TypeVar("_T")
_U = TypeVar("_U")


@dataclass
class HeldIndex:
    """Where snapshot ``held`` keeps which chunk: by (key path, byte offset in the tensor), and
    per chunk every place ``held`` uses it (what rebuilding it from ``into`` needs)."""

    at: dict[tuple[str, int], tuple[str, int, int]]
    refs: dict[str, list[Ref]]
    opaque: set[str]  # chunks held also uses in shared storages or saved shards

    @staticmethod
    def of(h: Manifest) -> HeldIndex:
        at: dict[tuple[str, int], tuple[str, int, int]] = {}
        refs: dict[str, list[Ref]] = {}
        opaque: set[str] = set()
        for e in h.tensors:
            if e.data is None:  # shards; a storage view's bytes are in h.storages
                opaque.update(d for d, _, _ in e.all_slices())
                continue
            pos = 0
            for d, s, n in e.data:
                at[(e.path, pos)] = (d, s, n)
                refs.setdefault(d, []).append((e.path, pos, s, n))
                pos += n
        for _, data in h.storages:
            opaque.update(d for d, _, _ in data)
        return HeldIndex(at, refs, opaque)


@dataclass
class CatchUp:
    """One prepared incremental load: new bytes staged, and where each goes in ``into``."""

    mem: dict[str, np.ndarray]  # into's bytes by key path (contiguous CPU targets)
    lo: dict[str, int] = field(default_factory=dict)  # where mem[path] starts in its tensor
    # digest -> new raw bytes: staged, or a view of a mapped local pack (verified)
    chunks: dict[str, np.ndarray] = field(default_factory=dict)
    refs: dict[str, list[Ref]] = field(default_factory=dict)  # digest -> its places in into
    copies: list[tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=list)
    # changed runs of device tensors' bytes: (their range of the tensor, staged on the host)
    device_runs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    in_place: list[inplace.InPlace] = field(default_factory=list)  # applied; abort() undoes
    threads: int = 1  # the commit's copies

    def abort(self) -> None:  # undo the in-place patches (another rank failed, say)
        inplace.revert_all(self.in_place)

    def commit(self) -> None:
        """Copy the staged bytes into ``into`` (memory copies only: nothing left can fail on
        CPU targets; a GPU target's ``copy_`` is the one step that still could)."""

        def put(item: tuple[str, np.ndarray]) -> None:
            d, new = item
            for p, pos, s, n in self.refs[d]:
                lo, mem = self.lo.get(p, 0), self.mem[p]
                a, b = max(pos, lo), min(pos + n, lo + mem.size)  # clipped to into's window
                if a < b:
                    mem[a - lo : b - lo] = new[s + a - pos : s + b - pos]

        _each(put, list(self.chunks.items()), self.threads)  # numpy copies drop the GIL
        with torch.no_grad():
            for dst, t, path in self.copies:
                copy_into(dst, t, path)
            copy_through(self.device_runs)  # through two pinned buckets, one wait


def held_bytes(
    h: Manifest, leaves: dict[str, torch.Tensor], forced: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The bytes ``into`` holds of each of ``h``'s entries, by key path, and where they start in
    the tensor: a contiguous CPU tensor of the entry's dtype and shape holds all of them (start
    0), a DTensor of whole leading rows (see the module) a window (whatever is selected for
    loading: a chunk of small tensors is rebuilt from all of them). ``forced``: CPU tensors and
    DTensors stand in for device ones (``DELTACKPT_DEVICE_SCAN=always``, the CPU suite), whose
    bytes are not here."""
    out: dict[str, np.ndarray] = {}
    lo: dict[str, int] = {}
    for e in h.tensors:
        t = leaves.get(e.path)
        if (
            e.data is not None
            and isinstance(t, torch.Tensor)
            and tuple(t.shape) == e.shape
            and t.dtype == dtype_from_name(e.dtype)
            and not (forced and (plain_cpu(t) or is_dtensor(t)))
            and (win := _window(t, e)) is not None
        ):
            out[e.path], lo[e.path] = win
    return out, lo


def _local_bytes(t: torch.Tensor, e: TensorEntry) -> tuple[torch.Tensor, int] | None:
    """``t``'s bytes of entry ``e`` (flat uint8, on whatever device ``t`` is) and their byte
    offset in the tensor, where they are one contiguous range of it: a contiguous tensor (offset
    0), or a DTensor whose local piece is whole leading rows; else None."""
    local, lo = t, 0
    if is_dtensor(t):
        local = local_tensor(t)
        try:
            off, shape = local_box(t, e.path)
        except DeltackptError:  # a Partial placement: checked (and refused) elsewhere
            return None
        if not e.shape or any(off[1:]) or tuple(shape[1:]) != e.shape[1:]:
            return None  # not whole rows: its bytes are strided in the tensor's
        lo = off[0] * local.element_size() * math.prod(e.shape[1:])
    if local.is_meta or local.is_conj() or local.is_neg():
        return None
    if not local.is_contiguous() or not local.numel():
        return None
    return local.detach().reshape(-1).view(torch.uint8), lo


def _window(t: torch.Tensor, e: TensorEntry) -> tuple[np.ndarray, int] | None:
    """``t``'s bytes of entry ``e`` and their byte offset in the tensor, or None when they are
    not one contiguous CPU range of it."""
    got = _local_bytes(t, e)
    if got is None or got[0].device.type != "cpu":
        return None
    return np_bytes(got[0]), got[1]


class _Planner:
    """Sorts the target snapshot's chunks into unchanged / patched / read (see the module)."""

    def __init__(self, h: Manifest, mem: dict[str, np.ndarray], lo: dict[str, int]) -> None:
        self.h, self.mem, self.lo, self.index = h, mem, lo, HeldIndex.of(h)
        self._rebuildable: dict[str, bool] = {}

    def rebuildable(self, b: str) -> bool:
        """``held``'s chunk ``b`` can be rebuilt from ``into``: every place ``held`` uses it is in
        the bytes ``into`` holds (``mem``), and those places are disjoint ranges of the chunk (or the same
        range twice: identical tensors) -- the rest of a group chunk is zero padding."""
        ok = self._rebuildable.get(b)
        if ok is None:
            refs = self.index.refs.get(b)
            ok = bool(refs) and b not in self.index.opaque and b in self.h.chunks
            if ok and refs:
                ok = all(self.holds(p, pos, n) for p, pos, _, n in refs)
                end = 0
                for s, n in sorted({(s, n) for _, _, s, n in refs}):
                    ok = ok and s >= end
                    end = s + n
            self._rebuildable[b] = ok
        return ok

    def holds(self, p: str, pos: int, n: int) -> bool:
        """``into`` holds bytes ``[pos, pos + n)`` of the tensor at key ``p``."""
        lo = self.lo.get(p, 0)
        return p in self.mem and lo <= pos and pos + n <= lo + self.mem[p].size

    def placed(self, b: str, refs: list[Ref]) -> bool:
        """``into`` holds ``held``'s chunk ``b`` exactly where the target wants ``refs``."""
        at = self.index.at
        return self.rebuildable(b) and all(at.get((p, pos)) == (b, s, n) for p, pos, s, n in refs)

    def base_in_chain(self, m: Manifest, d: str, refs: list[Ref]) -> tuple[str, list[str]] | None:
        """For an xor chunk ``d``: the first chunk down its chain that ``into`` holds in place,
        and the chain members above it (``d`` first); None when the chain never reaches one."""
        above, cur = [d], m.chunks[d]
        while cur.base is not None and len(above) <= 64:  # validated: chains end within 64
            if self.placed(cur.base, refs):
                return cur.base, above
            above.append(cur.base)
            cur = m.chunks[cur.base]
        return None

    def rebuild(self, b: str) -> tuple[np.ndarray, str | None]:
        """``held``'s chunk ``b`` as ``into`` holds it, and the key of a duplicate place whose
        bytes disagree with the first (None: consistent)."""
        refs, size = self.index.refs[b], self.h.chunks[b].size
        if len(refs) == 1 and refs[0][2] == 0 and refs[0][3] == size:
            p, pos, _, n = refs[0]
            at = pos - self.lo.get(p, 0)
            return self.mem[p][at : at + n], None  # one tensor's bytes: no copy
        buf = np.zeros(size, dtype=np.uint8)  # group chunks: gaps are zero (format.md)
        placed: set[tuple[int, int]] = set()
        for p, pos, s, n in refs:
            at = pos - self.lo.get(p, 0)
            src = self.mem[p][at : at + n]
            if (s, n) in placed:
                if not np.array_equal(buf[s : s + n], src):
                    return buf, p
            else:
                buf[s : s + n] = src
                placed.add((s, n))
        return buf, None


def _each(fn: Callable[[_T], _U], items: list[_T], threads: int) -> list[_U]:
    """``fn`` over ``items`` on up to ``threads`` threads (hashing and zstd release the GIL)."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="deltackpt-since") as ex:
        return list(ex.map(fn, items))


def _device_parts(
    e: TensorEntry, dst: torch.Tensor, was: TensorEntry | None, held: HeldIndex, forced: bool
) -> tuple[int, list[tuple[int, tuple[Slice, ...]]], torch.Tensor] | None:
    """For a whole tensor in device memory, or a DTensor whose local piece there is whole
    leading rows (a window of the tensor's bytes; ``forced``: CPU tensors standing in for device
    ones): how many of the chunks in its bytes ``held`` has at the same place (not read: into
    holds them), the runs of the others as (byte offset in the local bytes, the slices of the
    saved bytes that go there), read and copied in, and the local bytes (flat uint8). ``was``:
    held's entry at that key. None for any other target (read whole)."""
    got = _local_bytes(dst, e)
    if e.data is None or got is None:
        return None
    u8, lo = got
    if not (is_device(u8) or (forced and u8.device.type == "cpu")):
        return None
    if was is None or was.shape != e.shape or was.dtype != e.dtype:
        return None  # held has another tensor there: nothing of it can be relied on
    hi = lo + u8.numel()
    same, runs = 0, []
    run: list[Slice] = []
    start = end = pos = 0
    for d, s, n in e.data:
        a, b = max(pos, lo), min(pos + n, hi)
        if a < b:  # a chunk of the bytes this rank holds (clipped at the window's edges)
            if held.at.get((e.path, pos)) == (d, s, n):
                same += 1
            else:
                if not run or a != end:
                    if run:
                        runs.append((start - lo, tuple(run)))
                    run, start = [], a
                run.append((d, s + a - pos, b - a))
                end = b
        pos += n
    if run:
        runs.append((start - lo, tuple(run)))
    return same, runs, u8


def _stage_entry(r: Reads, e: TensorEntry, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan a whole entry's read into fresh memory: (where it goes, what will hold it)."""
    if is_dtensor(dst) and e.storage is None:  # only this rank's box of the saved pieces
        local = local_tensor(dst)
        buf = torch.empty(local.shape, dtype=local.dtype)
        r.box(e, buf, local_box(dst, e.path))
        return local, buf
    return dst, read_entry(r, e)


def prepare(
    st: Store,
    m: Manifest,
    h: Manifest,
    wanted: list[int],
    targets: dict[str, torch.Tensor],
    leaves: dict[str, torch.Tensor],
    opts: LoadOptions,
    stats: LoadStats | None = None,
) -> CatchUp:
    """Stage the catch-up of ``into`` from snapshot ``h`` to ``m`` without writing into it.

    ``wanted`` indexes the entries of ``m`` to load, ``targets`` their tensors in ``into`` by key
    path (already checked for shape and dtype); ``leaves`` are all of ``into``'s tensors, whose
    bytes rebuild ``h``'s chunks."""
    stats = stats if stats is not None else LoadStats()
    forced = default_device_scan() == "always"
    up = CatchUp(*held_bytes(h, leaves, forced), threads=opts.threads)
    plan = _Planner(h, up.mem, up.lo)
    want: dict[str, list[Ref]] = {}  # target chunk -> its places in contiguous CPU targets
    whole: list[int] = []
    for i in wanted:
        e = m.tensors[i]
        if e.data is None or e.path not in up.mem:  # read whole, copied in at commit
            whole.append(i)
            continue
        lo = up.lo.get(e.path, 0)
        hi = lo + up.mem[e.path].size
        pos = 0
        for d, s, n in e.data:
            if pos < hi and pos + n > lo:  # a chunk of the bytes this rank holds
                want.setdefault(d, []).append((e.path, pos, s, n))
            pos += n
    up.refs = want

    unchanged: list[str] = []
    patches: list[tuple[str, str, list[str]]] = []  # (target chunk, held base, chain above it)
    read: list[str] = []
    for d, refs in want.items():
        if plan.placed(d, refs):
            unchanged.append(d)
        elif m.chunks[d].codec in codecs.DELTAS and (found := plan.base_in_chain(m, d, refs)):
            patches.append((d, *found))
        else:
            read.append(d)

    # 1. into holds held wherever we rely on it. verify="full" hashes all of it before anything
    # is read or written. By default only what the catch-up touches is checked: each patched
    # result (by its linear digest where the save recorded one, else whole) fails if into's
    # bytes differ from held's where the patch writes (module doc: what each mode detects)
    full = opts.verify == "full"
    check = sorted({b for _, b, _ in patches} | set(unchanged)) if full else []

    def held_error(b: str, actual: str, odd: str | None = None) -> HeldVersionMismatchError:
        keys = sorted({p for p, _, _, _ in plan.index.refs[b]})
        key = odd or keys[0]
        return HeldVersionMismatchError(
            f"load({m.name!r}, since={h.name!r}): into does not hold snapshot {h.name!r} at "
            f"key {key!r}" + (f" (chunk shared with keys {keys[:5]})" if len(keys) > 1 else "")
            + f": its bytes hash to {actual}, expected {b}, the digest {h.name!r} has there. "
            "Nothing was written (into is unchanged). Load without since= to read the whole "
            f"snapshot, or pass since= the snapshot into actually holds",
            key=key, keys=tuple(keys), snapshot=m.name, held=h.name,
        )  # fmt: skip

    def rebuilt(b: str) -> tuple[str, np.ndarray]:
        buf, odd = plan.rebuild(b)
        if odd is not None:  # two places of one chunk that differ: never the held chunk
            raise held_error(b, "(two copies that differ)", odd)
        if b in checked and (actual := digest(buf)) != b:
            raise held_error(b, actual)
        return b, buf

    checked = set(check)
    bases = dict(_each(rebuilt, sorted(set(check) | {b for _, b, _ in patches}), opts.threads))
    stats.bytes_checked += sum(bases[b].size for b in check)
    keep = {b for _, b, _ in patches}
    uses = Counter(b for _, b, _ in patches)
    bases = {b: buf for b, buf in bases.items() if b in keep}

    with pack_readers(st, stats) as packs:
        # 2. xor deltas onto the held bytes, each result checked against the target's digest.
        reader = ChunkReader(packs, m.chunks, verify=True)

        def patch(item: tuple[str, str, list[str]]) -> tuple[str, np.ndarray]:
            d, b, above = item
            where = f"snapshot {m.name!r} key {want[d][0][0]!r}"
            size = m.chunks[d].size
            levels: list[tuple[str, codecs.Buffer, int]] = [(codecs.RAW, bases[b], 1)]
            for c in reversed(above):
                rec = m.chunks[c]
                levels.append((rec.codec, reader.payload(c, where), rec.itemsize))
            out = np.empty(size, dtype=np.uint8)  # never written into into's own bytes
            try:
                if len(levels) == 2:  # one delta: no regrouping of the base
                    codec, payload, k = levels[1]
                    codecs.decode(codec, payload, size, k, out, base=bases[b])
                else:  # a chain: xor levels combined in the grouped domain, ungrouped once
                    codecs.decode_chain(levels, size, out)
            except CodecError as e:
                raise CorruptChunkError(
                    f"chunk {d} of {where}: its deltas onto {h.name!r}'s chunk {b} do not "
                    f"decode ({e}). Run `deltackpt verify`; load without since= to read it whole"
                ) from e
            if (actual := digest(out)) != d:
                if b not in checked and (was := digest(bases[b])) != b:
                    raise held_error(b, was)
                raise CorruptChunkError(
                    f"chunk {d} of {where}: patching {h.name!r}'s chunk {b} with {len(above)} "
                    f"delta(s) gives bytes hashing to {actual}, expected {d}; a payload is "
                    "corrupt. Nothing was written. Run `deltackpt verify`; load without since= "
                    "to read it whole"
                )
            return d, out

        def lift(x: tuple[str, str, list[str]]) -> inplace.InPlace:
            where = f"snapshot {m.name!r} key {want[x[0]][0][0]!r}"
            read = partial(reader.payload, where=where)
            lb, ld = h.chunks[x[1]].lin, m.chunks[x[0]].lin
            lin = None if full or lb is None or ld is None else (lb, ld)
            return inplace.lift(*x, m.chunks, bases[x[1]], read, where, lin)

        ok = inplace.eligible
        fits = [uses[b] == 1 and ok(d, a, m.chunks, bases[b], len(want[d])) for d, b, a in patches]
        up.in_place = _each(lift, list(compress(patches, fits)), opts.threads)
        rest = list(compress(patches, [not f for f in fits]))
        up.chunks.update(_each(patch, rest, opts.threads))

        # 3. everything else, read whole into fresh memory and verified by the read engine;
        # a raw chunk in a mapped local pack is verified where it lies and copied from there at
        # the commit (packs are never written in place): no staging memory, no second copy.
        r = Reads(m)
        in_map = ChunkReader(packs, m.chunks, verify=bool(opts.verify))
        mapped: list[tuple[str, np.ndarray]] = []
        for d in read:
            view = in_map.mapped(d)
            if view is not None:
                mapped.append((d, view))
                continue
            buf = np.empty(m.chunks[d].size, dtype=np.uint8)
            r.want(want[d][0][0], ((d, 0, buf.size),), buf)
            up.chunks[d] = buf
        _each(lambda x: in_map.check_mapped(*x, f"snapshot {m.name!r} key {want[x[0]][0][0]!r}"),
              mapped, opts.threads)  # fmt: skip
        up.chunks.update(mapped)
        stats.chunks_read += len(mapped)
        held_entries = {x.path: x for x in h.tensors}
        for i in whole:
            e = m.tensors[i]
            dst = targets[e.path]
            was = held_entries.get(e.path)
            parts = None if full else _device_parts(e, dst, was, plan.index, forced)
            if parts is not None:  # a device tensor: only its chunks that changed since held
                same, runs, u8 = parts
                stats.chunks_unchanged += same
                for pos, slices in runs:
                    n = sum(x[2] for x in slices)
                    buf = torch.empty(n, dtype=torch.uint8)  # pinned only at the commit's copy
                    r.want(e.path, slices, np_bytes(buf))
                    up.device_runs.append((u8[pos : pos + n], buf))
                continue
            dst, t = _stage_entry(r, e, dst)
            up.copies.append((dst, t, e.path))
        stats.chunks_read += len(r.jobs)
        r.run(packs, opts.verify, opts.threads, "deltackpt-since")
    # 4. last, once everything else is staged and verified: the in-place patches (undone on failure)
    inplace.apply_all(up.in_place, lambda fn, xs: _each(fn, xs, opts.threads), h.name, held_error)
    bases.clear()

    for d in unchanged:
        del want[d]  # nothing to copy: into holds it already
    stats.chunks_unchanged += len(unchanged)
    stats.chunks_patched += len(patches)
    stats.bytes_patched += sum(n for d, _, _ in patches for _, _, _, n in want[d])
    return up


def rows_as_data(m: Manifest) -> Manifest:
    """``m`` with each tensor saved as row blocks that tile it (``Shard(0)`` ranks of a
    distributed save: FSDP2) described as one whole tensor, its bytes the blocks' in row order,
    so that its chunks are skipped or patched by their place in the tensor as a tensor saved by
    one process is. Other sharded tensors stay as they are (read whole)."""
    tensors = list(m.tensors)
    changed = False
    for i, e in enumerate(tensors):
        if e.shards is not None and e.shape:
            whole = box_entry(e, ((0,) * len(e.shape), e.shape))
            if whole is not None:
                tensors[i], changed = whole, True
    return dataclasses.replace(m, tensors=tuple(tensors)) if changed else m


def catch_up(
    store: str | os.PathLike[str] | Store,
    name: str,
    since: str,
    into: Any,
    opts: LoadOptions,
    select: Select | None,
    process_group: Any = None,
    stats: LoadStats | None = None,
) -> Any:
    """``load(store, name, into=into, since=since)``: stage the catch-up (:func:`prepare`), then
    write it. With ``process_group`` every rank stages first and the ranks agree before any rank
    writes, so a rank whose ``into`` does not hold ``since`` stops every rank with ``into``
    unchanged everywhere."""
    if into is None or not isinstance(since, str):
        raise InvalidArgumentError(
            f"load(since={since!r}) needs into= (the state that holds snapshot since=) and a "
            "snapshot name; pass e.g. load(store, 'step-200', into=sd, since='step-100')"
        )

    def stage(m: Manifest) -> Callable[[], None]:
        m = rows_as_data(nested_manifest(m))  # DCP's nesting; row blocks as whole tensors
        _, found = flatten(into, allow_pickle=True, check_tensors=False)
        leaves = {leaf.path: leaf.tensor for leaf in found}
        targets = {p: t for p, t in leaves.items() if select is None or select(p)}
        saved = {e.path: i for i, e in enumerate(m.tensors) if select is None or select(e.path)}
        _check_into(m, into, targets, saved, opts, select)
        wanted = [i for p, i in saved.items() if p in targets]
        up = prepare(st, m, held, wanted, targets, leaves, opts, stats)
        prepared.append(up)

        def commit() -> None:
            try:
                up.commit()
            except BaseException:
                up.abort()  # the in-place patches, at least, are undone
                raise
            _assign_values(m.tree, into, opts, select)

        return commit

    st = open_store(store, create=False)
    held = rows_as_data(nested_manifest(st.manifest(since)))
    prepared: list[CatchUp] = []
    if process_group is None:
        _retrying(st, st.manifest(name), stage)()
        return into
    try:
        commit = _agree(process_group, lambda: _retrying(st, st.manifest(name), stage))
    except BaseException:  # another rank failed: undo what this rank patched in place
        for up in prepared:
            up.abort()
        raise
    _agree(process_group, commit)
    return into
