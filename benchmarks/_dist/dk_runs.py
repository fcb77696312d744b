"""deltackpt's part of the real run: save full, unchanged and after a step, async_save, and
load the keyframe and the chain end (every rank, ``process_group=pg``)."""

from __future__ import annotations

import gc
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common as C
from _harness import stores

from _dist import log
from _dist.rank import RankBase, by_run


class DeltackptRuns(RankBase):
    def release_store(self, path: Path) -> None:
        """Benchmark hygiene: free a finished store's staging arenas (deltackpt keeps Store
        objects, and their arenas, alive per path for the life of the process)."""
        import deltackpt

        stores.release(deltackpt.open_store(path, create=False), forget=False)
        C.trim()

    def dk_save(self, path: Path, name: str, label: str, out: list[float], extra: dict) -> None:
        import deltackpt

        before = self.du(path)
        self.coll.clear()
        secs, info = self.timed(
            lambda: deltackpt.save(self.state, path, name, process_group=self.pg)
        )
        out.append(secs)
        coll = self.coll_sum()
        if self.rank == 0:
            extra.setdefault("coll", []).append(coll)
        added = self.du(path) - before
        if self.rank == 0:
            st = deltackpt.open_store(path)
            m = st.manifest(name)
            old = self.prev_chunks.get(str(path), set())
            codecs = Counter(r.codec for d, r in m.chunks.items() if d not in old)
            self.prev_chunks[str(path)] = old | set(m.chunks)
            extra.setdefault("bytes", []).append(added)
            extra.setdefault("bytes_written", []).append(info.bytes_written)
            extra.setdefault("plan_bytes", []).append(m.dist["plan_bytes"])
            extra.setdefault("manifest_bytes", []).append(st.manifest_size(name))
            extra.setdefault("chunks_new", []).append(info.chunks_new)
            extra.setdefault("codecs_new", []).append(dict(codecs))
            extra.setdefault("lib_seconds", []).append(round(info.seconds, 3))

    def run_deltackpt(self) -> None:
        import deltackpt

        reps = self.cfg["reps"]
        self.prev_chunks: dict[str, set[str]] = {}
        log("deltackpt") if self.rank == 0 else None
        full: list[float] = []
        fx: dict[str, Any] = {}
        for i in range(reps):
            path = self.work / f"dk-full-{i}"
            self.rm(path)
            if self.rank == 0:
                deltackpt.open_store(path)
            self.barrier()
            self.dk_save(path, "s0", "full", full, fx)
            last = i == reps - 1 or (i >= 1 and full[0] > 10)  # >10 s per save: 2 runs
            if not last:
                self.release_store(path)
                self.rm(path)
            else:
                break
        store = path
        self.store = store
        self.rec(
            "deltackpt",
            "save full (fresh store)",
            full,
            C.median(fx.get("bytes", [0])),
            **by_run(fx),
        )
        self.load_both(
            "deltackpt",
            lambda tgt: deltackpt.load(store, "s0", into=tgt, process_group=self.pg),
            "snapshot s0: the full save (keyframe)",
        )
        un: list[float] = []
        ux: dict[str, Any] = {}
        for i in range(reps):
            self.dk_save(store, f"u{i}", "unchanged", un, ux)
        self.rec(
            "deltackpt",
            "save unchanged (no step)",
            un,
            C.median(ux.get("bytes", [0])),
            **by_run(ux),
        )
        inc: list[float] = []
        ix: dict[str, Any] = {}
        for i in range(reps):
            self.step()
            self.dk_save(store, f"i{i}", "incremental", inc, ix)
        self.rec(
            "deltackpt",
            "save incremental (after step)",
            inc,
            C.median(ix.get("bytes", [0])),
            **by_run(ix),
        )
        # async, after a step each (same store: staging arenas already allocated)
        blk: list[float] = []
        tot: list[float] = []
        ax: dict[str, Any] = {}
        for i in range(reps):
            self.step()
            before = self.du(store)
            gc.collect()
            self.barrier()
            t0 = time.perf_counter()
            h = deltackpt.async_save(self.state, store, f"a{i}", process_group=self.pg)
            t1 = time.perf_counter()
            info = h.result(timeout=self.cfg["pg_timeout"])
            t2 = time.perf_counter()
            blk.append(self.max_over_ranks(t1 - t0))
            tot.append(self.max_over_ranks(t2 - t0))
            added = self.du(store) - before
            if self.rank == 0:
                ax.setdefault("bytes", []).append(added)
                ax.setdefault("lib_blocked", []).append(round(info.blocked_seconds, 3))
                m = deltackpt.open_store(store).manifest(f"a{i}")
                old = self.prev_chunks.get(str(store), set())
                ax.setdefault("codecs_new", []).append(
                    dict(Counter(r.codec for d, r in m.chunks.items() if d not in old))
                )
                self.prev_chunks[str(store)] = old | set(m.chunks)
        self.rec(
            "deltackpt",
            "async_save after step: blocking",
            blk,
            C.median(ax.get("bytes", [0])),
            **by_run(ax),
        )
        self.rec("deltackpt", "async_save after step: total (result())", tot)
        # the saved layout, to check the simulation's inputs
        from deltackpt.distributed.save_plan import Layout
        from deltackpt.saving.plan import plan_state

        st = deltackpt.open_store(store)
        self.checks[f"dk_layout_key_rank{self.rank}"] = Layout.of(
            plan_state(self.state, st.chunk_bytes, st.small_bytes)
        ).key()
        # every rank rebuilds the store's chunk index (all manifests) at every save
        ci = []
        for _ in range(3):
            t0 = time.perf_counter()
            idx = st.chunk_index()
            ci.append(round((time.perf_counter() - t0) * 1e3, 1))
        self.checks[f"chunk_index_ms_rank{self.rank}"] = {
            "ms": ci,
            "snapshots": len(st.names()),
            "records": len(idx),
        }
        self.release_store(store)
        name = f"a{reps - 1}"
        depth = stores.max_chain_depth(st, name) if self.rank == 0 else None
        self.load_both(
            "deltackpt",
            lambda tgt: deltackpt.load(store, name, into=tgt, process_group=self.pg),
            f"snapshot {name}: last of {2 * reps} incremental saves (xor chains, max depth {depth})",
        )
        self.rm(store)
