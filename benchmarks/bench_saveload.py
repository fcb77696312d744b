"""Save/load, side by side in one run: torch.save/load, safetensors, DCP and deltackpt.

All systems save and load the *same* state in one process, so their ratios are comparable even on
a noisy machine. The machine's own limits (memcpy, disk write+fsync, cold/warm read, xxh3) are
measured in the same run and every row is also given as a % of the relevant one.

States (``--model qwen0.5b``: Qwen2-0.5B shapes, random tensors, tied lm_head, ~494M params):

* ``--state weights`` (default): bf16 weights, ~0.99 GB.
* ``--state train``: fp32 weights + torch.optim.AdamW state (exp_avg, exp_avg_sq, step) after one
  real AdamW step, ~5.9 GB at scale 1. deltackpt keeps two staging copies of the state for xor
  deltas when they fit in half the RAM, so at scale 1 the peak is ~25 GB: use ``--scale 0.5``
  (~3 GB state, ~13 GB peak) on a 24 GB machine.

``--scale`` shrinks the number of layers and the vocabulary (``--scale 0.1`` for a quick run).

Save scenarios (every system saves the same state; torch/safetensors/DCP rewrite everything):

1. ``full``: first save into an empty location (a new file / directory / store each repetition).
2. ``unchanged``: save again, nothing changed.
3. ``10pct``: 10% of the tensors (by count, random, seeded) scaled by 0.99 in place before each
   repetition.
4. ``step``: one optimizer step before each repetition. ``weights``: ``w.add_(sign(randn),
   alpha=-1e-5)`` in bf16 (what AdamW's first steps do at lr 1e-5); ``train``: a real
   ``torch.optim.AdamW(lr=1e-5, weight_decay=0.01).step()`` with fixed random gradients.

Durability: deltackpt fsyncs packs, manifest and directories; DCP's FileSystemWriter fsyncs its
files (``sync_files=True``, the default); torch.save and safetensors do not, so their "durable"
rows add an explicit fsync of the file and its directory (their plain "no fsync" rows are the
same runs, timed before the fsync).

Loads of the last saved state, each checked bit-exact against the source (first load of a row:
``torch.equal`` on the raw bits of every tensor; repeats: xxh3-128 of the raw bits): ``new``
returns fresh tensors (torch.load; safetensors load_file + ``.clone()``, since load_file alone is a
lazy mmap; DCP into ``torch.empty`` tensors allocated in the timed region; ``deltackpt.load``),
``into`` fills an existing, touched state in place (torch.load(mmap=True) + copy_; load_file +
copy_; dcp.load; ``deltackpt.load(into=...)``). ``warm`` = files in the page cache; ``cold`` =
after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (``into`` cold only with ``--into-cold``).

Systems (``--systems``): torch, safetensors, dcp, deltackpt (defaults), deltackpt-raw (compression
off: isolates the codec cost); optional deltackpt-ng (store without small-tensor grouping).
Each measurement runs ``--reps`` times (median) unless one run takes over 10 s. Results:
``bench-out/saveload-*.json`` plus a markdown table on stdout.

    python benchmarks/bench_saveload.py                       # full bf16 0.5B, ~10 min loaded
    python benchmarks/bench_saveload.py --scale 0.1           # quick
    python benchmarks/bench_saveload.py --state train --scale 0.5   # fp32 + AdamW, ~3 GB
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C

warnings.filterwarnings("ignore")  # DCP warns about running without a process group

SLOW = 10.0  # a measurement slower than this is not repeated
SCENARIOS = ("full", "unchanged", "10pct", "step")


# =========================================================================== states


class BenchState:
    """The state every system saves, and the mutations between saves."""

    def __init__(self, kind: str, scale: float, seed: int = 0) -> None:
        self.kind = kind
        self.rng = torch.Generator().manual_seed(seed + 1)
        t0 = time.perf_counter()
        if kind == "weights":
            self.state: Any = C.qwen2_weights(torch.bfloat16, scale, seed)
            self.opt = None
        else:
            sd = C.qwen2_weights(torch.float32, scale, seed)
            params: list[torch.Tensor] = []
            seen: set[int] = set()
            for t in sd.values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    t.requires_grad_(True)
                    params.append(t)
            self.params = params
            self.model = sd
            self.opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=False)
            for p in params:  # fixed random gradients, reused for every step
                p.grad = torch.randn(p.shape, generator=self.rng).mul_(1e-3)
            self.opt.step()
            self.steps = 1
            self.refresh()
        self.build_seconds = time.perf_counter() - t0

    def refresh(self) -> None:
        if self.kind == "train":
            model = {k: v.detach() for k, v in self.model.items()}
            self.state = {"model": model, "optim": self.opt.state_dict(), "step": self.steps}

    def drop_grads(self) -> None:
        if self.kind == "train":
            for p in self.params:
                p.grad = None

    # ----------------------------------------------------------------- mutations
    def mutate(self, scenario: str) -> dict[str, Any]:
        if scenario in ("full", "unchanged"):
            return {}
        if scenario == "10pct":
            return self._mutate_some(0.10)
        return self._step()

    def _mutate_some(self, frac: float) -> dict[str, Any]:
        cands = [(k, t) for k, t in C.unique_tensors(self.state) if t.numel() > 1]
        k = max(1, round(frac * len(cands)))
        idx = torch.randperm(len(cands), generator=self.rng)[:k].tolist()
        changed = 0
        with torch.no_grad():
            for i in idx:
                t = cands[i][1]
                t.mul_(0.99)
                changed += t.numel() * t.element_size()
        return {
            "tensors_changed": k,
            "tensors": len(cands),
            "bytes_changed": changed,
            "frac_bytes_changed": changed / C.logical_bytes(self.state),
        }

    def _sign_pool(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        pool = getattr(self, "_pool", None)
        if pool is None or pool.dtype != dtype:
            pool = torch.randn(n + (1 << 24), generator=self.rng).sign_().to(dtype)
            self._pool = pool
        return pool

    def _step(self) -> dict[str, Any]:
        weights = [
            t
            for _, t in C.unique_tensors(
                self.state if self.kind == "weights" else self.state["model"]
            )
        ]
        # Count changed elements on the first 1M elements of every weight (cheap, representative).
        sample = 1 << 20
        before = [w.detach().reshape(-1)[:sample].clone() for w in weights]
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.kind == "weights":
                pool = self._sign_pool(max(w.numel() for w in weights), weights[0].dtype)
                for w in weights:
                    # sign(randn) taken at a random offset of a pre-drawn pool of signs: drawing
                    # 494M fresh normals per step costs 10-20 s on this loaded 2-core machine.
                    off = int(
                        torch.randint(0, pool.numel() - w.numel() + 1, (1,), generator=self.rng)
                    )
                    w.add_(pool[off : off + w.numel()].view(w.shape), alpha=-1e-5)
            else:
                self.opt.step()
                self.steps += 1
        secs = time.perf_counter() - t0
        n = sum(b.numel() for b in before)
        ch = sum(
            int((w.detach().reshape(-1)[: b.numel()] != b).sum())
            for w, b in zip(weights, before, strict=True)
        )
        del before
        self.refresh()
        return {
            "step_seconds": secs,
            "frac_weight_elems_changed": round(ch / n, 4),
            "how": "w.add_(sign(randn), alpha=-1e-5) in bf16 (signs drawn once, random offsets)"
            if self.kind == "weights"
            else "torch.optim.AdamW(lr=1e-5, wd=0.01).step(), fixed random grads",
        }


def code_fingerprint() -> dict[str, Any]:
    """Which deltackpt code ran: the tree is edited concurrently, so git HEAD is not enough."""
    import hashlib
    import subprocess

    pkg = C.REPO / "deltackpt"
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    st = subprocess.run(
        ["git", "status", "--porcelain", "--", "deltackpt"],
        cwd=C.REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split("\n")
    return {
        "sha256_of_deltackpt_py": h.hexdigest()[:16],
        "changed_vs_head": [x.strip() for x in st if x.strip()],
    }


def vmhwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tied_pairs(state: Any) -> list[tuple[str, str]]:
    first: dict[int, str] = {}
    out = []
    for k, t in C.flat_tensors(state).items():
        p = t.untyped_storage().data_ptr()
        if p in first:
            out.append((first[p], k))
        else:
            first[p] = k
    return out


def zero_(state: Any) -> None:
    with torch.no_grad():
        for _, t in C.unique_tensors(state):
            t.zero_()


def copy_into(
    src: dict[str, torch.Tensor], target: Any, rename: dict[str, str] | None = None
) -> None:
    """copy_ every target tensor from ``src`` (flat, by path); tied targets are copied once."""
    done: set[int] = set()
    with torch.no_grad():
        for k, t in C.flat_tensors(target).items():
            p = t.untyped_storage().data_ptr()
            if p in done:
                continue
            done.add(p)
            t.copy_(src[(rename or {}).get(k, k)])


def all_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [Path(r) / f for r, _, fs in os.walk(path) for f in fs]


def warm_files(files: list[Path]) -> None:
    """Read the files once so they sit in the page cache."""
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# =========================================================================== systems


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
        return all_files(self.path())

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
        copy_into(C.flat_tensors(sd), target)


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
        self.ties = dict((dup, canon) for canon, dup in tied_pairs(state))
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

        copy_into(load_file(self.path()), target, self.ties)


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
        import deltackpt.store.store

        old = self.latest
        super()._replace(new)
        if old is not None and old != new:
            # Let the dropped store's Store object (and its staging buffers) be freed.
            deltackpt.store.store._STORES.pop(old.absolute(), None)

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
        import deltackpt.store.store

        deltackpt.store.store._STORES.clear()

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


def chain_stats(store: Path) -> dict[str, Any]:
    """xor delta chains of a store's latest snapshot: what a load has to read and decode."""
    import deltackpt

    m = deltackpt.open_store(store).manifest("latest")
    used: set[str] = set()
    for e in m.tensors:
        for d, _, _ in e.data or ():
            used.add(d)
        for sh in e.shards or ():
            for d, _, _ in sh.data:
                used.add(d)
    for _, data in m.storages:
        for d, _, _ in data:
            used.add(d)

    def chain(d: str) -> list[str]:
        out = [d]
        while m.chunks[out[-1]].base is not None:
            out.append(m.chunks[out[-1]].base)
        return out

    depths, read, raw = [], 0, 0
    for d in used:
        c = chain(d)
        depths.append(len(c) - 1)
        read += sum(m.chunks[x].length for x in c)
        raw += m.chunks[d].size
    return {
        "chunks": len(used),
        "max_xor_depth": max(depths, default=0),
        "mean_xor_depth": round(sum(depths) / max(1, len(depths)), 2),
        "codecs": dict(Counter(m.chunks[d].codec for d in used)),
        "pack_bytes_read": read,
        "raw_bytes": raw,
    }


