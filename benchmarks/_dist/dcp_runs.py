"""DCP's part of the real run: ``dcp.save`` full and after a step (with and without plan
caching), ``dcp.load`` into both layouts, ``dcp.async_save``; planner and writer subclasses
record plan and metadata sizes."""

from __future__ import annotations

import gc
import os
import pickle
import time
from pathlib import Path
from typing import Any

import _common as C

from _dist import log
from _dist.rank import RankBase


class DcpRuns(RankBase):
    def run_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        rank = self.rank
        stats: dict[str, Any] = {}

        class RecPlanner(DefaultSavePlanner):
            def create_local_plan(self):  # type: ignore[no-untyped-def]
                p = super().create_local_plan()
                stats.setdefault("local_plan_bytes", []).append(len(pickle.dumps(p)))
                return p

            def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                out = super().create_global_plan(all_plans)
                stats.setdefault("global_plan_ms", []).append(
                    round((time.perf_counter() - t0) * 1e3, 1)
                )
                stats.setdefault("gathered_plan_bytes", []).append(
                    sum(len(pickle.dumps(p)) for p in all_plans)
                )
                stats.setdefault("scattered_plan_bytes", []).append(
                    sum(len(pickle.dumps(p)) for p in out[0])
                )
                return out

        class RecWriter(FileSystemWriter):
            def finish(self, metadata, results):  # type: ignore[no-untyped-def]
                stats.setdefault("gathered_results_bytes", []).append(
                    sum(len(pickle.dumps(r)) for r in results)
                )
                super().finish(metadata, results)
                stats.setdefault("metadata_bytes", []).append(
                    os.path.getsize(os.path.join(self.path, ".metadata"))
                )

        def save(path: Path, caching: bool) -> Any:
            return dcp.save(
                self.state,
                storage_writer=RecWriter(str(path)),
                planner=RecPlanner(enable_plan_caching=caching),
                process_group=self.pg,
            )

        log("DCP") if rank == 0 else None
        reps = self.cfg["reps"]
        for label, do_step, caching in (
            ("save full (fresh dir)", False, False),
            ("save after step (rewrites all)", True, False),
            ("save after step, plan caching", True, True),
        ):
            secs, sizes = [], []
            stats.clear()
            for i in range(reps):
                if do_step:
                    self.step()
                path = self.work / f"dcp-{'c' if caching else 's' if do_step else 'f'}-{i}"
                self.rm(path)
                self.coll.clear()
                s, _ = self.timed(lambda p=path, c=caching: save(p, c))
                secs.append(s)
                stats.setdefault("coll", []).append(self.coll_sum())
                sizes.append(self.du(path))
                if label == "save full (fresh dir)" and i == reps - 1:
                    self.dcp_path = path
                    # load right away, while the state equals what was saved
                    self.rec(
                        "DCP",
                        label,
                        secs,
                        C.median(sizes),
                        bytes_each=sizes,
                        **{k: v for k, v in stats.items() if rank == 0 or k == "local_plan_bytes"},
                    )
                    self.checks[f"dcp_local_plan_bytes_rank{rank}"] = stats["local_plan_bytes"]
                    self.load_both(
                        "DCP",
                        lambda tgt, p=path: dcp.load(
                            tgt, storage_reader=FileSystemReader(str(p)), process_group=self.pg
                        ),
                    )
                else:
                    self.rm(path)
            C.trim()
            if label != "save full (fresh dir)":
                self.rec(
                    "DCP",
                    label,
                    secs,
                    C.median(sizes),
                    bytes_each=sizes,
                    **{k: v for k, v in stats.items() if k != "local_plan_bytes"},
                )
        self.rm(self.dcp_path)
        blk, tot, sizes = [], [], []
        for i in range(reps):
            self.step()
            path = self.work / f"dcp-a-{i}"
            self.rm(path)
            gc.collect()
            self.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(
                self.state, storage_writer=FileSystemWriter(str(path)), process_group=self.pg
            )
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            blk.append(self.max_over_ranks(t1 - t0))
            tot.append(self.max_over_ranks(t2 - t0))
            sizes.append(self.du(path))
            self.rm(path)
        self.rec("DCP", "async_save after step: blocking", blk, C.median(sizes))
        self.rec("DCP", "async_save after step: total (future)", tot)
        C.trim()
