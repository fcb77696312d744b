"""The ranks of one save: a torch.distributed process group, or a world of one.

:class:`Group` wraps the three collectives the save sequence runs, as DCP's ``_DistWrapper`` and
torchsnapshot's ``PGWrapper`` do. Without a process group the process is rank 0 of a world of one:
``gather`` returns ``[value]``, ``scatter`` and ``broadcast`` return what they are given, and no
torch.distributed call is made. With one (of any size, 1 included):

* ``gather(value)``: every rank sends; rank 0 gets the list by rank, the others ``None``;
* ``scatter(values)``: rank 0 passes one value per rank; each rank gets its own;
* ``broadcast(value)``: rank 0's value, on every rank.

Failures travel as values, never as raised exceptions inside a collective: a rank that failed a
step sends :class:`Failed` (typed :class:`~deltackpt.errors.RankFailure` records) where its
result would go, every rank still takes part in the next collective, and
:meth:`Group.raise_failed` then raises the same :class:`~deltackpt.errors.DistributedError` on
every rank (in a world of one: the original exception, unchanged).

:class:`FileRendezvous` is ``gather`` and ``broadcast`` through JSON objects under the store's
``tmp/`` (through its storage), for background threads, which never run collectives: an async
save's ranks finish there, each wait ending after the process group's timeout
(:func:`group_timeout`), the same deadline torch enforces on the collectives.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from deltackpt.errors import DistributedError, RankFailure, ReplicaMismatchError
from deltackpt.store.storage import Storage


@dataclass(frozen=True)
class Failed:
    """Sent in place of a step's result: why one or more ranks failed it."""

    failures: tuple[RankFailure, ...]

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.failures]

    @staticmethod
    def from_json(docs: list[dict[str, Any]]) -> Failed:
        return Failed(tuple(RankFailure.from_json(d) for d in docs))


def failed(values: list[Any]) -> Failed | None:
    """Every failure among gathered step results, or None if every rank succeeded."""
    found = tuple(f for v in values if isinstance(v, Failed) for f in v.failures)
    return Failed(found) if found else None


class Group:
    """This rank's view of the ranks of one save (see the module docstring)."""

    def __init__(self, process_group: Any = None) -> None:
        self.pg = process_group
        self.distributed = process_group is not None
        if self.distributed:
            import torch.distributed as dist

            self._dist = dist
            self.rank = dist.get_rank(process_group)
            self.world = dist.get_world_size(process_group)
        else:
            self.rank, self.world = 0, 1

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    @property
    def wire_device(self) -> Any:
        """Where tensors this group sends must be: the CPU where its backend carries host
        tensors (gloo; ``init_process_group()`` without a backend has gloo beside NCCL), else
        this rank's current CUDA device (an NCCL-only group: torch refuses a CPU tensor there).
        The object collectives pick their device themselves."""
        return wire_device(self.pg) if self.distributed else _cpu()

    @property
    def timeout(self) -> float:
        """Seconds this rank waits for any peer (the process group's timeout; see
        :func:`group_timeout`); a world of one waits for nobody."""
        return group_timeout(self.pg) if self.distributed else float("inf")

    @property
    def key(self) -> int:
        """Names the process group for per-store caches (0: a world of one)."""
        return id(self.pg) if self.distributed else 0

    def gather(self, value: Any) -> list[Any] | None:
        if not self.distributed:
            return [value]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(value, out, dst=0, group=self.pg)
        return out

    def scatter(self, values: list[Any] | None) -> Any:
        if not self.distributed:
            assert values is not None  # the coordinator of a world of one always passes them
            return values[0]
        box: list[Any] = [None]
        self._dist.scatter_object_list(box, values, src=0, group=self.pg)
        return box[0]

    def broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def raise_failed(
        self, what: str, failure: Failed, cause: BaseException | None, after: str
    ) -> NoReturn:
        """Raise the outcome of a failed step: in a world of one the original exception
        (``cause``); with a process group, on every rank, one DistributedError naming each
        failing rank, chained to this rank's own exception if it had one."""
        if not self.distributed and cause is not None:
            raise cause
        ranks = ", ".join(str(r) for r in sorted({f.rank for f in failure.failures}))
        steps = "/".join(dict.fromkeys(f.step for f in failure.failures))
        detail = "; ".join(str(f) for f in failure.failures)
        message = f"{what} failed at step {steps!r} on rank(s) {ranks} of {self.world}: {detail}"
        kind = DistributedError
        if all(f.error == "ReplicaMismatchError" for f in failure.failures):
            kind = ReplicaMismatchError
        raise kind(f"{message}. {after}" if after else message, failure.failures) from cause


