"""The connection of a sync job (M trainer ranks, N inference ranks): a gloo group for point-to-point bucket links, and a
TCPStore for setup, the commit vote, aborts and heartbeats.

Why not collectives for control: with a dead rank, a gloo all-reduce fails fast only on the
dead rank's neighbours and hangs everywhere else until the group timeout. Here every control
decision is a store key: a rank that fails writes the abort key, a rank that dies stops
beating (a daemon thread bumps ``hb/<rank>`` every ``beat`` seconds), and every rank waiting
for the vote polls both, so every peer fails within about ``dead_after`` seconds of a death —
well under the group timeout. If rank 0 dies, the store (hosted there) goes with it, and every
store call fails at once. A round that fails for any other reason still ends only when every
rank has voted (see :meth:`SyncGroup.vote`); a setup that fails on one rank (bad input, a
target of the wrong shape) fails at once on every rank through a key of its own
(:meth:`SyncGroup.fail_setup`).

Recovery after :class:`PeerLostError`: survivors call :meth:`SyncGroup.reconnect` with a new
port; a replacement process constructs ``SyncGroup`` with the same arguments. The old gloo group
is kept referenced, never destroyed (tearing down a group with pending operations blocks until
its timeout).
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from deltackpt.options import default_device_rounds, default_ipc_buckets
from deltackpt.sync.errors import (
    PeerLostError,
    PlanError,
    RoundAbortedError,
    SyncError,
    SyncTimeoutError,
)
from deltackpt.sync.ipc_links import IpcLinks
from deltackpt.sync.link_choice import choose_links, shm_need
from deltackpt.sync.peers import pid_alive, pid_space
from deltackpt.sync.replicas import replicas_differ, versions_of, vote_value
from deltackpt.sync.schedule import is_integer
from deltackpt.sync.shm_links import ShmLinks

__all__ = ["LINKS", "SyncGroup", "cause_line"]

#: what ``SyncGroup(links=)`` takes
LINKS = ("auto", "gloo", "shm", "ipc")

T = TypeVar("T")
_JOIN_ATTEMPT_S = 5.0  # seconds of one attempt to connect to the store while joining
# how often a rank waiting for the commit vote looks for a lost peer's abort (a lost rank
# never votes; the votes themselves are looked for at every poll)
VOTE_LOST_CHECK_S = 0.02
_GRAVEYARD: list[object] = []  # groups of failed connections: never destroyed (see above)


# bytes of a bucket when WeightSender/WeightReceiver are given none, per link: on an ipc link
# (tensor handles; the trainer holds a ring of two per link, ipc_buckets, the receiver a slot
# per bucket, so their size costs little memory) fewer, larger buckets cut the per-bucket
# handshakes: on
# one H100 (2.01 GB bf16, benchmarks/bench_gpu_sync.py) 256 MiB made a full device round 0.039 s
# and an RL-like one 0.041 s where 64 MiB took 0.056 s and 0.087 s; on gloo and shm links a
# bucket is a ring slot or a window of pinned memory, and 64 MiB keeps them small
BUCKET_BYTES = {"gloo": 64 << 20, "shm": 64 << 20, "ipc": 256 << 20}


def default_bucket_bytes(links: str) -> int:
    """``bucket_bytes`` of a sender or receiver on ``links`` given none (:data:`BUCKET_BYTES`);
    the same on every rank of a group, as it must be."""
    return BUCKET_BYTES[links]


def cause_line(e: BaseException) -> str:
    """The first line of the transport's own message (gloo's 'Connection closed by peer ...')."""
    return str(e.__cause__ or e).splitlines()[0].split(". This is typically")[0][:200]


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_group_args(
    master_addr: Any,
    master_port: Any,
    rank: Any,
    world_size: Any,
    timeout: Any,
    join_timeout: Any,
    beat: Any,
    dead_after: Any,
) -> None:
    """:class:`PlanError` (an ``InvalidArgumentError``) naming the first argument of a
    :class:`SyncGroup` that cannot work, before anything connects: a rank out of range would
    otherwise wait ``join_timeout`` for a group it can never join."""

    def bad(what: str, value: Any, expected: str, fix: str) -> PlanError:
        return PlanError(f"SyncGroup({what}={value!r}): expected {expected}. {fix}")

    if not isinstance(master_addr, str) or not master_addr:
        raise bad("master_addr", master_addr, "a host name or address (str)",
                  "Pass rank 0's host, e.g. '127.0.0.1'")  # fmt: skip
    if not is_integer(master_port):
        raise bad("master_port", master_port, "an int", "Pass the port rank 0's store listens on")
    if not 0 < master_port < 65536:
        raise bad("master_port", master_port, "a port in 1..65535", "Pass a free port")
    if not is_integer(world_size) or world_size < 2:
        raise bad("world_size", world_size, "an int >= 2 (trainers and inference ranks)",
                  "Count every rank that sends or receives")  # fmt: skip
    if not is_integer(rank) or not 0 <= rank < world_size:
        raise bad("rank", rank, f"an int in 0..{world_size - 1} (world_size={world_size})",
                  "Give each process its own rank below world_size")  # fmt: skip
    for what, value in (("timeout", timeout), ("beat", beat), ("dead_after", dead_after)):
        if not _number(value) or not 0 < value < float("inf"):
            raise bad(what, value, "a number of seconds > 0", "Pass a positive number")
    if join_timeout is not None and (
        not _number(join_timeout) or not 0 < join_timeout < float("inf")
    ):
        raise bad("join_timeout", join_timeout, "None or a number of seconds > 0",
                  "Pass None for max(timeout, 60)")  # fmt: skip
    if dead_after <= beat:
        raise bad("dead_after", dead_after, f"more than beat={beat!r} (a peer is heard every beat "
                  "seconds)", "Pass dead_after several times beat (default 3.0 and 0.2)")  # fmt: skip


class SyncGroup:
    """Every rank of a sync job (trainers and inference ranks) constructs one with the same
    ``master_addr``/``master_port``, ``world_size`` and ``trainers`` (ranks that send); rank 0
    hosts the store. ``timeout`` bounds every wait on a live but silent peer; a dead peer is
    detected within ``dead_after`` seconds. ``join_timeout`` bounds the wait for every rank to
    join (here and in ``reconnect``); by default ``max(timeout, 60)``, since a short round
    timeout must not fail a peer that is still starting (importing torch with CUDA takes
    seconds). ``links``: ``"auto"`` (the default: ``"ipc"`` where every rank maps rank 0's
    shared memory and ``/dev/shm`` has room for the trainers' buckets, else ``"gloo"``; chosen
    at every connection, :attr:`links` and :attr:`links_reason` say what and why:
    ``link_choice.py``), ``"gloo"``, ``"shm"`` or ``"ipc"``
    (one host, tensor handles: ``ipc_links.py``); ``ipc_device``: where a trainer's ipc buckets
    live, ``"cpu"`` (shared memory) or a CUDA device (CUDA IPC); ``ipc_buckets``: the most of
    them a trainer holds per link (>= 2), reused within a round once the receiver acknowledged
    its copy of each (the trainer's memory for a link: ``ipc_buckets * bucket_bytes``); None:
    one per bucket of the round (the round's bytes, every round); ``"auto"`` (the default):
    ``DELTACKPT_IPC_BUCKETS``, 2 unless set."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        trainers: Sequence[int],
        *,
        timeout: float = 60.0,
        join_timeout: float | None = None,
        beat: float = 0.2,
        dead_after: float = 3.0,
        links: str = "auto",
        ipc_device: str | torch.device = "cpu",
        ipc_buckets: int | str | None = "auto",
    ) -> None:
        check_group_args(
            master_addr, master_port, rank, world_size, timeout, join_timeout, beat, dead_after
        )
        if links not in LINKS:
            raise PlanError(
                f"links={links!r}: choose 'auto' (ipc where every rank shares this host's "
                "memory, else gloo), 'gloo', or 'shm' or 'ipc' (one host, tensor handles)"
            )
        try:
            dev: torch.device | None = torch.device(ipc_device)
        except (RuntimeError, TypeError):
            dev = None
        if (
            dev is None
            or dev.type not in ("cpu", "cuda")
            or (dev.type == "cuda" and not torch.cuda.is_available())
        ):
            raise PlanError(
                f"ipc_device={str(ipc_device)!r}: the ipc link's buckets live in CPU shared "
                "memory ('cpu') or on a CUDA device of this process ('cuda:N', needs CUDA)"
            )
        self.ipc_device = dev
        if ipc_buckets == "auto":
            ipc_buckets = default_ipc_buckets()
        if ipc_buckets is not None and (
            isinstance(ipc_buckets, bool) or not isinstance(ipc_buckets, int) or ipc_buckets < 2
        ):
            raise PlanError(
                f"ipc_buckets={ipc_buckets!r}: expected None (a bucket per bucket of a round), "
                "an int >= 2 (a ring of that many reused buckets per link) or 'auto' "
                "(DELTACKPT_IPC_BUCKETS, default 2)"
            )
        self.ipc_buckets: int | None = ipc_buckets
        self.requested_links = links
        # the links of the current connection ("auto" is resolved at every _connect)
        self.links = links
        self.links_reason = f"links={links!r} was asked for"
        self.addr, self.rank, self.world_size = master_addr, int(rank), int(world_size)
        self.trainers = tuple(sorted(set(int(t) for t in trainers)))
        if not self.trainers or len(self.trainers) >= world_size or self.trainers[-1] >= world_size:
            raise PlanError(
                f"trainers={list(trainers)} for world_size={world_size}: need at least one "
                "trainer and one inference rank, all in range"
            )
        self.timeout, self.beat, self.dead_after = float(timeout), float(beat), float(dead_after)
        self.join_timeout = max(self.timeout, 60.0) if join_timeout is None else float(join_timeout)
        self.epoch = 0
        self.seq = 0
        self._connect(int(master_port))

    # ---- connection -----------------------------------------------------------------------

    def _connect(self, port: int) -> None:
        td = timedelta(seconds=self.timeout)
        try:
            self.store = self._join(port)
            self.pg = dist.ProcessGroupGloo(
                dist.PrefixStore("mxn", self.store), self.rank, self.world_size, td
            )
            self.store.set_timeout(td)  # every rank joined: the rounds' waits from here on
        except RuntimeError as e:
            raise PeerLostError(
                f"rank {self.rank}: cannot join the sync group at {self.addr}:{port} ({e}); "
                "every rank must call SyncGroup/reconnect with the same address and port"
            ) from e

        self.seq = 0
        self._setups = 0  # setup attempts begun on this store: namespaces their exchanges
        self._broken: str | None = None
        self._beat_failed: str | None = None  # why this rank's heartbeat stopped (the store)
        self._stop = threading.Event()
        # a join-time connection: bounded by join_timeout as the store's was (under load a
        # connect can take longer than a short round timeout), then the rounds' timeout
        hb = dist.TCPStore(
            self.addr, port, is_master=False, timeout=timedelta(seconds=self.join_timeout),
            wait_for_workers=False,
        )  # fmt: skip
        hb.set_timeout(td)
        self._beater = threading.Thread(
            target=self._beat_loop, args=(hb, self._stop), name="sync-heartbeat", daemon=True
        )
        self._beater.start()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._pids: dict[int, tuple[str, int, str]] = {}
        self._space = pid_space()
        me = json.dumps([socket.gethostname(), os.getpid(), self._space])
        self.guard("store set", lambda: self.store.set(f"pid/{self.rank}", me))
        if self.requested_links == "auto":
            self._choose_links()
        self._shm: ShmLinks | None = None
        self._ipc: IpcLinks | None = None
        if self.links == "shm":
            if self.rank == 0:
                self.store.set("job", uuid.uuid4().hex[:12])
            job = bytes(self.guard("store get", lambda: self.store.get("job"))).decode()
            self._shm = ShmLinks(self, job)
        elif self.links == "ipc":
            self._ipc = IpcLinks(self, self.ipc_device, self.ipc_buckets)
        # the one-host link that carries the buckets (None: gloo)
        self._host: ShmLinks | IpcLinks | None = self._ipc if self._shm is None else self._shm

    def _choose_links(self) -> None:
        """``links="auto"``: the links every rank of this connection takes (link_choice.py)."""
        need = shm_need(
            len(self.trainers),
            len(self.receivers),
            self.ipc_buckets,
            BUCKET_BYTES["ipc"],
            self.ipc_device.type == "cuda",
        )

        def wait(keys: list[str], what: str) -> None:
            self.wait_until(lambda: self.store.check(keys), what, None)

        choice = choose_links(
            lambda k, v: self.guard("store set", lambda: self.store.set(k, v)),
            lambda k: bytes(self.guard("store get", lambda: self.store.get(k))),
            wait,
            self.rank,
            self.world_size,
            need,
        )
        self.links, self.links_reason = choice.links, choice.reason

    def _join(self, port: int) -> dist.TCPStore:
        """The group's store, once every rank connected to it, within ``join_timeout``. Rank 0
        hosts it without waiting in the constructor; every rank then counts itself in and
        waits for the others. A rank that comes before the host retries connecting every
        0.2 s with short attempts: TCPStore's own retries back off by up to two thirds of its
        timeout (seen: 40 s with 60), which would make a join wait long after the host is up."""
        deadline = time.monotonic() + self.join_timeout
        # the host's own connection to the store it just started gets the whole join timeout:
        # on a busy machine (two cores, an engine starting) it took over 5 s, and the host gave
        # up while its peers kept trying (two flaky tests, one cause)
        short = self.rank != 0
        attempt = timedelta(
            seconds=min(self.timeout, _JOIN_ATTEMPT_S) if short else self.join_timeout
        )
        while True:
            try:
                store = dist.TCPStore(
                    self.addr,
                    port,
                    self.world_size,
                    is_master=self.rank == 0,
                    timeout=attempt,
                    wait_for_workers=False,
                )
                break
            except RuntimeError:
                if self.rank == 0 or time.monotonic() + 0.2 > deadline:
                    raise
                time.sleep(0.2)
        store.set_timeout(timedelta(seconds=self.join_timeout))  # (the attempt's was short)
        store.add("joined", 1)
        while (n := store.add("joined", 0)) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{n} of {self.world_size} ranks joined within join_timeout="
                    f"{self.join_timeout:g} s"
                )
            time.sleep(0.01)
        return store

    def reconnect(self, master_port: int) -> None:
        """After a failure: abandon the old group and store, join new ones on ``master_port``
        (every surviving rank and every replacement process, with the same port). A port that
        cannot be one raises :class:`PlanError` before anything is torn down."""
        if not is_integer(master_port) or not 0 < master_port < 65536:
            raise PlanError(
                f"reconnect(master_port={master_port!r}): expected a port in 1..65535 (an int); "
                "the group was left as it is. Pass the new free port every rank agreed on"
            )
        self._stop.set()
        if self._host is not None:
            self._host.unlink()
            self._host.close()
        _GRAVEYARD.append((self.pg, self.store))
        self.epoch += 1
        self._connect(int(master_port))

    def close(self) -> None:
        """Stop the heartbeat, remove this rank's shared-memory link files, release its ipc
        links' handles and buckets (the group itself is left to the process' exit)."""
        self._stop.set()
        if self._host is not None:
            self._host.unlink()
            self._host.close()

    # ---- liveness -------------------------------------------------------------------------

    def pid_of(self, rank: int) -> tuple[str, int]:
        """``rank``'s host name and pid, as it posted them."""
        host, pid, _ = self._pid_record(rank)
        return host, pid

    def _pid_record(self, rank: int) -> tuple[str, int, str]:
        if rank not in self._pids:
            raw = self.guard("store get", lambda: self.store.get(f"pid/{rank}"))
            self._pids[rank] = _parse_pid_record(bytes(raw), rank)
        return self._pids[rank]

    def alive(self, rank: int) -> bool:
        """False when ``rank``'s pid means a process here (the same kernel and pid namespace,
        ``peers.pid_space``; the same host name where that is unknown) and that process is
        gone (or a zombie)."""
        host, pid, space = self._pid_record(rank)
        here = space == self._space if space and self._space else host == socket.gethostname()
        return not here or pid_alive(pid)

    def _beat_loop(self, store: dist.TCPStore, stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                store.set(f"hb/{self.rank}", str(n))
            except Exception as e:  # the store host died: the main thread finds out by itself
                if not stop.is_set():  # (and lost() says so to a rank idle between rounds)
                    self._beat_failed = (
                        f"the group's store at {self.addr} stopped answering this rank's "
                        f"heartbeat ({cause_line(e)}): rank 0, which hosts it, is gone or "
                        "unreachable"
                    )
                return
            stop.wait(self.beat)

    def lost(self, ranks: Iterable[int], silent: float | None = None) -> str | None:
        """Why this group cannot go on with ``ranks``, looked at without waiting for a round:
        for a rank idle between rounds (a vLLM worker watching its trainers, which may die
        while it serves). The group is broken (a round failed on a lost peer or a timeout), the
        store stopped answering this rank's heartbeat (rank 0, its host, died), one of
        ``ranks`` runs on this host and its process is gone, or one stopped beating for
        ``silent`` seconds (default ``dead_after``; beats are compared between calls: call it
        every second or so; a process that holds the GIL in C code for that long starves its
        heartbeat, so a watch between rounds passes more, e.g. the group's ``timeout``).
        None: nothing seen. A failing store call breaks the group, as in a round."""
        if self._broken is not None:
            return f"a round failed: {self._broken}"
        if self._beat_failed is not None:
            return self._beat_failed
        after = self.dead_after if silent is None else float(silent)
        try:
            dead = self._dead(time.monotonic(), ranks, after)
            if dead is None:
                return None
            host, pid = self.pid_of(dead)
        except SyncError as e:
            return str(e).splitlines()[0]
        what = f"rank {dead} (pid {pid} on {host})"
        if dead == 0:  # whichever check sees it first, the store went with it
            what += f", which hosts the group's store at {self.addr},"
        return f"{what} is gone, or stopped beating for {after:g} s"

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r not in self.trainers)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run a store or gloo call; a failure breaks the connection (PeerLostError)."""
        if self._broken is not None:
            raise PeerLostError(
                f"rank {self.rank}: the sync group is broken since {self._broken}; call "
                "group.reconnect(new_port) on every surviving rank first"
            )
        try:
            return fn()
        except RuntimeError as e:
            msg = cause_line(e) if str(e) else type(e).__name__  # (gloo's advice cut off)
            self._broken = f"{what} failed ({msg})"
            if "timeout" in msg.lower() or "timed out" in msg.lower():
                raise SyncTimeoutError(
                    f"rank {self.rank}: {what} timed out ({msg}); a peer is hung. Call "
                    "group.reconnect(new_port) on every rank"
                ) from e
            raise PeerLostError(
                f"rank {self.rank}: {what} failed ({msg}); a peer rank probably died. "
                "Call group.reconnect(new_port) on the survivors and restart it"
            ) from e

    def mark_broken(self, why: str) -> None:
        self._broken = why

    def lost_error(self, what: str) -> PeerLostError:
        """A peer was lost (``what`` says where): the group is broken until ``reconnect``;
        returns the error for the caller to raise."""
        self.mark_broken(what)
        return PeerLostError(
            f"rank {self.rank}: {what}; call group.reconnect(new_port) on the survivors and "
            "restart the lost rank"
        )

    # ---- setup ----------------------------------------------------------------------------

    @property
    def setups(self) -> int:
        """Setup attempts begun on this store (the current one's number, inside a setup)."""
        return self._setups

    def begin_setup(self) -> int:
        """Start a setup attempt (every rank begins them in the same order: each
        ``WeightSender``/``WeightReceiver`` plans until it has a schedule). Its exchanges and
        its failure key are its own, so an attempt that failed leaves nothing a retry reads."""
        self._setups += 1
        return self._setups

    def fail_setup(self, reason: str) -> None:
        """This rank cannot finish the current setup attempt: every rank waiting in one of its
        exchanges raises :class:`RoundAbortedError` with ``reason`` (first reason wins), at
        once instead of at the group timeout."""
        with contextlib.suppress(Exception):
            self.store.compare_set(f"x/{self._setups}/fail", "", reason)

    def exchange(self, key: str, data: bytes) -> list[bytes]:
        """Every rank posts ``data`` under ``key`` (of the current setup attempt); returns
        every rank's, by rank. :class:`RoundAbortedError` when a rank failed the attempt."""
        pre = f"x/{self._setups}"
        self.guard("store set", lambda: self.store.set(f"{pre}/{key}/{self.rank}", data))
        keys = [f"{pre}/{key}/{r}" for r in range(self.world_size)]
        fail = f"{pre}/fail"
        failed: list[str] = []

        def ready() -> bool:
            # every rank's data first: when it all arrived, this rank checks it itself and
            # raises its own error for a disagreement every rank sees (the same PlanError on
            # every rank, whichever rank posted its failure first)
            if self.store.check(keys):
                return True
            if self.store.check([fail]):
                if self.store.check(keys):  # the last data arrived between the two checks
                    return True
                failed.append(bytes(self.store.get(fail)).decode(errors="replace"))
                return True
            return False

        self.wait_until(ready, f"waiting for every rank's {key}", None)
        if failed:
            raise RoundAbortedError(
                f"rank {self.rank}: the setup failed on {failed[0]}; nothing was sent or "
                "applied. Fix that rank's input, then push/pull again on every rank"
            )
        return [bytes(self.guard("store get", lambda k=k: self.store.get(k))) for k in keys]

    # ---- rounds ---------------------------------------------------------------------------

    def next_round(self) -> int:
        self.seq += 1
        return self.seq

    def abort(self, seq: int, reason: str) -> None:
        """Tell every rank that round ``seq`` fails (first reason wins)."""
        with contextlib.suppress(Exception):
            self.store.compare_set(f"r/{seq}/abort", "", reason)

    def aborted(self, seq: int) -> str | None:
        key = f"r/{seq}/abort"
        if not self.guard("store check", lambda: self.store.check([key])):
            return None
        return bytes(self.guard("store get", lambda: self.store.get(key))).decode()

    def vote(
        self,
        seq: int,
        reason: str | None,
        version: int | None = None,
        replicas: Mapping[str, str] | None = None,
    ) -> str | None:
        """Vote for round ``seq`` (``reason``: this rank rejects it; ``version``: the version a
        trainer pushed; ``replicas``: a trainer's digests of its replicated tensors at a full
        round, ``replicas.py``) and wait for every rank: None when all accepted, else the abort
        reason.
        Raises :class:`PeerLostError` when a rank died (its heartbeat stopped) or the store is
        gone, and :class:`SyncTimeoutError` after ``timeout``.

        A failed round still waits for every rank's vote (only a lost peer, which never votes,
        ends the wait early): every rank votes after it took in its last message of the round,
        so once a rank returns no peer still reads this round's slots, and on shared-memory
        links the next round may overwrite them. The trainers' votes carry their versions, so
        every rank, linked to a trainer or not, fails a round whose trainers disagree (on the
        version, or on the bytes of a replica)."""
        if reason is not None:
            self.abort(seq, reason)
        mine = vote_value(version, replicas)
        self.guard("store set", lambda: self.store.set(f"r/{seq}/v/{self.rank}", mine))
        keys = [f"r/{seq}/v/{r}" for r in range(self.world_size)]
        found: list[str | None] = [None]
        next_lost = [time.monotonic() + VOTE_LOST_CHECK_S]

        def ready() -> bool:
            # votes first, then the abort key: a rank that rejects writes the abort key before
            # its vote, so once every vote is seen the abort check cannot miss a rejection (the
            # other order could read "no abort", then every vote, and commit a rejected round)
            if self.store.check(keys):
                found[0] = self.aborted(seq)
                return True
            # a lost peer never votes: its abort ends the wait early, looked for now and then
            # (one store round trip a look, not two)
            now = time.monotonic()
            if now < next_lost[0]:
                return False
            next_lost[0] = now + VOTE_LOST_CHECK_S
            found[0] = self.aborted(seq)
            return found[0] is not None and found[0].startswith("lost: ")

        self.wait_until(ready, f"round {seq}: waiting for the commit vote", seq)
        if found[0] is None and len(self.trainers) > 1:
            found[0] = self._trainers_differ(seq)
        return found[0]

    def _trainers_differ(self, seq: int) -> str | None:
        """The abort reason when the trainers voted for round ``seq`` with different versions,
        or with different digests of a replica (every rank reads the same votes, so every rank
        decides the same)."""
        keys = [f"r/{seq}/v/{t}" for t in self.trainers]
        vals = self.guard("store multi_get", lambda: self.store.multi_get(keys))
        raws = [bytes(v).decode(errors="replace") for v in vals]
        got = versions_of(raws)
        if len(set(got)) == 1:
            return replicas_differ(self.trainers, raws)
        each = ", ".join(f"rank {t} version {v}" for t, v in zip(self.trainers, got, strict=True))
        return (
            f"the trainers pushed different versions in one round ({each}); pass the same "
            "version to push() on every trainer"
        )

    def wait_until(self, ready: Callable[[], bool], what: str, seq: int | None) -> None:
        """Poll ``ready`` until it is true; :class:`PeerLostError` when a rank stops beating
        (round ``seq`` is then aborted for everyone), :class:`SyncTimeoutError` after
        ``timeout``."""
        start = time.monotonic()
        next_beat = start + self.beat
        delay = 1e-4
        while not self.guard("store", ready):
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat
                dead = self._dead(now)
                if dead is not None:
                    why = f"rank {dead} stopped beating for {self.dead_after:g} s (it died)"
                    if seq is not None:
                        self.abort(seq, "lost: " + why)
                    self._broken = why
                    raise PeerLostError(
                        f"rank {self.rank}: {what}: {why}; call group.reconnect(new_port) "
                        "on the survivors and restart it"
                    )
            if now - start > self.timeout:
                self._broken = f"{what} timed out"
                raise SyncTimeoutError(
                    f"rank {self.rank}: {what}: no answer within {self.timeout:g} s; a peer "
                    "is hung. Call group.reconnect(new_port) on every rank"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _dead(
        self, now: float, among: Iterable[int] | None = None, after: float | None = None
    ) -> int | None:
        """A rank of ``among`` (default: all) that died or stopped beating for ``after``
        seconds (default ``dead_after``), else None."""
        after = self.dead_after if after is None else after
        ranks = range(self.world_size) if among is None else sorted(set(among))
        keys = [f"hb/{r}" for r in ranks]
        if not self.guard("store check", lambda: self.store.check(keys)):
            return None  # not every rank has started beating yet: nothing to compare
        vals = self.guard("store multi_get", lambda: self.store.multi_get(keys))
        for r in ranks:
            if r != self.rank and not self.alive(r):
                return r
        for r, v in zip(ranks, vals, strict=True):
            old = self._seen.get(r)
            if old is None or old[0] != v:
                self._seen[r] = (bytes(v), now)
            elif now - old[1] > after:
                return r
        return None

    # ---- bulk -----------------------------------------------------------------------------

    def drain_sends(self, seq: int, works: list[tuple[int, Any]]) -> str | None:
        """Wait for the round's last sends (zero-copy pieces, whose receives a receiver posts
        as it reads their bucket's header, and abort stubs); the lost peer's story, if any. A
        receiver that lost another peer raises and posts nothing more, so the wait ends when
        the round is aborted for a lost peer, not at the group timeout. (A gloo send cannot be
        polled, and a wait with a timeout closes the connection: a daemon thread waits.)"""
        if not works:
            return None
        errors: list[str] = []
        done = threading.Event()

        def wait_all() -> None:
            for dst, w in works:
                try:
                    self.guard("gloo send", w.wait)
                except SyncError as e:
                    errors.append(f"sending to rank {dst} failed ({cause_line(e)})")
            done.set()

        threading.Thread(target=wait_all, name="sync-drain", daemon=True).start()
        lost: list[str] = []

        def ready() -> bool:
            if done.wait(0.01):  # returns as soon as the sends are done
                return True
            why = self.aborted(seq)
            if why is not None and why.startswith("lost: "):
                lost.append(why[6:])
                return True
            return False

        try:
            self.wait_until(ready, f"round {seq}: sending the last pieces", seq)
        except SyncError as e:  # a peer stopped beating, the store is gone, or the timeout
            lost.append(cause_line(e))
        return (errors or lost or [None])[0]

    def open_links(self, links: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Once per schedule: ``(sender, receiver) -> (buckets, largest message)`` of this
        rank's links (shared-memory links map their windows, ipc links share their buckets;
        gloo needs nothing)."""
        if self._host is not None:
            self._host.open(links)

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any:
        if self._host is not None:
            return self._host.send(buf, dst, tag)
        return self.guard("gloo send", lambda: self.pg.send([buf], dst, tag))

    def window(self, dst: int, tag: int) -> torch.Tensor | None:
        """Shared-memory and ipc links: the slot a sender packs bucket ``tag`` for ``dst``
        straight into (then :meth:`publish`); None on gloo."""
        return None if self._host is None else self._host.window(dst, tag)

    def publish(
        self,
        dst: int,
        tag: int,
        nbytes: int,
        device: bool = False,
        header: torch.Tensor | None = None,
        landed: bool = False,
    ) -> Any:
        assert self._host is not None
        if device:  # a device round: packed in the ipc bucket itself, its header in the cell
            assert self._ipc is not None
            return self._ipc.publish(dst, tag, nbytes, device=True, header=header, landed=landed)
        return self._host.publish(dst, tag, nbytes)

    def publish_inline(self, dst: int, tag: int, header: torch.Tensor) -> Any:
        """A device round's header-only message, in the ipc link's cell (``ipc_links.py``)."""
        assert self._ipc is not None
        return self._ipc.publish_inline(dst, tag, header)

    def inline_header(self, src: int, tag: int) -> tuple[torch.Tensor, bool] | None:
        """The header the last receive of bucket ``tag`` from ``src`` found in its ipc cell,
        and whether it is the whole message (None: the header is in the slot, as on every
        other link)."""
        return None if self._ipc is None else self._ipc.inline_header(src, tag)

    def copy_received(
        self, src: int, tag: int, spans: list[tuple[int, int]]
    ) -> list[torch.Tensor] | None:
        """A receive whose header came in its ipc cell left its copy out of the shared bucket
        to the caller, who read the header: ``spans`` (offset, bytes) of the pieces it puts in
        the message. Copies them, fingerprinted in the same pass where the fingerprint kernel
        runs (their chunk fingerprints returned, one per span: ``IpcLinks.copy_out``), or the
        message whole (None). Before anything reads the staging."""
        return None if self._ipc is None else self._ipc.copy_out(src, tag, spans)

    def settle_receives(self) -> None:
        """Receives on ipc links whose copies were not waited for: waited for and
        acknowledged (before this rank votes)."""
        if self._ipc is not None:
            self._ipc.settle()

    def reuses_buckets(self) -> bool:
        """Whether this rank's ipc links reuse their shared buckets within a round
        (``ipc_buckets`` below a link's bucket count): each is then published once packed."""
        return self._ipc is not None and self._ipc.reuses

    def device_window(self, dst: int, tag: int, lock: bool = False) -> torch.Tensor:
        """A device round's bucket ``tag`` for ``dst`` (:meth:`device_rounds`; ``lock``: a
        host bucket a GPU copies into, page-locked first)."""
        assert self._ipc is not None
        return self._ipc.device_window(dst, tag, lock)

    def device_rounds(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether a sender's rounds of ``tensors`` stay on the device
        (``DELTACKPT_DEVICE_ROUNDS``): ``auto``, an ipc link on CUDA, or host buckets of an ipc
        link carrying CUDA tensors (copied into page-locked shared memory, verified with device
        digests: on one H100 a full round 1.12x a pinned D2H + H2D copy of the bytes, where host
        rounds take 9.8x, BENCHMARKS.md); ``always``, any ipc link (the CPU stand-in)."""
        mode = default_device_rounds()
        if self._ipc is None or mode == "off":
            return False
        if mode == "always" or self.ipc_device.type == "cuda":
            return True
        return any(t.is_cuda for t in tensors)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        if self._host is not None:
            return self._host.recv(buf, src, tag)
        return self.guard("gloo recv", lambda: self.pg.recv([buf], src, tag))


def _parse_pid_record(value: bytes, rank: int) -> tuple[str, int, str]:
    """A rank's ``pid/<rank>`` key: [host name, pid, pid space]."""
    try:
        host, pid, space = json.loads(value)
        if not (isinstance(host, str) and isinstance(pid, int) and isinstance(space, str)):
            raise TypeError
    except (ValueError, TypeError) as e:
        raise SyncError(
            f"rank {rank} posted {value[:80]!r} as its process, not [host, pid, pid space]; "
            "every rank must run the same deltackpt"
        ) from e
    return host, pid, space
