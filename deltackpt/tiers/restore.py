"""Restore from the tiers: one agreement on the newest step every rank can assemble.

Every rank lists what it holds (its own local snapshots, the replicas it keeps for peers; rank 0
also the durable versions) and all ranks all-gather the lists over the tier's gloo group, so each
computes the same :func:`choose` without a broadcast. For the chosen step each rank's state
comes from, in this order: its own local snapshot, verified chunk by chunk; a peer's replica,
fetched over the group into the rank's own local store (every chunk's digest checked on
receipt, the manifest committed only when all arrived); or, when some rank has neither, the
durable tier for every rank (a normal distributed snapshot, resharded to the current world).
Any failure on any rank is shared; the failed source is excluded and the choice is made again
(the same step from another source, an older step, or the durable tier). :class:`RestoreReport`
says what was used and what was refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltackpt.errors import DistributedError
from deltackpt.store.store import Store, open_store
from deltackpt.store.verify import verify
from deltackpt.tiers.config import TIER_KEY, Tiers, local_name
from deltackpt.tiers.transfer import Expect, Link, transfer

DURABLE = "durable"
LOCAL = "local"


@dataclass(frozen=True)
class RestoreReport:
    """What :meth:`TieredCheckpointer.restore_latest` did.

    ``step``: the step restored (None: nothing to restore). ``sources``: per rank, where its
    state came from: ``"local"`` (its own local tier), ``"peer <h>"`` (the replica rank ``h``
    held), or ``"durable"``. ``refused``: each source tried and refused, and why (a damaged or
    missing chunk, a stale replica), oldest first."""

    step: int | None
    sources: tuple[str, ...]
    refused: tuple[str, ...] = ()

    @property
    def tier(self) -> str:
        if self.step is None:
            return "none"
        return DURABLE if DURABLE in self.sources else LOCAL


def local_steps(store: Store, rank: int, world: int) -> dict[int, str]:
    """Step -> layout digest of ``store``'s snapshots marked as ``rank``'s state in a world of
    ``world`` (anything else there is stale: another run, world size or rank)."""
    out: dict[int, str] = {}
    for m in store.manifests():
        mark = m.metadata.get(TIER_KEY) if isinstance(m.metadata, dict) else None
        if not isinstance(mark, dict):
            continue
        step, layout = mark.get("step"), mark.get("layout")
        want = {"step": step, "rank": rank, "world": world, "layout": layout}
        if (
            type(step) is int
            and step >= 0
            and isinstance(layout, str)
            and m.name == local_name(step)
            and mark == want
        ):
            out[step] = layout
    return out


def _steps_of(path: Path, rank: int, world: int, notes: list[str]) -> dict[int, str]:
    """``local_steps`` of the store at ``path``; {} (and a note) when it cannot be read."""
    if not path.is_dir():
        return {}
    try:
        return local_steps(open_store(path, create=False), rank, world)
    except Exception as e:  # a damaged tier is one that holds nothing usable
        notes.append(f"{path} unreadable ({type(e).__name__}: {e}); ignored")
        return {}


def inventory(tiers: Tiers, rank: int, world: int, layout: str) -> dict[str, Any]:
    """This rank's holdings: ``own`` steps, per peer it holds a replica of ``held`` steps (each
    with its layout digest), the ``layout`` of its live state, and ``notes``."""
    notes: list[str] = []
    own = _steps_of(tiers.own_dir(rank), rank, world, notes)
    held: dict[int, dict[int, str]] = {}
    for q in range(world):
        if q != rank:
            held[q] = _steps_of(tiers.replica_dir(q, rank), q, world, notes)
    return {"own": own, "held": held, "layout": layout, "notes": notes}


Plan = tuple[int, list[str]]  # (step, per-rank source: "local", "peer <h>" or "durable")


def choose(
    invs: list[dict[str, Any]], durable: list[int], refused: set[tuple[int, int, str]]
) -> Plan | None:
    """The newest step every rank can assemble, and each rank's source; None if there is none.

    A step that only the durable tier has for some rank comes wholly from the durable tier;
    ``refused`` holds (step, rank, source) already tried and refused."""
    world = len(invs)
    steps = sorted(
        {s for inv in invs for s in [*inv["own"], *(x for h in inv["held"].values() for x in h)]},
        reverse=True,
    )
    best: Plan | None = None
    for s in steps:
        sources: list[str] = []
        for q in range(world):
            layout = invs[q]["layout"]
            if invs[q]["own"].get(s) == layout and (s, q, LOCAL) not in refused:
                sources.append(LOCAL)
                continue
            holders = [
                h
                for h in range(world)
                if invs[h]["held"].get(q, {}).get(s) == layout
                and (s, q, f"peer {h}") not in refused
            ]
            if not holders:
                break
            sources.append(f"peer {holders[0]}")
        if len(sources) == world:
            best = (s, sources)
            break
    ok_durable = [s for s in durable if (s, -1, DURABLE) not in refused]
    if ok_durable and (best is None or max(ok_durable) > best[0]):
        return (max(ok_durable), [DURABLE] * world)
    return best


def restore_local(link: Link | None, tiers: Tiers, plan: Plan, layout: str) -> str | None:
    """Make ``plan``'s step whole and verified in this rank's own local tier (fetch a peer's
    replica, every chunk checked on receipt, or hash every chunk of its own snapshot where it
    lies); None or the reason it failed. Nothing is loaded: the ranks agree on the outcome
    first (:func:`restore`).

    Fetches run pair by pair in rank order (every rank walks the same list), so no two
    transfers wait on each other."""
    step, sources = plan
    rank = link.rank if link is not None else 0
    world = len(sources)
    name = local_name(step)
    problem: str | None = None
    own: Store | None = None
    try:
        own = open_store(tiers.own_dir(rank))
    except Exception as e:  # still answer every peer below: none may wait for a timeout
        problem = f"own local tier {tiers.own_dir(rank)} cannot be opened: {type(e).__name__}: {e}"
    for q, src in enumerate(sources):
        if not src.startswith("peer "):
            continue
        h = int(src.split()[1])
        if rank not in (h, q):
            continue
        assert link is not None
        if rank == h:
            try:
                held: Store | None = open_store(tiers.replica_dir(q, h), create=False)
            except Exception:
                held = None  # offer nothing: rank q refuses and the choice is made again
            transfer(link, (q, held, name if held is not None else None), None)
        else:
            moved = transfer(link, None, (h, own, Expect(q, step, world, layout)), recheck=True)
            if moved.committed is None and problem is None:
                problem = "; ".join(moved.problems) or f"replica of {name!r} from rank {h} refused"
    if problem is not None or own is None:
        return problem
    if sources[rank] == LOCAL:
        report = verify(own, [name])
        if not report.ok:
            bad = report.problems[0]
            return f"own local {name!r} is damaged: chunk {bad.chunk or '-'}: {bad.reason}"
    return None


def load_own(tiers: Tiers, rank: int, step: int, load: Callable[[Store, str], None]) -> str | None:
    """``load`` this rank's own local snapshot of ``step``; None or the reason it failed."""
    name = local_name(step)
    try:
        load(open_store(tiers.own_dir(rank), create=False), name)
    except Exception as e:
        return f"loading {name!r} from the local tier failed: {type(e).__name__}: {e}"
    return None


