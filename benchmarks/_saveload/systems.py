"""The systems compared, behind one interface: save a state (fresh location or the same one),
name the files a load reads, load as new tensors, load into existing ones."""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common as C
import torch
from _harness import stores


class System:
    name = ""
    incremental = False  # keeps history across saves (must see every mutation)
    explicit_fsync = False  # the durable row adds our own fsync

    def __init__(self, root: Path) -> None:
        self.root = root / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.latest: Path | None = None
        self.n = 0

    def path(self) -> Path:
        assert self.latest is not None
        return self.latest

    def save(self, state: Any, fresh: bool) -> dict[str, Any]:
        raise NotImplementedError

    def files(self) -> list[Path]:
        """Files a load of the latest checkpoint reads."""
        return C.all_files(self.path())

    def load_new(self, template: Any) -> Any:
        raise NotImplementedError

    def load_into(self, target: Any) -> None:
        raise NotImplementedError

    def _replace(self, new: Path) -> None:
        old, self.latest = self.latest, new
        if old is not None and old != new:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


class TorchSystem(System):
    name = "torch"
    explicit_fsync = True

    def save(self, state: Any, fresh: bool) -> dict[str, Any]:
        self.n += 1
        p = self.root / f"ckpt-{self.n}.pt"
        gc.collect()
        t0 = time.perf_counter()
        torch.save(state, p)
        t1 = time.perf_counter()
        C.fsync_file(p)
        C.fsync_dir(self.root)
        t2 = time.perf_counter()
        self._replace(p)
        return {"seconds": t2 - t0, "seconds_nofsync": t1 - t0, "bytes_added": C.du_bytes(p)}

    def load_new(self, template: Any) -> Any:
        return torch.load(self.path(), weights_only=True)

    def load_into(self, target: Any) -> None:
        sd = torch.load(self.path(), weights_only=True, mmap=True)
        C.copy_into(C.flat_tensors(sd), target)


class SafetensorsSystem(System):
    name = "safetensors"
    explicit_fsync = True

    def save(self, state: Any, fresh: bool) -> dict[str, Any]:
        from safetensors.torch import save_file

        self.n += 1
        p = self.root / f"ckpt-{self.n}.safetensors"
        gc.collect()
        t0 = time.perf_counter()
        # safetensors takes a flat dict without shared storages: drop tied duplicates (re-tied
        # on load, like transformers does) and keep non-tensor values as JSON metadata.
        flat = C.flat_tensors(state)
        self.ties = dict((dup, canon) for canon, dup in C.tied_pairs(state))
        tensors = {k: v.detach() for k, v in flat.items() if k not in self.ties}
        meta = {
            "values": json.dumps(C.flat_values(state), default=str),
            "tied": json.dumps(self.ties),
        }
        save_file(tensors, p, metadata=meta)
        t1 = time.perf_counter()
        C.fsync_file(p)
        C.fsync_dir(self.root)
        t2 = time.perf_counter()
        self._replace(p)
        return {"seconds": t2 - t0, "seconds_nofsync": t1 - t0, "bytes_added": C.du_bytes(p)}

    def load_new(self, template: Any) -> Any:
        from safetensors.torch import load_file

        out = {k: v.clone() for k, v in load_file(self.path()).items()}
        for dup, canon in self.ties.items():
            out[dup] = out[canon]
        return out

    def load_into(self, target: Any) -> None:
        from safetensors.torch import load_file

        C.copy_into(load_file(self.path()), target, self.ties)


class DcpSystem(System):
    name = "dcp"

    def save(self, state: Any, fresh: bool) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        self.n += 1
        d = self.root / f"ckpt-{self.n}"
        gc.collect()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d))  # sync_files=True by default
        t1 = time.perf_counter()
        self._replace(d)
        return {"seconds": t1 - t0, "bytes_added": C.du_bytes(d)}

    def load_new(self, template: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        target = C.map_tensors(template, torch.empty_like)
        dcp.load(target, storage_reader=dcp.FileSystemReader(self.path()))
        return target

    def load_into(self, target: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(self.path()))


class DeltackptSystem(System):
    name = "deltackpt"
    incremental = True
    options: dict[str, Any] = {}
    store_kwargs: dict[str, Any] = {}  # open_store() arguments when a store is created

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.known: set[str] = set()

    def _replace(self, new: Path) -> None:
        import deltackpt

        old = self.latest
        if old is not None and old != new:
            # Let the dropped store's Store object (and its staging buffers) be freed.
            stores.release(deltackpt.open_store(old, create=False))
        super()._replace(new)

    def save(self, state: Any, fresh: bool) -> dict[str, Any]:
        import deltackpt

        self.n += 1
        if fresh or self.latest is None:
            store = self.root / f"store-{self.n}"
            self._replace(store)
            deltackpt.open_store(store, **self.store_kwargs)
            self.known = set()
        store = self.path()
        before = C.du_bytes(store)
        name = f"s{self.n}"
        gc.collect()
        t0 = time.perf_counter()
        info = deltackpt.save(state, store, name, **self.options)
        t1 = time.perf_counter()
        chunks = deltackpt.open_store(store).manifest(name).chunks
        new = {d: r for d, r in chunks.items() if d not in self.known}
        self.known |= set(chunks)
        return {
            "seconds": t1 - t0,
            "bytes_added": C.du_bytes(store) - before,
            "bytes_written": info.bytes_written,
            "chunks_new": info.chunks_new,
            "chunks_reused": info.chunks_reused,
            "new_codecs": dict(Counter(r.codec for r in new.values())),
            "new_stored_over_raw": (
                sum(r.length for r in new.values()) / max(1, sum(r.size for r in new.values()))
            ),
        }

    def files(self) -> list[Path]:
        import deltackpt

        st = deltackpt.open_store(self.path())
        m = st.manifest("latest")
        packs = {r.pack for r in m.chunks.values()}
        return [st.manifest_path(m.name)] + [st.pack_path(p) for p in sorted(packs)]

    @staticmethod
    def _forget() -> None:
        # A restore usually runs in a fresh process: do not reuse the in-process manifest cache.
        stores.forget_open_stores()

    def load_new(self, template: Any) -> Any:
        import deltackpt

        self._forget()
        return deltackpt.load(self.path())

    def load_into(self, target: Any) -> None:
        import deltackpt

        self._forget()
        deltackpt.load(self.path(), into=target)


class DeltackptNoGroupSystem(DeltackptSystem):
    """deltackpt with small-tensor grouping off (store small_bytes=0): every tensor gets its own
    chunks. Not run by default; it was the workaround for the grouped-chunk layout bug fixed in
    04d6db1 (small tensors after a large one pointed at the wrong chunk)."""

    name = "deltackpt-ng"
    store_kwargs = {"small_bytes": 0}


class DeltackptRawSystem(DeltackptSystem):
    """deltackpt with ``encoding="fast-restore"`` (every chunk stored raw): isolates the codec
    cost."""

    name = "deltackpt-raw"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.options = {"encoding": "fast-restore"}


class DeltackptSmallestSystem(DeltackptSystem):
    """deltackpt with ``encoding="smallest"``: any chunk an encoding shrinks by 10% is encoded
    (the default before issue 9)."""

    name = "deltackpt-smallest"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.options = {"encoding": "smallest"}


SYSTEMS = {
    c.name: c
    for c in (
        TorchSystem,
        SafetensorsSystem,
        DcpSystem,
        DeltackptSystem,
        DeltackptNoGroupSystem,
        DeltackptRawSystem,
        DeltackptSmallestSystem,
    )
}