# =========================================================================== runs


def run_saves(bs: BenchState, systems: list[System], reps: int, log: Any) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for sc in SCENARIOS:
        skip: set[str] = set()
        for rep in range(reps):
            active = [s for s in systems if s.name not in skip]
            if not active:
                break
            mut = bs.mutate(sc)
            k = rep % len(systems)  # rotate the order: no system always runs right after another
            for s in systems[k:] + systems[:k]:
                if s.name in skip:
                    continue
                row = rows.setdefault(
                    (sc, s.name),
                    {"op": "save", "scenario": sc, "system": s.name, "runs": [], "mutations": []},
                )
                rss0 = rss_bytes()
                try:
                    r = s.save(bs.state, fresh=(sc == "full"))
                except Exception as e:  # a broken system must not end the comparison
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    log(f"  save {sc} rep {rep} {s.name} FAILED: {row['error']}")
                    skip.add(s.name)
                    continue
                r["loadavg"] = os.getloadavg()[0]
                r["rss_after"] = rss_bytes()
                r["rss_delta"] = r["rss_after"] - rss0
                row["runs"].append(r)
                log(
                    f"  save {sc:9s} rep {rep} {s.name:13s} {r['seconds']:7.3f} s "
                    f"{C.fmt_bytes(r['bytes_added'])}"
                    + (
                        f" new={r['chunks_new']} reused={r['chunks_reused']} {r['new_codecs']}"
                        if "chunks_new" in r
                        else ""
                    )
                )
                must_follow = s.incremental and sc in ("10pct", "step")
                if r["seconds"] > SLOW and not must_follow:
                    skip.add(s.name)
            for row in rows.values():
                if row["scenario"] == sc:
                    row["mutations"].append(mut)
            if mut:
                log(f"  mutation {sc} rep {rep}: {mut}")
    return list(rows.values())