class FileRendezvous:
    """``gather`` and ``broadcast`` for background threads, through small objects under the key
    prefix ``where`` of the store's ``storage`` (a directory under ``tmp/``).

    Each rank writes ``rank-<r>.json``; rank 0 waits for all of them, then writes
    ``outcome.json`` for the others, which first wait for rank 0's own ``rank-0.json`` (rank 0
    got as far as they did), then for the outcome. Each of these waits ends ``timeout`` seconds
    (the process group's timeout, :func:`group_timeout`) after it began; a document that did not
    come by then is reported as ``None`` and its name kept in ``missing``."""

    def __init__(self, storage: Storage, where: str, group: Group, timeout: float) -> None:
        self.storage, self.where, self.group, self.timeout = storage, where, group, timeout
        self.missing: str | None = None

    def gather(self, doc: dict[str, Any]) -> list[dict[str, Any] | None] | None:
        self._put(f"rank-{self.group.rank}.json", doc)
        if not self.group.coordinator:
            return None
        deadline = time.monotonic() + self.timeout  # one deadline for all of them
        return [
            doc if r == 0 else self._wait(f"rank-{r}.json", deadline)
            for r in range(self.group.world)
        ]

    def broadcast(self, doc: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.group.coordinator:
            assert doc is not None
            self._put("outcome.json", doc)
            return doc
        if self._wait("rank-0.json", time.monotonic() + self.timeout) is None:
            return None
        return self._wait("outcome.json", time.monotonic() + self.timeout)

    def _put(self, name: str, doc: dict[str, Any]) -> None:
        # atomic and durable: a peer reads all of it or nothing
        self.storage.replace(f"{self.where}/{name}", json.dumps(doc).encode())

    def _wait(self, name: str, deadline: float) -> dict[str, Any] | None:
        """The document ``name`` once a peer wrote it; None after ``deadline``."""
        delay = 0.005
        while True:
            try:
                data = self.storage.read(f"{self.where}/{name}").data
                assert data is not None  # always read: we pass no known version
                doc: dict[str, Any] = json.loads(data)
                return doc
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    self.missing = self.missing or name
                    return None
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.1)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def wire_device(process_group: Any) -> Any:
    """:attr:`Group.wire_device` of ``process_group``."""
    import torch

    types = getattr(process_group, "_device_types", None)
    if types is None:  # an older torch: the backend's name says it
        import torch.distributed as dist

        host = dist.get_backend(process_group) != "nccl"
    else:
        host = any(torch.device(t).type == "cpu" for t in types)
    if host or not torch.cuda.is_available():
        return _cpu()
    return torch.device("cuda", torch.cuda.current_device())


def group_timeout(process_group: Any) -> float:
    """Seconds: the timeout of ``process_group``'s collectives, as given to
    ``init_process_group(timeout=...)`` or ``new_group(timeout=...)`` (torch's default for the
    backend otherwise). A distributed save or load waits at most this long for any peer: in a
    collective (torch enforces it) and in a :class:`FileRendezvous` (we do)."""
    import torch
    import torch.distributed as dist

    for device in getattr(process_group, "_device_types", ()):
        try:  # the backend's options hold the timeout it enforces (no public getter)
            options = process_group._get_backend(torch.device(device)).options
            return float(options._timeout.total_seconds())
        except (AttributeError, RuntimeError, ValueError):
            continue
    try:
        c10d = dist.distributed_c10d
        return float(c10d._get_default_timeout(dist.get_backend(process_group)).total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return float(dist.constants.default_pg_timeout.total_seconds())
