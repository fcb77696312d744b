"""THE save sequence, for one process (a world of one) or every rank of a process group.

``deltackpt.save`` and ``deltackpt.async_save`` run these steps, with or without
``process_group`` (as DCP's ``_save_state_dict`` does through ``_DistWrapper``). Without one the
process is rank 0 of a world of one: the collectives return at once (dist/collectives.py) and a
failure raises the original exception. With one, every rank calls with its local state (DTensor
shards, replicated values), and if any rank fails every rank raises the same
:class:`~deltackpt.errors.DistributedError` naming the failing ranks.

1. plan (every rank, caller's thread; saving/engine.py, saving/plan.py): wait for the store's
   previous save, take the store lock (shared), check the name and the store
   (saving/commit.py), plan the state into chunks;
2. stage (every rank, caller's thread; saving/stage.py): hash every chunk in place, copying
   what must outlive the call (delta bases; in a world of one, an async save's new chunks);
3. agree (collective; dist/save_plan.py): ``gather`` -> rank 0 each rank's plan message (full,
   or only the changed digests); rank 0 merges the plans, checks the store's index and assigns
   every new chunk to one holder, and checks that plain values are the same on every rank
   (dist/replicas.py; if not, one more gather of per-key hashes names them); ``scatter`` ->
   each rank its chunks, or every rank the failures. An async save then copies its assigned chunks: the caller is unblocked here;
4. write (every rank, any thread, no collectives; saving/write.py): encode, append and fsync
   the assigned chunks into this rank's own pack files;
5. gather (collective; for async saves over a group, files under the store's tmp/, since
   background threads never run collectives) -> rank 0: each rank's written chunks, or its
   failure;
6. commit (rank 0; saving/commit.py): build the manifest and publish it only if every rank
   succeeded; ``broadcast`` the outcome, so every rank returns the same SnapshotInfo or raises.
   Each rank then keeps its next delta bases and plan cache (saving/engine.py).

A rank that fails a step still takes part in the next collective with its failure, so the
others raise at once. One deadline bounds every wait for a peer: the process group's timeout
(``init_process_group(timeout=...)`` / ``new_group(timeout=...)``; dist/collectives.py
``group_timeout``). torch enforces it on the collectives; the file rendezvous of an async save's
background phase enforces it on each of its waits. A rank that dies or hangs therefore makes
every survivor raise a DistributedError naming it within about that timeout, after which the
survivor releases the store lock. Nothing is committed (unless rank 0 vanished after its commit
began: then the error says so) and earlier snapshots are untouched. Only the wait for the store
lock itself (a gc, not a peer) is ``lock_timeout``.
"""

from __future__ import annotations

import pickle
import time
import warnings
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from deltackpt.distributed.collectives import Failed, FileRendezvous, Group
from deltackpt.distributed.replicas import (
    Compare,
    detail,
    mismatch_failure,
    suspects,
    values_digest,
)
from deltackpt.distributed.save_plan import (
    GlobalPlan,
    Layout,
    PlanCache,
    RankMsg,
    Resend,
    merge,
    plan_globally,
    rank_message,
    remember,
    remember_all,
    snapshot_parts,
    stale_ranks,
)
from deltackpt.errors import DeltackptError, DistributedError, RankFailure
from deltackpt.format.manifest import ChunkRecord
from deltackpt.saving.commit import Timing, commit
from deltackpt.saving.engine import Prepared, SaveHandle, SaveRequest, StoreSaver
from deltackpt.saving.stage import DeltaRef
from deltackpt.saving.write import WriteResult, hash_chunks, write_chunks
from deltackpt.store.storage import TMP
from deltackpt.store.store import SnapshotInfo, Store, store_io_error


@dataclass
class Written:
    """Step 5's message: the chunks one rank wrote (step 4), or why it could not."""

    records: dict[str, ChunkRecord] = field(default_factory=dict)
    pack_bytes: int = 0
    error: RankFailure | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "records": {k: r.to_json() for k, r in self.records.items()},
            "pack_bytes": self.pack_bytes,
            "error": None if self.error is None else self.error.to_json(),
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Written:
        err = doc.get("error")
        return Written(
            {k: ChunkRecord.from_json(v) for k, v in doc["records"].items()},
            int(doc["pack_bytes"]),
            None if err is None else RankFailure.from_json(err),
        )


