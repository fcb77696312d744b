"""A trainer's weight updates as checkpoint-coordinate patches: the wire format of vLLM's
``sparse_nccl`` backend (and of the delta receivers built like it), produced and kept in step
by deltackpt.

vLLM (>= 0.31) applies an update given as, per checkpoint tensor, its name, full shape, dtype,
and either its new values (dense) or the flat int32 indices of the changed elements and their
new values (sparse): ``load_checkpoint_weight_patches(model, patches)`` on the worker (the
model's own ``load_weights`` maps names, tensor-parallel shards and fused parameters), and the
``sparse_nccl`` trainer engine's ``send_weights(patches)`` broadcasts them. What it leaves to
the trainer is everything around them: which elements changed since what *the engine* holds,
in the engine's dtype (an fp32 master moves nearly every element each step; its bf16 cast moves
1-3% after an RL step), which tensors go dense (the first round, a tensor that changed too much,
a NaN value: NaN is vLLM's "unchanged" marker), and what happens after a failed update.
:class:`CheckpointPatcher` does that::

    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    rnd = patcher.diff(model.state_dict())            # the first round: every tensor dense
    ...send rnd.dense and rnd.sparse, apply them on the engine...
    patcher.commit(rnd)                               # the engine holds rnd.version now
    # (or, for an engine started from these weights: patcher.seed(model.state_dict()))

    rnd = patcher.diff(model.state_dict())            # after a step: the changed elements
    sparse_engine.send_weights(rnd.sparse)            # vLLM's SparseNCCLTrainerWeightTransferEngine
    patcher.commit(rnd)                               # or patcher.abandon(rnd) if it failed

**Bases.** The patcher keeps, per tensor, the bytes the engine was last told (its base: one copy
of the weights in the wire dtype, on the tensor's device where it has room, else in host memory:
``bases``), and diffs the next state against it:
host tensors with deltackpt's C loop (the changed words of each 64-word block found with one
comparison, 4-6 GB/s per core, GIL released, the tensors split over ``threads``), device tensors
with torch operations on the device (``format.device_changes``: one wait for all counts, then
each list at its known size; only the changed elements leave the comparison). A base moves only
at :meth:`~CheckpointPatcher.commit`: the sparse elements scattered into it, a dense tensor's
values taken as the new base (no copy; a round's tensors must not be written after
:meth:`~CheckpointPatcher.diff`).

**Dense or sparse**, per tensor: dense when the patcher has no base for it (the first round,
a new name, another shape or dtype), on an anchor round (``anchor_every``), after a failed
round carried it, when more than ``sparse_below`` of its elements changed (1/8 by default: a
sparse bf16 element costs 6 bytes on the wire against 2 for a dense one, so at 1/8 the patch is
3/8 of the tensor, and vLLM stages a full tensor for it either way), when a changed value is a
NaN, when its dtype is not a float vLLM can mask (float16, bfloat16, float32, float64), or when
it has 2**31 elements or more (int32 indices). vLLM cannot mix the two kinds in one call: a
round keeps them in two lists.

**Failure.** A patch carries absolute values, so applying it twice is harmless, but an engine
that failed part-way may hold some of a round's elements and not others; if the next round
were diffed against the old base, an element the trainer moved back would never be re-sent.
So :meth:`~CheckpointPatcher.abandon` (the default ``applied=None``: unknown) makes every tensor
the failed round carried dense in the next one; ``applied=False`` (nothing reached the engine)
keeps them sparse against the committed base. Rounds are one at a time: a :meth:`diff` while
one is neither committed nor abandoned raises.

**What it does not do.** vLLM's sparse apply checks nothing about the result (no digest of
what the engine holds); deltackpt's own rounds (``WeightSender``) check every piece and roll
back. If the engine's weights are not the patcher's bases (an engine started from other
weights, a worker restarted), sparse patches leave a mix: :meth:`~CheckpointPatcher.reset`
makes the next round dense, ``anchor_every`` bounds how long a drift lives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltackpt import cuda
from deltackpt.errors import InvalidArgumentError
from deltackpt.format.changes import changed_elements
from deltackpt.format.device_changes import changed_many_on_device
from deltackpt.format.dtensor import is_dtensor
from deltackpt.sync.engine_check import EngineCheck, check_spec, compare
from deltackpt.sync.errors import SyncError

__all__ = ["CheckpointPatch", "CheckpointPatcher", "CheckpointPatches"]

#: dtypes a sparse patch may carry (vLLM marks unchanged elements with NaN)
SPARSE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: a tensor is sent dense when more than this share of its elements changed
SPARSE_BELOW = 1 / 8
MAX_SPARSE_ELEMENTS = 1 << 31  # int32 indices
#: where a device tensor's base may be kept (CheckpointPatcher(bases=))
BASES = ("auto", "device", "host")
#: device tensors diffed together (one wait for their counts) up to about this many bytes
DEVICE_GROUP = 1 << 30


@dataclass(frozen=True)
class CheckpointPatch:
    """One tensor's update in checkpoint coordinates: the fields of vLLM's
    ``CheckpointWeightPatch`` (``name, shape, dtype, values, indices``) and of its
    ``SparseWeightPatch`` (``full_shape``), so a list of them goes to
    ``load_checkpoint_weight_patches`` or to the sparse NCCL engine's ``send_weights`` as is.
    ``indices`` None: ``values`` is the whole tensor, flat (dense)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.shape

    def as_sparse(self) -> CheckpointPatch:
        """This patch as a sparse one (a dense patch: every element listed, int32 indices, 3x
        its bytes for bf16), for a link that carries sparse patches only (vLLM's
        ``sparse_nccl``: ``send_weights(rnd.sparse + [p.as_sparse() for p in rnd.dense])``).
        A NaN value cannot go (vLLM's unchanged marker), nor 2**31 elements or more."""
        if self.indices is not None:
            return self
        why = None
        if self.dtype not in SPARSE_DTYPES:
            why = f"its dtype {self.dtype} cannot be masked with NaN"
        elif self.values.numel() >= MAX_SPARSE_ELEMENTS:
            why = "it has 2**31 elements or more (int32 indices)"
        elif bool(torch.isnan(self.values).any()):
            why = "it holds NaN values (vLLM's unchanged-element marker)"
        if why is not None:
            raise InvalidArgumentError(
                f"CheckpointPatch.as_sparse: {self.name!r} cannot go as a sparse patch: {why}; "
                "send it dense (vLLM's dense NCCL backend, or a reload)"
            )
        idx = torch.arange(self.values.numel(), dtype=torch.int32, device=self.values.device)
        return CheckpointPatch(self.name, self.shape, self.dtype, self.values, idx)

    @property
    def nbytes(self) -> int:
        """Bytes this patch puts on the wire (values, and indices when sparse)."""
        idx = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return idx + self.values.numel() * self.values.element_size()