def run_loads(
    bs: BenchState, systems: list[System], reps: int, cold_ok: bool, into_cold: bool, log: Any
) -> list[dict[str, Any]]:
    src = C.flat_tensors(bs.state)
    src_vals = C.flat_values(bs.state)
    ties = tied_pairs(bs.state)
    rows = []

    src_digests = C.bit_digests(src)

    def check(s: System, got: Any, mode: str, rep: int) -> dict[str, Any]:
        # First load of a row: torch.equal on the raw bits of every tensor. Repeats: xxh3-128 of
        # the raw bits (same verdict, ~10x cheaper; torch.equal of 1 GB takes 3-5 s here).
        if rep == 0:
            res = C.compare(src, C.flat_tensors(got))
            res["check"] = "torch.equal"
        else:
            res = C.compare_digests(src_digests, C.flat_tensors(got))
            res["check"] = "xxh3-128"
        if mode == "new" and s.name != "safetensors":
            vals = C.flat_values(got)
            res["values_equal"] = all(vals.get(k) == v for k, v in src_vals.items())
            res["exact"] = res["exact"] and res["values_equal"]
        if mode == "new":
            ft = C.flat_tensors(got)
            res["ties_kept"] = all(
                a in ft
                and b in ft
                and ft[a].untyped_storage().data_ptr() == ft[b].untyped_storage().data_ptr()
                for a, b in ties
            )
        return res

    caches = ["warm"] + (["cold"] if cold_ok else [])
    into_caches = caches if into_cold else ["warm"]
    target = None
    failed: dict[str, str] = {}
    for mode in ("new", "into"):
        if mode == "into":
            target = C.map_tensors(bs.state, torch.zeros_like)  # touched, ties kept
        for s in systems:
            for cache in caches if mode == "new" else into_caches:
                row = {"op": "load", "mode": mode, "cache": cache, "system": s.name, "runs": []}
                if s.name in failed:  # same read path: do not spend minutes failing again
                    row["runs"].append(
                        {
                            "seconds": float("nan"),
                            "exact": False,
                            "error": f"not run: {failed[s.name]}",
                        }
                    )
                    rows.append(row)
                    continue
                if cache == "warm":
                    warm_files(s.files())
                for rep in range(reps):
                    if cache == "cold":
                        C.drop_caches()
                    row.setdefault("loadavg", []).append(os.getloadavg()[0])
                    try:
                        if mode == "into":
                            zero_(target)
                            secs, _ = C.timed(lambda s=s, t=target: s.load_into(t))
                            got = target
                        else:
                            secs, got = C.timed(lambda s=s: s.load_new(bs.state))
                    except Exception as e:  # record the failure, keep comparing the others
                        err = f"{type(e).__name__}: {e}"[:300]
                        row["runs"].append({"seconds": float("nan"), "exact": False, "error": err})
                        log(f"  load {mode:4s} {cache:4s} rep {rep} {s.name:13s} FAILED: {err}")
                        failed[s.name] = f"{mode} {cache} load failed with {err[:60]}"
                        break
                    chk = check(s, got, mode, rep)
                    del got
                    row["runs"].append({"seconds": secs, **chk})
                    log(
                        f"  load {mode:4s} {cache:4s} rep {rep} {s.name:13s} {secs:7.3f} s "
                        f"exact={chk['exact']}"
                        + (f" ties={chk['ties_kept']}" if "ties_kept" in chk else "")
                    )
                    gc.collect()
                    if secs > SLOW:
                        break
                rows.append(row)
    del target
    return rows