def restore(
    link: Link | None,
    tiers: Tiers,
    durable: list[int],
    load_local: Callable[[Store, str], None],
    load_durable: Callable[[int], None],
    layout: str,
) -> RestoreReport:
    """Run the agreement and the restore on every rank (see the module docstring).

    Each attempt has two agreed phases: every rank makes the chosen step whole and verified in
    its local tier (:func:`restore_local`), and only when every rank succeeded does any rank
    ``load_local`` (which writes into the live state): damage is refused with every rank's
    state untouched. A load that fails after that is refused like any other source and the
    choice is made again (its load goes over what the failed one wrote); the caller decides what
    to say when nothing could be loaded over it."""
    rank = link.rank if link is not None else 0
    world = link.world if link is not None else 1
    mine = inventory(tiers, rank, world, layout)
    mine["durable"] = durable if rank == 0 else []
    invs = link.all_gather(mine) if link is not None else [mine]
    durable_steps = invs[0]["durable"]
    refused: set[tuple[int, int, str]] = set()
    notes: list[str] = []
    for q, inv in enumerate(invs):
        notes.extend(f"rank {q}: {n}" for n in inv["notes"])
        other = sorted(s for s, lay in inv["own"].items() if lay != inv["layout"])
        if other:
            notes.append(
                f"rank {q}: local step(s) {other} saved with another layout of DTensors "
                "(mesh, placements, shapes) ignored"
            )
    while True:  # ends: every round refuses a new (step, rank, source) of a finite set
        plan = choose(invs, durable_steps, refused)
        if plan is None:
            return RestoreReport(None, (), tuple(notes))
        step, sources = plan
        if sources[0] == DURABLE:
            try:
                load_durable(step)
            except DistributedError as e:
                raise DistributedError(
                    f"restore from the durable tier (step {step}) failed: {e}. No tier holds a "
                    f"usable newer state; refused before: {notes or 'nothing'}",
                    e.failures,
                ) from e
            return RestoreReport(step, tuple(sources), tuple(notes))
        problems = _agreed(link, restore_local, link, tiers, plan, layout)
        if all(p is None for p in problems):  # whole and verified everywhere: now load
            problems = _agreed(link, load_own, tiers, rank, step, load_local)
        if all(p is None for p in problems):
            return RestoreReport(step, tuple(sources), tuple(notes))
        for q, p in enumerate(problems):
            if p is not None:
                refused.add((step, q, sources[q]))
                notes.append(f"step {step}, rank {q}, {sources[q]}: {p}")


def _agreed(link: Link | None, step: Callable[..., str | None], *args: Any) -> list[str | None]:
    """Every rank's outcome of ``step(*args)`` (None, or why it failed), all-gathered: a rank
    whose step raised still takes part."""
    try:
        problem = step(*args)
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    return link.all_gather(problem) if link is not None else [problem]