@dataclass
class CheckpointPatches:
    """One round from :meth:`CheckpointPatcher.diff`: ``dense`` and ``sparse`` patches (two
    lists: vLLM's apply takes one kind per call), the tensors that did not change, the version
    it brings the engine to and the one its sparse patches apply to (``base``: None when the
    patcher had no committed round)."""

    version: int
    base: int | None
    dense: list[CheckpointPatch] = field(default_factory=list)
    sparse: list[CheckpointPatch] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    #: why a tensor that had a base went dense anyway: name -> reason
    why_dense: dict[str, str] = field(default_factory=dict)
    #: bytes of every tensor the round looked at, in the wire dtype (a full round's bytes)
    full_bytes: int = 0

    @property
    def patches(self) -> list[CheckpointPatch]:
        return self.dense + self.sparse

    @property
    def nbytes(self) -> int:
        """Bytes the round's patches put on the wire."""
        return sum(p.nbytes for p in self.patches)

    @property
    def changed_elements(self) -> int:
        return sum(p.values.numel() for p in self.sparse)


@dataclass
class _Pending:
    """What a round will do to the bases at its commit."""

    new_bases: dict[str, torch.Tensor] = field(default_factory=dict)  # dense: the values, flat
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # dense: the full shapes
    scatters: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Look:
    """One tensor in a round being built: ``kind`` dense, unchanged, sparse (``found``: its
    int32 indices and values) or diff (to be diffed on its device); ``new`` the tensor in the
    wire dtype (dense: flat, the round's own; sparse and unchanged: empty once settled); ``t``
    the caller's tensor until then (dropped: a streamed state is not kept alive)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    new: torch.Tensor
    t: torch.Tensor | None = None
    reason: str | None = None
    found: tuple[torch.Tensor, torch.Tensor] | None = None
    nbytes: int = 0  # of ``new`` whole, kept when ``new`` is dropped

    def __post_init__(self) -> None:
        self.nbytes = self.new.numel() * self.new.element_size()


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _signed(vals: np.ndarray) -> np.ndarray:
    return vals.view(f"<i{vals.itemsize}")  # torch has no unsigned 16/32/64 views everywhere


class CheckpointPatcher:
    """Diffs a trainer's state against what the engine was last told and hands the difference
    out as checkpoint-coordinate patches (module doc). ``dtype``: the engine's dtype, the wire
    dtype of every floating tensor (None: each tensor's own); ``anchor_every``: every that many
    rounds one goes dense (0: never); ``sparse_below``: the share of a tensor's elements above
    which it goes dense; ``threads``: host tensors diffed at once; ``bases``: where a device
    tensor's base is kept (``"auto"``: its device where ``cuda.device_room`` allows, else host
    memory; ``"device"``; ``"host"``: diffed there, the tensor's bytes cross each round)."""

    def __init__(
        self,
        dtype: torch.dtype | None = None,
        *,
        anchor_every: int = 0,
        sparse_below: float = SPARSE_BELOW,
        threads: int = 2,
        bases: str = "auto",
    ) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InvalidArgumentError(
                f"CheckpointPatcher(dtype={dtype!r}): expected a floating torch.dtype (the "
                "engine's, e.g. torch.bfloat16) or None (each tensor's own)"
            )
        if isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 0:
            raise InvalidArgumentError(
                f"CheckpointPatcher(anchor_every={anchor_every!r}): expected an int >= 0 (0: "
                "no anchor rounds)"
            )
        if not isinstance(sparse_below, (int, float)) or not 0 < sparse_below <= 1:
            raise InvalidArgumentError(
                f"CheckpointPatcher(sparse_below={sparse_below!r}): expected a share in (0, 1]"
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidArgumentError(
                f"CheckpointPatcher(threads={threads!r}): expected an int >= 1"
            )
        if bases not in BASES:
            raise InvalidArgumentError(
                f"CheckpointPatcher(bases={bases!r}): expected one of {list(BASES)} (where a "
                "device tensor's base lives: its device, host memory, or the device where it "
                "has room)"
            )
        self.dtype = dtype
        self.bases = bases
        self.anchor_every = anchor_every
        self.sparse_below = float(sparse_below)
        self.threads = threads
        self.version: int | None = None  # the last committed round's
        self._bases: dict[str, torch.Tensor] = {}  # name -> flat tensor in its wire dtype
        self._shapes: dict[str, tuple[int, ...]] = {}  # name -> the base's full shape
        self._homes: dict[str, torch.device] = {}  # name -> the device its tensor lives on
        self._dirty: set[str] = set()  # carried by a round that failed: dense next time
        self._rounds = 0  # committed rounds (anchors count from the first)
        self._open: tuple[CheckpointPatches, _Pending] | None = None

    # ---- the round ------------------------------------------------------------------------

    def diff(
        self,
        state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> CheckpointPatches:
        """The patches that bring an engine holding the last committed round to ``state``
        (checkpoint names to tensors: a state dict, or ``(name, tensor)`` pairs). ``version``:
        the round's (default: the last committed one + 1, or 1)."""
        if self._open is not None:
            raise SyncError(
                f"CheckpointPatcher.diff: round {self._open[0].version} is still open; call "
                "commit(rnd) once the engine applied it, or abandon(rnd) if it failed"
            )
        if version is None:
            version = 1 if self.version is None else self.version + 1
        elif self.version is not None and version <= self.version:
            raise InvalidArgumentError(
                f"CheckpointPatcher.diff(version={version}): the engine holds version "
                f"{self.version}; expected a later one (or None for {self.version + 1})"
            )
        anchor = (
            self.anchor_every > 0 and self._rounds > 0 and self._rounds % self.anchor_every == 0
        )
        # Streamed: ``state`` may be a generator (a trainer gathering one tensor at a time). Host
        # tensors are cast and diffed on the pool (torch's cast and the C loop release the GIL),
        # at most 2 x threads at once; device tensors are cast here and diffed in groups of
        # about DEVICE_GROUP bytes (one wait per group). A tensor's look keeps its patch (or
        # its dense values), never the caller's tensor or its cast.
        looks: list[tuple[str, Future[_Look] | _Look]] = []
        seen: set[str] = set()
        flight: set[Future[_Look]] = set()
        group: list[_Look] = []
        group_bytes = 0
        with ThreadPoolExecutor(self.threads) as pool:
            for name, t in state.items() if isinstance(state, Mapping) else state:
                self._check_item(name, t, seen)
                if self._on_host(t) or self._based_on_host(name):
                    fut = pool.submit(self._look, name, t, anchor)
                    looks.append((name, fut))
                    flight.add(fut)
                    if len(flight) > 2 * self.threads:  # wait for any, not the oldest: a large
                        # tensor must not leave the other threads idle
                        flight = wait(flight, return_when=FIRST_COMPLETED).not_done
                    continue
                look = self._look(name, t, anchor, diff=False)
                looks.append((name, look))
                if look.kind == "diff":
                    group.append(look)
                    group_bytes += look.nbytes
                    if group_bytes >= DEVICE_GROUP:
                        self._device_pass(group)
                        group, group_bytes = [], 0
            self._device_pass(group)
            done = [(n, x.result() if isinstance(x, Future) else x) for n, x in looks]
        rnd = CheckpointPatches(version=version, base=self.version)
        pending = _Pending()
        for name, look in done:
            rnd.full_bytes += look.nbytes
            if look.kind == "unchanged":
                rnd.unchanged.append(name)
                continue
            if look.kind == "dense":
                if look.reason is not None:
                    rnd.why_dense[name] = look.reason
                rnd.dense.append(CheckpointPatch(name, look.shape, look.new.dtype, look.new))
                pending.new_bases[name], pending.shapes[name] = look.new, look.shape
                continue
            idx, vals = look.found  # type: ignore[misc]
            rnd.sparse.append(CheckpointPatch(name, look.shape, vals.dtype, vals, idx))
            pending.scatters[name] = (idx, vals)
        self._open = (rnd, pending)
        return rnd

    @staticmethod
    def _check_item(name: Any, t: Any, seen: set[str]) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"CheckpointPatcher.diff: {name!r} is a {type(t).__name__}; expected a tensor"
            )
        if is_dtensor(t):
            raise InvalidArgumentError(
                f"CheckpointPatcher.diff: {name!r} is a DTensor (a shard); patches are in "
                "checkpoint coordinates of the whole tensor: pass t.full_tensor() on the rank "
                "that sends (vLLM's sparse sender is one trainer rank)"
            )
        if name in seen:
            raise InvalidArgumentError(f"CheckpointPatcher.diff: name {name!r} given twice")
        seen.add(name)

    def _device_pass(self, group: list[_Look]) -> None:
        """Diff ``group`` (device tensors' looks) against their bases on their devices."""
        if not group:
            return
        pairs = [
            (_u8(look.new), _u8(self._bases[look.name]), look.new.element_size(),
             self._cap(look.new))
            for look in group
        ]  # fmt: skip
        for look, got in zip(group, changed_many_on_device(pairs), strict=True):
            self._settle(look, got)

    def commit(self, rnd: CheckpointPatches) -> None:
        """The engine applied ``rnd``: the bases become its bytes (sparse elements written in,
        dense values taken as they are)."""
        pending = self._take(rnd, "commit")

        def scatter(item: tuple[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
            name, (idx, vals) = item
            self._bases[name].index_copy_(0, idx.to(torch.long), vals)

        scatters = list(pending.scatters.items())
        if self.threads > 1 and len(scatters) > 1:
            with ThreadPoolExecutor(min(self.threads, len(scatters))) as pool:
                list(pool.map(scatter, scatters))
        else:
            for item in scatters:
                scatter(item)
        for name, values in pending.new_bases.items():
            self._bases[name] = self._placed(values)
            self._homes[name] = values.device
        self._shapes.update(pending.shapes)
        self._dirty -= pending.new_bases.keys()  # a failed round's tensor is clean once resent
        self.version = rnd.version
        self._rounds += 1

    def seed(
        self,
        state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int = 0,
    ) -> None:
        """The engine already holds ``state`` (it started from the same weights, cast to the
        wire dtype: a bf16 checkpoint of these masters): record it as committed round
        ``version`` without sending anything, so that the first :meth:`diff` is sparse. Nothing
        checks that the engine holds it; if it holds anything else, sparse patches leave a mix
        (module doc). Only before the first round, or after :meth:`reset`."""
        if self._bases or self._open is not None:
            raise SyncError(
                "CheckpointPatcher.seed: the patcher already holds bases (a round was diffed); "
                "seed a new patcher, or reset() first"
            )
        if self.version is not None and version <= self.version:
            raise InvalidArgumentError(
                f"CheckpointPatcher.seed(version={version}): the engine holds version "
                f"{self.version}; expected a later one"
            )
        held, self.version = self.version, None  # the seed's version is the line from here
        try:
            rnd = self.diff(state, version=version)
        except BaseException:
            self.version = held
            raise
        self.commit(rnd)

    def abandon(self, rnd: CheckpointPatches, applied: bool | None = None) -> None:
        """``rnd`` failed. ``applied``: whether any of it may have reached the engine (None:
        unknown, treated as yes): then every tensor it carried goes dense in the next round;
        False: the next round diffs against the committed bases as if ``rnd`` never was."""
        self._take(rnd, "abandon")
        if applied is not False:
            self._dirty.update(p.name for p in rnd.patches)

    def reset(self) -> None:
        """Forget the bases (and an open round): the next round is dense (an engine restarted,
        or loaded from elsewhere). The committed version stays the line the next round
        continues."""
        if self._open is not None:
            self._open = None
        self._bases.clear()
        self._shapes.clear()
        self._homes.clear()
        self._dirty.clear()

    # ---- what the engine holds ------------------------------------------------------------

    def check_spec(self) -> list[list[Any]]:
        """``[name, shape, dtype]`` of every tensor the patcher holds a base of: what a vLLM
        engine's workers are asked to digest (``collective_rpc("deltackpt_checkpoint_digests",
        args=(patcher.check_spec(),))``, the deltackpt worker extension)."""
        return check_spec(self._committed())

    def check(self, reports: Iterable[Mapping[str, Any]]) -> EngineCheck:
        """Compare what each worker reported (``deltackpt_checkpoint_digests``: per tensor,
        the box of it its parameter region holds and that region's digest, taken where the
        parameter lives) with the same box of the committed base (:mod:`.engine_check`): an
        engine that holds the last committed round matches everywhere; one that a failed,
        partial or foreign update left elsewhere is named, tensor by tensor. Cost: a pass over
        the bases here and over the parameters on every worker."""
        if self._open is not None:
            raise SyncError(
                f"CheckpointPatcher.check: round {self._open[0].version} is open; check after "
                "commit(rnd) (the bases are the committed round's)"
            )
        return compare(self._committed(), reports, self.version)

    def _committed(self) -> dict[str, torch.Tensor]:
        """The bases in their full shapes."""
        return {n: b.view(self._shapes[n]) for n, b in self._bases.items()}

    @property
    def held_bytes(self) -> int:
        """Bytes of the bases the patcher keeps (one copy of the weights in the wire dtype)."""
        return sum(b.numel() * b.element_size() for b in self._bases.values())

    # ---- pieces ---------------------------------------------------------------------------

    def _take(self, rnd: CheckpointPatches, what: str) -> _Pending:
        if self._open is None or self._open[0] is not rnd:
            open_v = None if self._open is None else self._open[0].version
            raise SyncError(
                f"CheckpointPatcher.{what}: round {rnd.version} is not the open round (open: "
                f"{open_v}); each round from diff() is committed or abandoned once"
            )
        pending = self._open[1]
        self._open = None
        return pending

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in its wire dtype, contiguous, detached (a copy only where that needs one)."""
        t = t.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous()

    def _dense_reason(
        self, name: str, new: torch.Tensor, base: torch.Tensor | None, anchor: bool
    ) -> str | None:
        if base is None:
            return "no base"
        if (
            base.dtype != new.dtype
            or base.numel() != new.numel()
            or self._homes.get(name) != new.device
        ):
            return "its dtype, size or device changed"
        if name in self._dirty:
            return "a failed round carried it"
        if anchor:
            return f"an anchor round (every {self.anchor_every})"
        return None

    @staticmethod
    def _unmaskable(new: torch.Tensor) -> str | None:
        """Why a changed ``new`` cannot go sparse, whatever changed."""
        if new.dtype not in SPARSE_DTYPES:
            return f"{new.dtype} cannot be masked with NaN"
        if new.numel() >= MAX_SPARSE_ELEMENTS:
            return "2**31 elements or more (int32 indices)"
        return None

    def _based_on_host(self, name: str) -> bool:
        base = self._bases.get(name)
        return base is not None and base.device.type == "cpu"

    def _placed(self, values: torch.Tensor) -> torch.Tensor:
        """Where a base of ``values`` (a dense round's, on the tensor's device) is kept
        (``bases``): a device tensor's base on its device, or in host memory under ``"host"``,
        or under ``"auto"`` where the device has no room for it beside the caller's work
        (``cuda.device_room``: 10% of the device and 256 MiB left)."""
        if values.device.type == "cpu" or self.bases == "device":
            return values
        nbytes = values.numel() * values.element_size()
        if self.bases == "auto" and cuda.device_room(values.device, nbytes):
            return values
        return values.to("cpu")

    @staticmethod
    def _on_host(t: torch.Tensor) -> bool:
        """Diffed by the C loop (else by torch operations where it lives)."""
        return t.device.type == "cpu"

    def _cap(self, new: torch.Tensor) -> int:
        return math.floor(new.numel() * self.sparse_below)

    def _look(self, name: str, t: torch.Tensor, anchor: bool, diff: bool = True) -> _Look:
        """What ``t`` is in this round, diffed against its base where ``diff`` (else left as
        ``"diff"`` for the caller's device pass)."""
        new = self._wire(t)
        look = _Look(name, tuple(t.shape), "diff", new, t)
        base = self._bases.get(name)
        reason = self._dense_reason(name, new, base, anchor)
        if reason is not None:
            self._dense(look, reason if base is not None else None)
            return look
        assert base is not None
        why = self._unmaskable(new)
        if why is not None:
            if torch.equal(_u8(new), _u8(base)):
                self._done(look, "unchanged")
            else:
                self._dense(look, why)
            return look
        if diff:
            if new.device != base.device:  # a device tensor with its base in host memory
                got = self._host_changes(new.to(base.device), base)
                if got is not None:  # the patch goes where the tensor lives
                    got = (got[0].to(new.device), got[1].to(new.device))
            else:
                got = self._host_changes(new, base)
            self._settle(look, got)
        return look

    def _settle(self, look: _Look, got: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """``look`` after its diff: sparse, unchanged, or dense and why."""
        if got is None:
            self._dense(look, f"more than {self.sparse_below:.3g} of its elements changed")
            return
        idx, vals = got
        if idx.numel() == 0:
            self._done(look, "unchanged")
            return
        vals = vals.view(look.new.dtype)
        if bool(torch.isnan(vals).any()):
            self._dense(look, "a changed value is NaN (vLLM's unchanged-element marker)")
            return
        # the cast is dropped now: a round holds the changed elements, not a copy of the model
        look.found = (idx.to(torch.int32), vals)
        self._done(look, "sparse")

    @staticmethod
    def _done(look: _Look, kind: str) -> None:
        look.kind, look.new, look.t = kind, look.new[:0], None

    @staticmethod
    def _dense(look: _Look, reason: str | None) -> None:
        """``look`` goes whole: its values flat, a copy where they are the caller's tensor (the
        base must not move with it)."""
        flat = look.new.reshape(-1)
        t = look.t
        if t is not None and flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            flat = flat.clone()
        look.kind, look.new, look.t, look.reason = "dense", flat, None, reason

    def _host_changes(
        self, new: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        got = changed_elements(
            _u8(new).numpy(), _u8(base).numpy(), new.element_size(), self._cap(new)
        )
        if got is None:
            return None
        idx, vals = got
        return torch.from_numpy(idx.view(np.int32).copy()), torch.from_numpy(_signed(vals).copy())
