"""Each system's sequence of saves on the same trained state: torch.save, dcp.async_save (two
stagers), torchsnapshot and deltackpt.async_save. Every save is one ``Rec``."""

from __future__ import annotations

import gc
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common as C
import torch
from _harness import stores

import deltackpt
from _async import log
from _async.master import Master


class Rec(dict):
    pass


def run_torch_save(master: Master, kind: str, root: Path, n: int) -> list[Rec]:
    root.mkdir(parents=True)
    recs = []
    prev: Path | None = None
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        path = root / f"step-{i}.pt"
        gc.collect()
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        C.fsync_file(path)
        C.fsync_dir(root)
        t2 = time.perf_counter()
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t2 - t0,
                total=t2 - t0,
                nofsync=t1 - t0,
                bytes=C.du_bytes(path),
            )
        )
        if prev is not None:
            prev.unlink()
        prev = path
        log(f"  torch.save #{i}: {t2 - t0:.2f}s (no fsync {t1 - t0:.2f}s)")
    return recs


def run_dcp(master: Master, kind: str, root: Path, n: int, cached: bool) -> list[Rec]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    root.mkdir(parents=True)
    stager = DefaultStager(StagingOptions(False, False, False, False)) if cached else None
    recs = []
    prev: Path | None = None
    try:
        for i in range(n):
            if i:
                master.step()
            state = master.state(kind)
            warm = master.warm_copy(kind)
            d = root / f"step-{i}"
            kw: dict[str, Any] = {"storage_writer": dcp.FileSystemWriter(str(d))}
            if stager is not None:
                kw["async_stager"] = stager
            gc.collect()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, **kw)
            t1 = time.perf_counter()
            upload = getattr(fut, "upload_completion", fut)
            staging = getattr(fut, "staging_completion", None)
            if staging is not None:
                staging.result()
            t_staged = time.perf_counter()
            upload.result()
            t2 = time.perf_counter()
            recs.append(
                Rec(
                    i=i,
                    warm=warm,
                    blocking=t1 - t0,
                    staged=t_staged - t0,
                    total=t2 - t0,
                    bytes=C.du_bytes(d),
                )
            )
            if prev is not None:
                C.rmtree(prev)
            prev = d
            log(
                f"  dcp{'(cached stager)' if cached else ''} #{i}: blocking {t1 - t0:.2f}s "
                f"total {t2 - t0:.2f}s"
            )
    finally:
        if stager is not None:
            stager.close()
    return recs


def run_tsnap(master: Master, kind: str, root: Path, n: int) -> list[Rec]:
    from torchsnapshot import Snapshot, StateDict

    root.mkdir(parents=True)
    recs = []
    prev: Path | None = None
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        d = root / f"step-{i}"
        gc.collect()
        t0 = time.perf_counter()
        pending = Snapshot.async_take(str(d), {"state": StateDict(**state)})
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        C.fsync_tree(d)
        t3 = time.perf_counter()
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t1 - t0,
                total=t2 - t0,
                total_fsync=t3 - t0,
                bytes=C.du_bytes(d),
            )
        )
        if prev is not None:
            C.rmtree(prev)
        prev = d
        log(
            f"  torchsnapshot #{i}: blocking {t1 - t0:.2f}s total {t2 - t0:.2f}s "
            f"(+fsync {t3 - t0:.2f}s)"
        )
    return recs


def codec_mix(store: Any, name: str, prev_names: set[str]) -> dict[str, int]:
    """Payload bytes by codec of the chunks this snapshot added."""
    m = store.manifest(name)
    old: set[str] = set()
    for pn in prev_names:
        old |= set(store.manifest(pn).chunks)
    mix: Counter = Counter()
    for d, rec in m.chunks.items():
        if d not in old:
            mix[rec.codec] += rec.length
    return dict(mix)


def category(path: str) -> str:
    if path.endswith("exp_avg_sq"):
        return "exp_avg_sq"
    if path.endswith("exp_avg"):
        return "exp_avg"
    if path.startswith("optim"):
        return "optim other"
    return "params" if path.startswith("model") else "weights"


def bytes_by_category(store: Any, name: str, prev_names: set[str]) -> dict[str, list[int]]:
    """{category: [raw bytes of the chunks this snapshot added, their payload bytes]}."""
    m = store.manifest(name)
    old: set[str] = set()
    for pn in prev_names:
        old |= set(store.manifest(pn).chunks)
    cat: dict[str, str] = {}
    for e in m.tensors:
        for d, _, _ in e.data or ():
            cat.setdefault(d, category(e.path))
    for _, data in m.storages:
        for d, _, _ in data:
            cat.setdefault(d, "tied embedding storage")
    out: dict[str, list[int]] = {}
    for d, rec in m.chunks.items():
        if d in cat and d not in old:
            v = out.setdefault(cat[d], [0, 0])
            v[0] += rec.size
            v[1] += rec.length
    return out


def run_deltackpt(master: Master, kind: str, root: Path, n: int) -> tuple[list[Rec], Any]:
    st = deltackpt.open_store(root)
    recs = []
    names: list[str] = []
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        name = f"step-{i}"
        gc.collect()
        t0 = time.perf_counter()
        h = deltackpt.async_save(state, st, name)
        t1 = time.perf_counter()
        staged_done = h.staged.done()
        info = h.result()
        t2 = time.perf_counter()
        mix = codec_mix(st, name, set(names))
        cats = bytes_by_category(st, name, set(names))
        depth = stores.depth_bytes(st, name)
        names.append(name)
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t1 - t0,
                total=t2 - t0,
                bytes=info.bytes_written,
                logical=info.logical_bytes,
                lib_blocked=info.blocked_seconds,
                lib_seconds=info.seconds,
                staged_done_at_return=staged_done,
                chunks_new=info.chunks_new,
                chunks_reused=info.chunks_reused,
                codec_bytes=mix,
                max_depth=max(depth),
                depth_bytes=dict(depth),
                by_category=cats,
            )
        )
        log(
            f"  deltackpt #{i}: blocking {t1 - t0:.2f}s total {t2 - t0:.2f}s "
            f"bytes {info.bytes_written / info.logical_bytes:.1%} of logical, codecs {mix}, "
            f"max chain depth {max(depth)}"
        )
    return recs, st