class SaveRun:
    """One save on one rank: the steps of the module docstring, in order."""

    def __init__(self, saver: StoreSaver, group: Group, req: SaveRequest) -> None:
        self.saver, self.group, self.req, self.st = saver, group, req, req.store
        self.cache = saver.group_cache(group.key, PlanCache) if group.distributed else None
        self.p: Prepared | None = None
        self.layout: Layout | None = None
        self.mine: set[int] | None = None  # chunks this rank writes; None: all the store lacks
        self.plan: GlobalPlan | None = None  # rank 0's decision
        self.plan_bytes = 0
        self.wr: WriteResult | None = None
        self.bases_before: Mapping[str, DeltaRef] = {}
        self.cause: BaseException | None = None  # this rank's own failure, if any
        self._differ: dict[str, list[int]] = {}  # rank 0: plain tensors that differ by rank

    # ------------------------------------------------------------ steps 1-3 (caller's thread)

    def prepare(self, state: Any, background: bool) -> None:
        """Steps 1-3; when this returns the caller may mutate ``state`` (async saves)."""
        g, req = self.group, self.req
        msg: RankMsg | None = None
        try:
            self.p = p = self.saver.prepare(state, req, background, stage_new=not g.distributed)
            if p.digests is None and g.distributed:  # CUDA: the plans must carry digests
                p.staged.wait()
                pool = self.saver.pool(req.options.threads)
                p.digests = hash_chunks(p.plan, p.staged.arrays.__getitem__, pool, p.group_bufs)
            if p.digests is not None:
                self.layout = Layout.of(p.plan)
                msg = rank_message(g.rank, self.layout, p.digests, self.cache)
                msg.values = values_digest(p.plan.tree) if g.distributed else ""
        except Exception as e:
            self.cause = e
            msg = RankMsg(g.rank, "", error=RankFailure.of(g.rank, "plan", e))
        # A world of one on CUDA has nothing to agree on: step 4 hashes the staged copies and
        # writes every chunk the store lacks. Every other rank takes part, failed or not.
        if g.distributed or self.p is None or self.p.digests is not None:
            gathered = g.gather(msg)
            mine = g.scatter(self._decide(gathered, True) if gathered is not None else None)
            if isinstance(mine, Resend):  # rank 0 lacks the base of some rank's changes
                if self.layout is not None and self.p is not None and self.p.digests is not None:
                    values = msg.values if msg is not None else ""
                    msg = rank_message(g.rank, self.layout, self.p.digests, self.cache, full=True)
                    msg.values = values
                gathered = g.gather(msg)
                mine = g.scatter(self._decide(gathered, False) if gathered is not None else None)
            if isinstance(mine, Compare):  # some plain values may differ: which (replicas.py)
                details = g.gather(detail(self.p.plan, mine.keys) if self.p is not None else {})
                mine = g.scatter(self._judge(details) if details is not None else None)
            if isinstance(mine, Failed):
                self._fail(mine)
            assert self.p is not None
            self.mine = mine
            self.saver.stage_owned(self.p, mine)
        assert self.p is not None
        self.p.blocked = time.perf_counter() - req.start

    def _decide(self, msgs: list[RankMsg], may_resend: bool) -> list[set[int] | Failed | Resend]:
        """Rank 0, step 3: every rank's chunks to write, or the failures for every rank, or
        (once per save) :class:`Resend` to every rank when a rank's changes cannot be applied."""
        g, p = self.group, self.p
        errors = tuple(m.error for m in msgs if m.error is not None)
        if errors or p is None:
            return [Failed(errors)] * g.world
        if may_resend and stale_ranks(msgs, self.cache):
            return [Resend()] * g.world
        try:
            index = p.index if p.index is not None else self.st.chunk_index()
            self.plan = plan_globally(msgs, self.cache, index, {g.rank: p.copies.new})
            if g.distributed:
                self.plan_bytes = sum(len(pickle.dumps(m)) for m in msgs)
        except Exception as e:
            self.cause = e
            return [Failed((RankFailure.of(g.rank, "plan", e),))] * g.world
        if g.distributed and self.req.options.replicated == "check":
            self._differ, unsure = suspects(self.plan.resolved, [m.values for m in msgs])
            if unsure:
                return [Compare(unsure)] * g.world
            return self._judge(None)
        return list(self.plan.owned)

    def _judge(self, details: list[dict[str, str]] | None) -> list[set[int] | Failed]:
        """Rank 0: every rank's chunks to write, or every rank the keys whose plain values
        differ between ranks (distributed/replicas.py)."""
        failure = mismatch_failure(self._differ, details)
        if failure is not None:
            return [Failed((failure,))] * self.group.world
        assert self.plan is not None
        return list(self.plan.owned)

    # ------------------------------------------------------------ step 4 (any thread)

    def write(self) -> Written:
        p, req, opts = self.p, self.req, self.req.options
        assert p is not None
        try:
            p.staged.wait()
            pool = self.saver.pool(opts.threads)
            arrays = p.staged.arrays.__getitem__
            if self.mine is None:  # a world of one on CUDA or copied first: hash and dedupe here
                index = self.st.chunk_index()
                self.wr = write_chunks(
                    self.st, p.plan, arrays, opts, pool, index, None, name=req.name,
                    group_bufs=p.group_bufs,
                )  # fmt: skip
                p.digests, p.index = self.wr.digests, index
            else:
                bases = self.saver.delta_bases if p.use_refs else None
                self.bases_before = bases or {}
                self.wr = write_chunks(
                    # the index only vouches for xor bases here; ``owned`` decides what to write
                    self.st, p.plan, arrays, opts, pool, p.index or {}, bases, digests=p.digests,
                    owned=self.mine, group_bufs=p.group_bufs, chunk_data=p.copies.data,
                    name=req.name,
                )  # fmt: skip
            return Written(dict(self.wr.written), self.wr.pack_bytes)
        except Exception as e:
            self.cause = _typed_io_error(e, self.st, req.name)
            return Written(error=RankFailure.of(self.group.rank, "write", self.cause))

    # ------------------------------------------------------------ steps 5-6

    def finish(self, written: Written, files: FileRendezvous | None = None) -> SnapshotInfo:
        """Steps 5-6 through collectives (caller's thread) or ``files`` (background threads)."""
        g = self.group
        if files is None:
            results = g.gather(written)
            outcome = self._commit(results) if results is not None else None
            return self._settle(g.broadcast(outcome))
        within = f"within {files.timeout:g} s (the process group's timeout): it died or hangs"
        docs = files.gather(written.to_json())
        if docs is not None:  # rank 0
            results = [
                Written.from_json(d)
                if d is not None
                else Written(error=RankFailure(r, "write", "TimeoutError", f"no report {within}"))
                for r, d in enumerate(docs)
            ]
            outcome = self._commit(results)
            files.broadcast(
                {"name": outcome.name} if isinstance(outcome, SnapshotInfo) else
                {"failures": outcome.to_json()}
            )  # fmt: skip
            return self._settle(outcome)
        doc = files.broadcast(None)
        if doc is None:
            if files.missing == "rank-0.json":  # rank 0 never finished writing: no commit
                lost = RankFailure(0, "write", "TimeoutError", f"no report {within}")
            else:  # rank 0 may or may not have committed: _fail says nothing about that
                lost = RankFailure(0, "commit", "TimeoutError", f"no outcome {within}")
            return self._settle(Failed((lost,)))
        if "failures" in doc:
            return self._settle(Failed.from_json(doc["failures"]))
        return self._settle(self.st.info(doc["name"]))

    def _commit(self, results: list[Written]) -> SnapshotInfo | Failed:
        """Rank 0, step 6: publish the manifest if every rank wrote its chunks."""
        errors = tuple(w.error for w in results if w.error is not None)
        if errors:
            return Failed(errors)
        p, req, g = self.p, self.req, self.group
        assert p is not None and p.digests is not None
        try:
            gp = self.plan
            if gp is None:  # a world of one on CUDA: merged only now that its chunks are hashed
                resolved = [(Layout.of(p.plan), p.digests)]
                gp = GlobalPlan([], resolved, merge(resolved), [], p.index or {})
            written: dict[str, ChunkRecord] = {}
            for w in results:
                written.update(w.records)
            parts = snapshot_parts(
                req.name, p.plan, gp.resolved, gp.merged, written,
                sum(w.pack_bytes for w in results), req.metadata,
                {"world_size": g.world, "plan_bytes": self.plan_bytes} if g.distributed else None,
            )  # fmt: skip
            timing = Timing(req.start, p.blocked, p.waited)
            packs = self.wr.packs if self.wr is not None else ()
            return commit(
                self.st, parts, gp.index, timing, overwrite=req.options.overwrite, packs=packs
            )
        except Exception as e:
            self.cause = e
            return Failed((RankFailure.of(g.rank, "commit", e),))

    def _settle(self, outcome: SnapshotInfo | Failed) -> SnapshotInfo:
        """Every rank, after step 6: raise the failure, or keep what the next save builds on."""
        if isinstance(outcome, Failed):
            self._fail(outcome)
        p = self.p
        assert p is not None and p.digests is not None
        if self.cache is not None and self.layout is not None:
            remember(self.cache, self.layout, p.digests)
            if self.plan is not None:
                remember_all(self.cache, self.plan.msgs, self.plan.resolved)
        if self.wr is not None:  # chunks other ranks wrote are unknown here: depth unknown
            known = ChainMap(self.wr.written, p.index or {})
            self.saver.keep_delta_bases(
                p, self.bases_before, known, self.req.options.keyframe_every
            )
        if not self.group.distributed:  # a rank of N copies only its assigned chunks
            self.saver.prefault(p)
        return outcome

    # ------------------------------------------------------------ failures, cleanup

    def _fail(self, failure: Failed) -> NoReturn:
        if self.cache is not None:
            self.cache.structure = None  # the next save sends full plans
        committing = any(f.step == "commit" for f in failure.failures)
        after = "" if committing else "Nothing was committed; earlier snapshots are intact"
        self.group.raise_failed(
            f"distributed save of {self.req.name!r}", failure, self.cause, after
        )

    def lost(self, e: Exception) -> DistributedError:
        """The error for a collective that failed (a peer died or timed out)."""
        if self.cache is not None:
            self.cache.structure = None
        g = self.group
        return DistributedError(
            f"distributed save of {self.req.name!r} failed on rank {g.rank} of {g.world}: "
            f"{type(e).__name__}: {e}. No snapshot was committed; earlier snapshots are intact"
        )

    def close(self) -> None:
        if self.p is not None:
            self.p.locks.close()


