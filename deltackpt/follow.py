"""``deltackpt.Follower``: follow a store a trainer publishes to, catching up incrementally.

A trainer saves (publishes) versions to a store, a local directory or an object store; a
follower (an inference engine, an evaluation worker, a rollout worker that restarted) polls it,
and when a newer committed snapshot exists it brings its weights from the version it holds to
that one with ``load(since=held)``: unchanged chunks are not read, xor deltas whose chain reaches
the held chunk are applied in place, the rest is read whole (see :mod:`deltackpt.loading.since`).

>>> f = deltackpt.Follower("s3://bucket/run", into=model.state_dict())      # doctest: +SKIP
>>> while training:
...     if (s := f.poll()) is not None:                 # None: nothing newer yet
...         print(s.version, s.mode, s.load.bytes_read)

or, for an engine that takes weights through ``load_weights(iterable of (name, tensor))``
(vLLM's and SGLang's model classes)::

    f = deltackpt.Follower(url, load_weights=model.load_weights, keys=["model"],
                           rename=lambda k: k.removeprefix("model/"))

Rules (those of live sync):

* **Lineage.** Only committed snapshots are seen (a manifest's presence is the commit, written
  after every byte it names), newest by commit order; a half-written version is never visible.
* **Fail closed.** The catch-up checks that the held state holds ``version`` (it hashes what it
  skips or patches) before writing anything; if not (someone changed the weights, a load was
  interrupted), :class:`~deltackpt.errors.HeldVersionMismatchError` and, with
  ``fallback="reload"`` (the default), a full load of the newest snapshot instead.
* **Fell behind.** When retention deleted the held snapshot, an incremental load is impossible:
  with ``fallback="reload"`` the follower loads the newest snapshot whole (``FollowStats.mode ==
  "full"``, ``reason`` says why); with ``fallback="raise"`` it raises
  :class:`~deltackpt.errors.FollowerBehindError` and ``reload()`` is the way back.
* **Leases.** The follower keeps a lease (``leases/<holder>.json``, see
  :mod:`deltackpt.store.leases`) on the snapshot it holds, renewed at each poll, so
  ``gc(keep_last=)`` and ``Checkpointer(keep_last=)`` keep it while the follower is alive; a
  lease costs the store that snapshot's unique bytes, and ends ``lease_ttl`` seconds after the
  last renewal (``lease_ttl=None``: no lease). Leases are best effort: correctness never depends
  on them.

Memory: with ``into`` the follower writes into the caller's tensors and keeps nothing but
staging for the changed chunks during a catch-up. With ``load_weights`` it keeps its own CPU
copy of every followed tensor (the engine's weights are not ``into``: they may be sharded,
fused or quantised), so it costs the size of the followed state in host memory, plus that
staging; the tensors handed to ``load_weights`` are that copy (read them during the call; copy
what you keep). ``boxes=`` holds only part of some tensors (a tensor-parallel rank's rows or
columns, :mod:`deltackpt.loading.boxed`): the copy is then the size of those boxes (changed
boxes are read again into it); ``load_weights`` gets the boxes.

A Follower is not thread-safe; one process follows with one Follower (no ``process_group``).
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt.distributed.load import load
from deltackpt.errors import (
    DeltackptError,
    FollowerBehindError,
    HeldVersionMismatchError,
    InvalidArgumentError,
    LeaseWarning,
    SnapshotNotFoundError,
)
from deltackpt.format.manifest import Manifest
from deltackpt.format.tree import flatten
from deltackpt.loading import boxed
from deltackpt.loading.assemble import check_into
from deltackpt.loading.changed import changed_keys
from deltackpt.loading.select import KeySelection, key_filter
from deltackpt.loading.stats import LoadStats
from deltackpt.options import LoadOptions
from deltackpt.store.leases import check_holder, check_lease_ttl, drop_lease, write_lease
from deltackpt.store.store import Store, open_store

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
FALLBACKS = ("reload", "raise")


@dataclass(frozen=True)
class FollowStats:
    """One version applied by :meth:`Follower.poll`.

    ``mode``: ``"incremental"`` (``load(since=previous)``), ``"full"`` (the whole snapshot:
    the first load, or a fallback; ``reason`` says which), or ``"resend"`` (no new version: the
    previous ``load_weights`` call failed, so every tensor was handed over again). ``changed``:
    the key paths whose bytes may have changed (all loaded keys for a full load); with
    ``load_weights`` exactly these were passed to it. ``load``: what the load read."""

    version: str
    previous: str | None
    mode: str
    reason: str = ""
    changed: tuple[str, ...] = ()
    load: LoadStats = field(default_factory=LoadStats)
    seconds: float = 0.0


class Follower:
    """Follow the snapshots published to ``store`` (see the module docstring).

    Give exactly one of ``into`` (a state dict, or any nested state ``load(into=)`` takes: its
    tensors are updated in place) or ``load_weights`` (called with ``(name, tensor)`` pairs of
    the tensors that changed; the follower keeps its own copy). ``keys`` follows only those key
    paths (as ``load(keys=)``); ``rename`` maps a key path to the name ``load_weights`` gets.
    ``since``: the snapshot ``into`` already holds (then the first poll is incremental too);
    without it the first poll loads the newest snapshot whole. ``holder`` names this follower's
    lease (default: host, pid and a random suffix); ``lease_ttl`` its lifetime in seconds after
    each renewal (None: no lease). ``fallback``: ``"reload"`` or ``"raise"`` (module docstring).
    ``boxes`` (``load_weights`` only): ``(name, shape) -> box or None``, asked per tensor with
    the name ``load_weights`` gets, the box (``.offset`` and ``.size`` per dimension, or a pair
    of them) of it to hold and hand over instead of the whole tensor (None: whole; False: none
    of it, never held nor handed over);
    :attr:`held_boxes` says which. A changed box is read again into the held one, so a failed
    catch-up leaves no version held (the next poll loads whole). Other keyword arguments are
    :class:`~deltackpt.LoadOptions` fields (``verify``, ``threads``).
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        *,
        into: Any = None,
        load_weights: LoadWeights | None = None,
        keys: KeySelection = None,
        rename: Callable[[str], str] | None = None,
        since: str | None = None,
        holder: str | None = None,
        lease_ttl: float | None = 600.0,
        fallback: str = "reload",
        storage_options: dict[str, Any] | None = None,
        boxes: boxed.BoxOf | None = None,
        options: LoadOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if (into is None) == (load_weights is None):
            raise InvalidArgumentError(
                "Follower() needs exactly one of into= (a state whose tensors are updated in "
                "place) and load_weights= (a callable taking (name, tensor) pairs); got "
                f"{'both' if into is not None else 'neither'}. Pass e.g. "
                "Follower(store, into=model.state_dict())"
            )
        check_into(into, "Follower")
        if load_weights is not None and not callable(load_weights):
            raise InvalidArgumentError(
                f"Follower(load_weights={load_weights!r:.80}): expected a callable taking an "
                "iterable of (name, tensor) pairs, e.g. model.load_weights"
            )
        if rename is not None and not callable(rename):
            raise InvalidArgumentError(
                f"Follower(rename={rename!r:.80}): expected a callable from key path to name, "
                "e.g. rename=lambda k: k.removeprefix('model/')"
            )
        if boxes is not None and (load_weights is None or not callable(boxes)):
            raise InvalidArgumentError(
                f"Follower(boxes={boxes!r:.80}): expected a callable (name, shape) -> box or "
                "None, with load_weights= (a follower into= tensors holds them whole)"
            )
        if since is not None and (into is None or not isinstance(since, str)):
            raise InvalidArgumentError(
                f"Follower(since={since!r:.80}) needs into= and a snapshot name: the snapshot "
                "into already holds. Drop since= to start with a full load"
            )
        if fallback not in FALLBACKS:
            raise InvalidArgumentError(
                f"Follower(fallback={fallback!r:.80}) is invalid: expected one of "
                f"{list(FALLBACKS)}. 'reload' loads the newest snapshot whole when the held one "
                "is gone or does not match; 'raise' raises instead"
            )
        check_lease_ttl(lease_ttl, "Follower")
        self.options = LoadOptions.from_kwargs(options, kwargs)
        self.keys = keys
        self._select = key_filter(keys)  # a bad keys= fails here
        self.store = open_store(store, create=False, storage_options=storage_options)
        self.into = into
        self.load_weights = load_weights
        self.rename = rename
        self.fallback = fallback
        self.lease_ttl = lease_ttl
        self.holder = check_holder(holder) if holder is not None else _default_holder()
        self.version: str | None = since
        #: the held snapshot's metadata (``{}`` before a load, or when it was gone by then)
        self.metadata: dict[str, Any] = {}
        self._created_ns: int | None = None  # of the held version's manifest (None: unknown)
        self._held: Any = None  # load_weights: the follower's own copy
        self.boxes = boxes
        self._plan: boxed.Plan = {}  # boxes: what _held holds of each tensor
        self._scratch = boxed.Scratch()  # boxes: reused for column boxes' covering rows
        self._resend = False  # load_weights failed: hand every tensor over at the next poll
        self._renewed = -float("inf")
        self._leased: list[str] = []

    # ------------------------------------------------------------------------------ public
    @property
    def state(self) -> Any:
        """The followed state: ``into``, or (``load_weights``) the follower's own copy (None
        before the first load; with ``boxes``, a flat dict of tensors and boxes by key path)."""
        return self.into if self.into is not None else self._held

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors the follower keeps of its own (``load_weights``: its copy, the
        boxes with ``boxes=``; 0 with ``into``, which is the caller's)."""
        if self.into is not None:
            return 0
        return sum(t.nbytes for t in self._leaves().values())

    @property
    def held_boxes(self) -> dict[str, Any]:
        """With ``boxes=``: per followed key path, ``(offset, size)`` of its box (None: whole;
        False: none of it held)."""
        return dict(self._plan)

    def adopt(
        self,
        version: str,
        state: Any,
        created_ns: int | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Start from ``state``, which already holds snapshot ``version`` (loaded and checked
        elsewhere: an engine's start from the same store), so that the next poll is a
        catch-up from it instead of a full load. ``load_weights`` followers only, before their
        first load; ``created_ns`` and ``metadata``: that snapshot's commit time and metadata
        as it was loaded (default: the store's now), so that a snapshot saved again under the
        name is not taken for it. ``state`` becomes the follower's own copy (as a full load's
        would)."""
        if self.into is not None or self._held is not None or self.version is not None:
            raise InvalidArgumentError(
                f"Follower.adopt({version!r:.80}): only a load_weights follower that holds "
                "nothing yet adopts a state; this one "
                + ("follows into= tensors" if self.into is not None else "holds a version")
            )
        m = None
        if self.boxes is not None:  # the copy must hold what this follower's boxes say
            m = self.store.manifest(version)
            plan = boxed.box_plan(m, self._select, self.boxes, self._rename)
            state, self._plan = boxed.check_held(state, plan, m), plan
        if created_ns is None or metadata is None:
            m = m or self.store.manifest(version)
            created_ns, metadata = m.created_ns, dict(m.metadata)
        self.version, self._created_ns, self._held = version, created_ns, state
        self.metadata = dict(metadata)

    def latest(self) -> str | None:
        """The newest committed snapshot of the store (by commit order), or None."""
        names = self.store.names()
        return names[-1] if names else None

    def poll(self, target: str | None = None) -> FollowStats | None:
        """Apply the newest committed snapshot if it is not the one held; None when it is (or
        the store has none yet, or retention deleted the newest while it was being loaded).
        ``target``: that committed snapshot instead of the newest (followers that must hold
        one version together, such as the tensor-parallel workers of one engine, poll the
        name one of them chose: a save committed between their polls would split them);
        :class:`~deltackpt.errors.SnapshotNotFoundError` when the store has no such snapshot.
        Raises what the load raises when it cannot fall back; on any
        error the held version is unchanged (with ``into``: ``into`` is unchanged), except after
        a failed *full* load or a failed catch-up of ``boxes``, which set ``version`` to None so
        the next poll loads whole."""
        if self._resend and self._held is not None and self.version is not None:
            return self._hand_over(
                self.version, self.version, "resend", "", None, LoadStats(), time.perf_counter()
            )
        found = self.store.manifests()  # committed, oldest first (by commit time)
        if target is not None:
            if not isinstance(target, str):
                raise InvalidArgumentError(
                    f"Follower.poll(target={target!r:.80}): expected a snapshot name or None"
                )
            named = [m for m in found if m.name == target]
            if not named:
                raise SnapshotNotFoundError(
                    f"follower {self.holder!r}: store {str(self.store.root)!r} has no committed "
                    f"snapshot {target!r} to poll (retention deleted it, or it was never "
                    "saved); poll() without target= takes the newest"
                )
            newest = named[-1]
        elif found:
            newest = found[-1]
        else:
            newest = None
        if newest is None or self._holds(newest):
            self._renew()
            return None
        behind = self.version is not None and not any(self._holds(m) for m in found)
        target = newest.name
        try:
            return self._apply(target, behind=behind)
        except SnapshotNotFoundError as e:
            if isinstance(e, FollowerBehindError) or self.store.has(target):
                raise
            return None  # retention deleted the newest meanwhile: the next poll takes the newest

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> FollowStats | None:
        """Poll every ``interval`` seconds until a newer snapshot is applied; return its stats,
        or None when ``timeout`` seconds passed first (None: wait for ever)."""
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise InvalidArgumentError(
                f"Follower.wait(interval={interval!r:.40}): expected seconds > 0, e.g. 0.5"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self.poll()
            if got is not None:
                return got
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = interval if deadline is None else min(interval, deadline - time.monotonic())
            time.sleep(max(left, 0.0))

    def reload(self, name: str | None = None) -> FollowStats:
        """Load snapshot ``name`` (default: the newest) whole, whatever is held."""
        target = name or self.latest()
        if target is None:
            raise SnapshotNotFoundError(
                f"store {str(self.store.root)!r} has no committed snapshot to follow yet; wait "
                "for the trainer's first save (Follower.wait())"
            )
        return self._full(target, "reload() asked for it", time.perf_counter())

    def close(self) -> None:
        """Drop this follower's lease (retention may then delete what it held)."""
        if self._leased:
            try:
                drop_lease(self.store.storage, self.holder)
            except (OSError, DeltackptError) as e:
                warnings.warn(f"follower {self.holder!r}: could not drop its lease ({e}); it "
                              "expires by itself", LeaseWarning, stacklevel=2)  # fmt: skip
            self._leased = []

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        st = getattr(self, "store", None)
        where = str(st.root) if st is not None else "?"
        return f"Follower({where!r}, version={getattr(self, 'version', None)!r})"

    # ----------------------------------------------------------------------------- private
    def _holds(self, m: Manifest) -> bool:
        """``m`` is the snapshot held (a snapshot saved again under the same name is not)."""
        return m.name == self.version and self._created_ns in (None, m.created_ns)

    def _apply(self, target: str, behind: bool) -> FollowStats | None:
        t0 = time.perf_counter()
        held = self.version
        if held is None or (self.into is None and self._held is None):
            return self._full(target, "first load", t0)
        if behind:
            return self._fall_back(
                target, held, f"held snapshot {held!r} was deleted (or saved again)", t0
            )
        self._renew([held, target], force=True)  # keep both alive while loading
        stats = LoadStats()
        try:  # both manifests first: once into is patched, held may go (retention) any time
            m_target, m_held = self.store.manifest(target), self.store.manifest(held)
            if self.boxes is not None:
                plan = boxed.box_plan(m_target, self._select, self.boxes, self._rename)
                if plan != self._plan:  # tensors or boxes not those held
                    why = f"the tensors or boxes of {target!r} differ from those held"
                    return self._full(target, why, t0)
                changed = changed_keys(m_target, m_held, self._select)
                self._boxed_catch_up(m_target, held, changed, stats)
                return self._hand_over(target, held, "incremental", "", changed, stats, t0)
            load(self.store, target, into=self.state, since=held, keys=self.keys,
                 options=self.options, stats=stats)  # fmt: skip
        except HeldVersionMismatchError as e:
            if self.fallback == "raise":
                raise
            return self._full(target, f"held state does not match {held!r} at key {e.key!r}", t0)
        except SnapshotNotFoundError:
            if self.store.has(held) or not self.store.has(target):
                raise  # the target went: poll() returns None, the next poll takes the newest
            why = f"held snapshot {held!r} was deleted (or saved again)"
            return self._fall_back(target, held, why, t0)
        changed = changed_keys(m_target, m_held, self._select)
        return self._hand_over(target, held, "incremental", "", changed, stats, t0)

    def _fall_back(self, target: str, held: str, why: str, t0: float) -> FollowStats:
        if self.fallback == "raise":
            raise FollowerBehindError(
                f"follower {self.holder!r} holds snapshot {held!r}, which store "
                f"{str(self.store.root)!r} no longer has (retention deleted it), so it cannot "
                f"catch up to {target!r} incrementally. Call reload() to load {target!r} whole; "
                "keep a lease (lease_ttl=) and poll more often than the trainer's retention "
                "window to stay incremental",
                held=held,
                latest=target,
            )
        return self._full(target, why, t0)

    def _full(self, target: str, why: str, t0: float) -> FollowStats:
        held, stats = self.version, LoadStats()
        self._renew([target], force=True)
        self.version = None  # a failed full load leaves a partly loaded state
        if self.into is not None:
            load(self.store, target, into=self.into, keys=self.keys, options=self.options,
                 stats=stats)  # fmt: skip
        elif self.boxes is not None:
            self._held, self._plan = None, {}  # one copy at a time, as below
            m = self.store.manifest(target)
            plan = boxed.box_plan(m, self._select, self.boxes, self._rename)
            self._held = boxed.read(self.store, m, plan, self.options, stats,
                                    scratch=self._scratch)  # fmt: skip
            self._plan = plan
        else:
            self._held = None  # drop the old copy first: peak memory is one copy, not two
            self._held = load(self.store, target, keys=self.keys, options=self.options,
                              stats=stats)  # fmt: skip
        return self._hand_over(target, held, "full", why, None, stats, t0)

    def _hand_over(
        self,
        target: str,
        previous: str | None,
        mode: str,
        why: str,
        changed: list[str] | None,
        stats: LoadStats,
        t0: float,
    ) -> FollowStats:
        """The load is done: record the version, renew the lease, call ``load_weights``."""
        self.version = target
        try:
            m = self.store.manifest(target)
            self._created_ns, self.metadata = m.created_ns, dict(m.metadata)
        except SnapshotNotFoundError:  # deleted already: the next poll falls back
            self._created_ns, self.metadata = None, {}
        self._renew([target], force=True)
        leaves = self._leaves()
        keys = list(leaves) if changed is None else [k for k in changed if k in leaves]
        if self.load_weights is not None:
            self._resend = True  # cleared only once load_weights returned
            self.load_weights((self._rename(k), leaves[k]) for k in keys)
            self._resend = False
        return FollowStats(target, previous, mode, why, tuple(keys), stats,
                           time.perf_counter() - t0)  # fmt: skip

    def _boxed_catch_up(self, m: Manifest, held: str, changed: list[str], stats: LoadStats) -> None:
        """With ``boxes``: the tensors held whole caught up from ``held`` in place (which fails
        closed before writing), then the changed boxes read again into the held ones (no second
        copy of them: the memory is what boxes save). A failure after the first write leaves
        the copy between versions: the follower then holds none, and its next poll loads whole
        (as after a failed full load)."""
        plan = self._plan

        def whole(p: str) -> bool:  # values too: they are not boxed (False: not held at all)
            return (self._select is None or self._select(p)) and plan.get(p) is None

        load(self.store, m.name, into=self._held, since=held, keys=whole, options=self.options,
             stats=stats)  # fmt: skip
        try:
            boxed.read(self.store, m, {p: plan[p] for p in changed if plan.get(p)},
                       self.options, stats, into=self._held, scratch=self._scratch)  # fmt: skip
        except BaseException:
            self.version = None
            raise

    def _rename(self, k: str) -> str:
        return self.rename(k) if self.rename is not None else k

    def _leaves(self) -> dict[str, torch.Tensor]:
        state = self.state
        if state is None:
            return {}
        if self.boxes is not None:  # a flat dict by key path (boxed.read)
            return dict(state)
        _, found = flatten(state, allow_pickle=True, check_tensors=False)
        return {x.path: x.tensor for x in found if self._select is None or self._select(x.path)}

    def _renew(self, names: list[str] | None = None, force: bool = False) -> None:
        """Write (or renew) this follower's lease; a failure warns and is retried later."""
        if self.lease_ttl is None:
            return
        names = names if names is not None else ([self.version] if self.version else [])
        now = time.monotonic()
        if not names or (
            not force and names == self._leased and now - self._renewed < self.lease_ttl / 3
        ):
            return
        try:
            with self.store.lock(exclusive=False, timeout=1.0, what="writing a follower lease"):
                write_lease(self.store.storage, self.holder, names, self.lease_ttl)
        except (OSError, DeltackptError) as e:
            warnings.warn(
                f"follower {self.holder!r}: could not write its lease on {names} ({e}); retrying "
                "at the next poll. Meanwhile retention may delete the held snapshot (the follower "
                "then reloads whole). On a store this process cannot write, pass lease_ttl=None",
                LeaseWarning,
                stacklevel=3,
            )
            return
        self._leased, self._renewed = list(names), now


def _default_holder() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40].strip(".-_") or "host"
    return f"follower-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