# =========================================================================== report


def summarize(result: dict[str, Any]) -> str:
    lim = result["limits"]
    nbytes = result["state"]["logical_bytes"]
    out = []

    out.append("Machine limits (same run):\n")
    lrows = []
    for k, v in lim.items():
        if "gbps" in v:
            lrows.append(
                [
                    k,
                    v["what"],
                    C.fmt_bytes(v["bytes"]),
                    f"{C.median(v['seconds']):.3f}",
                    f"{v['gbps']:.2f}",
                ]
            )
    out.append(C.md_table(["limit", "what", "bytes", "median s", "GB/s"], lrows))
    out.append(f"\ndrop_caches worked: {lim.get('drop_caches_ok', {}).get('ok')}\n")

    def g(key: str) -> float | None:
        return lim[key]["gbps"] if key in lim else None

    saves = [r for r in result["rows"] if r["op"] == "save"]
    base: dict[tuple[str, str], float] = {}
    for r in saves:
        if r["system"] == "torch":
            base[(r["scenario"], "durable")] = C.median([x["seconds"] for x in r["runs"]])
            base[(r["scenario"], "nofsync")] = C.median([x["seconds_nofsync"] for x in r["runs"]])

    srows = []
    for sc in SCENARIOS:
        for r in [r for r in saves if r["scenario"] == sc]:
            if not r["runs"]:
                srows.append([sc, r["system"], "FAILED", "", "", "", "", "", r.get("error", "")])
                continue
            variants = [("durable", "seconds")]
            if any("seconds_nofsync" in x for x in r["runs"]):
                variants.append(("nofsync", "seconds_nofsync"))
            for var, key in variants:
                secs = [x[key] for x in r["runs"]]
                med = C.median(secs)
                gbps = nbytes / med / C.GB
                lkey = "write_fsync" if var == "durable" else "write_buffered"
                if r["system"].startswith("deltackpt") and sc == "unchanged":
                    lkey = "xxh3"
                limit = g(lkey)
                name = r["system"]
                if r["system"] in ("torch", "safetensors"):
                    name += " + fsync" if var == "durable" else " (no fsync)"
                notes = []
                first = r["runs"][-1]
                if "chunks_new" in first:
                    notes.append(
                        f"new {first['chunks_new']}/reused {first['chunks_reused']} "
                        f"chunks, {first['new_codecs'] or 'no new'}, stored/raw "
                        f"{first['new_stored_over_raw']:.2f}"
                    )
                if r["system"] == "dcp":
                    notes.append("FileSystemWriter defaults (sync_files=True, 1 thread)")
                if r["system"].startswith("deltackpt"):
                    notes.append(f"RSS {C.fmt_bytes(first['rss_after'])} after")
                if r.get("error"):
                    notes.append(f"later rep FAILED: {r['error'][:80]}")
                tb = base.get((sc, var))
                srows.append(
                    [
                        sc,
                        name,
                        f"{med:.3f}",
                        f"{min(secs):.3f}-{max(secs):.3f} (n={len(secs)})",
                        f"{gbps:.2f}",
                        f"{tb / med:.2f}x" if tb else "-",
                        f"{100 * gbps / limit:.0f}% {lkey}" if limit else "-",
                        C.fmt_bytes(C.median([x["bytes_added"] for x in r["runs"]])),
                        "; ".join(notes),
                    ]
                )
    out.append(
        "\nSaves (GB/s = state bytes / time; t_torch/t > 1 means faster than torch.save "
        "with the same durability):\n"
    )
    out.append(
        C.md_table(
            [
                "scenario",
                "system",
                "median s",
                "range",
                "GB/s",
                "t_torch/t",
                "% of limit",
                "bytes added",
                "notes",
            ],
            srows,
        )
    )
    muts = {r["scenario"]: r["mutations"] for r in saves if r["system"] == saves[0]["system"]}
    for sc in ("10pct", "step"):
        m = [x for x in muts.get(sc, []) if x]
        if m:
            out.append(
                f"\n{sc}: "
                + "; ".join(
                    json.dumps(
                        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()}
                    )
                    for x in m
                )
            )

    loads = [r for r in result["rows"] if r["op"] == "load"]
    lbase = {
        (r["mode"], r["cache"]): C.median([x["seconds"] for x in r["runs"]])
        for r in loads
        if r["system"] == "torch"
    }
    lrows2 = []
    how = {
        ("torch", "new"): "torch.load(weights_only=True)",
        ("torch", "into"): "torch.load(mmap=True) + copy_",
        ("safetensors", "new"): "load_file + clone()",
        ("safetensors", "into"): "load_file + copy_",
        ("dcp", "new"): "torch.empty + dcp.load",
        ("dcp", "into"): "dcp.load in place",
        ("deltackpt", "new"): "deltackpt.load (verify=True)",
        ("deltackpt", "into"): "deltackpt.load(into=) (verify=True)",
        ("deltackpt-ng", "new"): "deltackpt.load, small_bytes=0 store",
        ("deltackpt-ng", "into"): "deltackpt.load(into=), small_bytes=0 store",
        ("deltackpt-raw", "new"): "deltackpt.load, raw chunks",
        ("deltackpt-raw", "into"): "deltackpt.load(into=), raw chunks",
    }
    for r in loads:
        errs = [x["error"] for x in r["runs"] if "error" in x]
        if errs:
            lrows2.append(
                [
                    f"{r['mode']} {r['cache']}",
                    r["system"],
                    how.get((r["system"], r["mode"]), ""),
                    "FAILED",
                    "",
                    "",
                    "",
                    "",
                    "NO: " + errs[0][:120],
                ]
            )
            continue
        secs = [x["seconds"] for x in r["runs"]]
        med = C.median(secs)
        gbps = nbytes / med / C.GB
        lkey = f"read_{r['cache']}" + ("_fresh" if r["mode"] == "new" else "")
        limit = g(lkey)
        tb = lbase.get((r["mode"], r["cache"]))
        exact = all(x["exact"] for x in r["runs"])
        ties = [x.get("ties_kept") for x in r["runs"] if "ties_kept" in x]
        bad = r["runs"][0]
        ex = (
            "yes"
            if exact
            else (
                f"NO: {bad['n_mismatch']} of {bad['checked']} tensors differ, "
                f"{bad['n_missing']} missing, e.g. {bad['mismatch'][:2]}"
            )
        )
        if ties:
            ex += ", ties kept" if all(ties) else ", ties NOT kept"
        lrows2.append(
            [
                f"{r['mode']} {r['cache']}",
                r["system"],
                how.get((r["system"], r["mode"]), ""),
                f"{med:.3f}",
                f"{min(secs):.3f}-{max(secs):.3f} (n={len(secs)})",
                f"{gbps:.2f}",
                f"{tb / med:.2f}x" if tb else "-",
                f"{100 * gbps / limit:.0f}% {lkey}" if limit else "-",
                ex,
            ]
        )
    for k, v in result.get("deltackpt_latest_chains", {}).items():
        out.append(
            f"\n{k} latest snapshot: {v['chunks']} chunks {v['codecs']}, xor chain depth "
            f"mean {v['mean_xor_depth']} max {v['max_xor_depth']}; a load reads "
            f"{C.fmt_bytes(v['pack_bytes_read'])} of packs for {C.fmt_bytes(v['raw_bytes'])}"
            " of chunks"
        )
    out.append("\nLoads of the last saved state (t_torch/t vs torch in the same mode/cache):\n")
    out.append(
        C.md_table(
            [
                "load",
                "system",
                "how",
                "median s",
                "range",
                "GB/s",
                "t_torch/t",
                "% of limit",
                "bit-exact",
            ],
            lrows2,
        )
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen0.5b", choices=["qwen0.5b"])
    ap.add_argument("--state", default="weights", choices=["weights", "train"])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layers and vocab")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--systems",
        default="torch,safetensors,dcp,deltackpt,deltackpt-raw",
        help=f"comma list from {','.join(SYSTEMS)}",
    )
    ap.add_argument("--no-cold", action="store_true", help="skip drop_caches cold loads")
    ap.add_argument(
        "--into-cold",
        action="store_true",
        help="also time load(into=...) cold (off by default to keep the run short)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints go (default bench-out/work-<pid>; removed at the end)",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON result path")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    args = ap.parse_args()

    t_start = time.perf_counter()
    work = args.workdir or (C.OUT_DIR / f"work-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = (
        args.out or C.OUT_DIR / f"saveload-{args.state}-{args.model}-s{args.scale:g}-{stamp}.json"
    )

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    try:
        import safetensors

        import deltackpt

        minfo = C.machine_info()  # at the start: loadavg_start really is the start
        fingerprint = code_fingerprint()
        log(f"deltackpt code: {fingerprint}")
        log(f"building {args.state} state, scale {args.scale}")
        bs = BenchState(args.state, args.scale)
        nbytes = C.logical_bytes(bs.state)
        n_params = sum(
            t.numel()
            for _, t in C.unique_tensors(bs.state if args.state == "weights" else bs.state["model"])
        )
        state_info = {
            "kind": args.state,
            "model": args.model,
            "scale": args.scale,
            "params": n_params,
            "logical_bytes": nbytes,
            "tensors": len(C.flat_tensors(bs.state)),
            "build_seconds": bs.build_seconds,
        }
        log(
            f"state: {n_params / 1e6:.1f}M params, {nbytes / C.GB:.3f} GB, "
            f"{state_info['tensors']} tensor entries"
        )

        log("measuring machine limits")
        limits = C.measure_limits(work / "limits", min(nbytes, 4 << 30), args.reps)
        for k, v in limits.items():
            log(f"  {k}: {v.get('gbps', v.get('ok'))}")
        cold_ok = limits["drop_caches_ok"]["ok"] and not args.no_cold

        names = [n for n in args.systems.split(",") if n]
        # Warm-up: imports, first-call costs (DCP planning code, thread pools) on a tiny state.
        tiny = {"a": torch.randn(1000), "b": {"c": torch.ones(3, dtype=torch.bfloat16)}, "n": 1}
        for n in names:
            s = SYSTEMS[n](work / "warmup")
            s.save(tiny, fresh=True)
            s.load_new(tiny)
            s.load_into(C.map_tensors(tiny, torch.zeros_like))
        shutil.rmtree(work / "warmup")

        systems = [SYSTEMS[n](work) for n in names]
        log("saves")
        rows = run_saves(bs, systems, args.reps, log)
        bs.drop_grads()
        rss_after_saves = rss_bytes()
        import deltackpt.store.store

        deltackpt.store.store._STORES.clear()  # free deltackpt's staging arenas before loading
        gc.collect()
        log(
            f"RSS after saves {rss_after_saves / C.GB:.2f} GB, after dropping deltackpt stores "
            f"{rss_bytes() / C.GB:.2f} GB"
        )
        chains = {
            s.name: chain_stats(s.path())
            for s in systems
            if isinstance(s, DeltackptSystem) and s.latest is not None
        }
        for k, v in chains.items():
            log(f"  {k} latest snapshot: {v}")
        log("loads")
        rows += run_loads(bs, systems, args.reps, cold_ok, args.into_cold, log)

        result = {
            "bench": "saveload",
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": minfo,
            "versions": {
                "safetensors": safetensors.__version__,
                "deltackpt": deltackpt.__version__,
            },
            "deltackpt_threads": deltackpt.SaveOptions().threads,
            "deltackpt_code": fingerprint,
            "state": state_info,
            "limits": limits,
            "deltackpt_latest_chains": chains,
            "rows": rows,
            "total_seconds": time.perf_counter() - t_start,
            "rss": {
                "after_saves": rss_after_saves,
                "peak_vmhwm": vmhwm_bytes(),
                "state_bytes": nbytes,
            },
            "loadavg_end": os.getloadavg(),
        }
        table = summarize(result)
        result["markdown"] = table
        C.write_json(out_path, result)
        print()
        print(
            f"## bench_saveload: {args.state} {args.model} scale {args.scale:g}: "
            f"{n_params / 1e6:.1f}M params, {nbytes / C.GB:.3f} GB "
            f"({minfo['date']}, {minfo['cpus']} cpus, load average "
            f"{minfo['loadavg_start'][0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
            f"{result['total_seconds']:.0f} s)\n"
        )
        print(table)
        print(f"\nwrote {out_path} ({result['total_seconds']:.0f} s total)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