def run_save(state: Any, saver: StoreSaver, group: Group, req: SaveRequest) -> SnapshotInfo:
    """Steps 1-6 in the caller's thread; returns once the snapshot is committed."""
    run = SaveRun(saver, group, req)
    try:
        run.prepare(state, background=False)
        return run.finish(run.write())
    except Exception as e:
        if isinstance(e, DistributedError) or not group.distributed:
            raise
        raise run.lost(e) from e
    finally:
        run.close()


def start_save(
    state: Any,
    saver: StoreSaver,
    group: Group,
    req: SaveRequest,
    after_commit: Callable[[], None] | None = None,
) -> SaveHandle:
    """Steps 1-3 now; steps 4-6 on the store's background thread, or now if this rank could not
    stage what it must write (memory budget). ``after_commit`` runs after a successful commit."""
    run = SaveRun(saver, group, req)
    try:
        epoch = group.broadcast(time.time_ns())  # one tmp/ name for every rank's files
        run.prepare(state, background=True)
    except BaseException as e:
        run.close()
        if isinstance(e, Exception) and group.distributed and not isinstance(e, DistributedError):
            raise run.lost(e) from e
        raise
    files = None
    if group.distributed:
        where = f"{TMP}/{req.name}.{epoch}.dist"  # swept by gc like any leftover in tmp/
        files = FileRendezvous(req.store.storage, where, group, group.timeout)

    def rest() -> SnapshotInfo:
        try:
            info = run.finish(run.write(), files)
        finally:
            run.close()
        _after(after_commit, req.name)
        return info

    assert run.p is not None
    if not run.p.background:  # nothing could be staged: write from the live tensors, now
        return saver.completed(req.name, rest())
    return saver.submit(req.name, rest, run.p.staged)


def _typed_io_error(e: Exception, st: Store, name: str) -> Exception:
    """A bare OSError from the write step (pack writes wrap their own) as a StoreIOError that
    keeps the errno and says what is intact (chained to ``e``); anything else unchanged."""
    if not isinstance(e, OSError) or isinstance(e, DeltackptError):
        return e
    err = store_io_error(
        e,
        f"saving {name!r} to store {str(st.root)!r} failed: {e}. Committed snapshots are intact; "
        f"{name!r} was not committed, and the next `deltackpt gc` deletes anything it left",
    )
    err.__cause__, err.__suppress_context__ = e, True  # as `raise err from e` would
    return err


def _after(hook: Callable[[], None] | None, name: str) -> None:
    """Run a post-commit hook (retention); its failure must not turn a committed save into an error."""
    if hook is None:
        return
    try:
        hook()
    except Exception as e:
        warnings.warn(
            f"post-commit hook after saving {name!r} failed: {e!r}", RuntimeWarning, stacklevel=1
        )
