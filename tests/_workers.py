"""Child-process helpers for the crash and concurrency tests (run as ``python _workers.py CMD``).

Also imported by the tests for the deterministic state builders, so parent and child derive the
very same tensors from a save index or a seed.

Commands (each prints one line per event on stdout, flushed, so the parent can follow along):

``crash_saver STORE``
    Builds the base tensors, prints ``ready``, then waits for ``go START COUNT ENCODING`` on stdin
    and saves snapshots ``crash_state(i)`` as ``s-<i>`` for i = START, START+1, ... (COUNT saves;
    ENCODING ``raw``, or ``default``: zstd/xor deltas against the previous save), printing
    ``begin i`` before each save, ``publish i`` right before its manifest is published and
    ``commit i`` after the save returned. The parent SIGKILLs it at random moments.

``saver``
    Prints ``ready``, then for each stdin line (a JSON object with ``store``, ``name``,
    ``shared``, ``own`` and optionally ``rdv``, ``rdv_dir``) saves ``pair_state(shared, own)`` and
    prints a JSON line ``{"name", "pid", "result"}`` with result ``ok``, ``exists`` (the save raised
    SnapshotExistsError) or ``error <repr>``. With ``rdv`` (a round label) the save waits inside
    the store lock, after the existence check, until the other saver of that round got there too
    (marker files in ``rdv_dir``), so both saves really overlap. EOF or ``quit`` exits.

``trainer``
    Prints ``ready``, then for each stdin line ``run STORE STEPS`` trains a tiny model with
    dropout (inputs from torch's, numpy's and Python's global RNGs) through a ``Checkpointer``
    that saves after every step, resuming from STORE's latest snapshot: prints ``start N``, then
    ``loss I HEX`` (``float.hex`` of the loss) for each step and ``done``. Every run seeds all
    three RNGs first, so a run on a fresh store is the uninterrupted reference. EOF exits.

``crash_saver`` saves through a store opened with its own storage (``open_store(path,
storage=LocalStorage(path, ops=...))``) whose commit step reports before publishing; ``saver``
wraps ``Store.chunk_index`` to line two saves up. They only print or wait, never change what a
save does.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------- state builders

CRASH_SHAPES = {"model.w": (5000, 6000), "model.v": (20_000_000,), "opt.m": (2500, 4000)}
CRASH_NUMEL = sum(int(torch.Size(s).numel()) for s in CRASH_SHAPES.values())  # 60M int32: 240 MB


def crash_base() -> torch.Tensor:
    """Random int32 in [-2**30, 2**30): adding a small index never overflows."""
    g = torch.Generator().manual_seed(20240611)
    return torch.randint(-(2**30), 2**30, (CRASH_NUMEL,), dtype=torch.int32, generator=g)


def crash_state(base: torch.Tensor, idx: int) -> dict[str, Any]:
    """The state saved as snapshot ``s-<idx>``: every byte of every big tensor depends on idx.

    Small tensors (grouped into shared chunks) sit between big ones, as biases do in a model.
    """
    g = torch.Generator().manual_seed(idx)
    big = {}
    pos = 0
    for key, shape in CRASH_SHAPES.items():
        n = int(torch.Size(shape).numel())
        big[key] = (base[pos : pos + n] + idx).view(shape)
        pos += n
    return {
        "model": {
            "w": big["model.w"],
            "bias": torch.randn(1000, generator=g),
            "v": big["model.v"],
        },
        "opt": {"m": big["opt.m"], "lr": torch.rand(3, generator=g, dtype=torch.float64)},
        "step": idx,
    }


def crash_name(idx: int) -> str:
    return f"s-{idx:04d}"


def pair_state(seed_shared: int, seed_own: int) -> dict[str, Any]:
    """24 MB: a tensor shared by every saver using ``seed_shared`` and one of its own."""

    def rand(seed: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)

    return {
        "shared": rand(seed_shared, 4_000_000),
        "own": rand(1_000_000 + seed_own, 2_000_000).view(1000, 2000),
        "seeds": [seed_shared, seed_own],
    }


def assert_same_state(got: Any, want: Any, where: str = "") -> None:
    """Bit-exact comparison of nested dicts/lists of tensors and plain values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape"
        assert torch.equal(
            got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        ), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys differ"
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: sequence differs"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ---------------------------------------------------------------------------- commands


def _say(*parts: object) -> None:
    print(*parts, flush=True)


def crash_saver(store: str) -> None:
    import deltackpt
    from deltackpt.store import durable
    from deltackpt.store.local import DurableOps, LocalStorage

    base = crash_base()
    current = [-1]

    def publish(tmp: Path, final: Path, overwrite: bool = False) -> None:
        if final.name == "MANIFEST.json":
            _say("publish", current[0])
        durable.publish(tmp, final, overwrite=overwrite)

    storage = LocalStorage(store, ops=DurableOps(publish=publish))
    st = deltackpt.open_store(store, storage=storage)
    _say("ready")
    line = sys.stdin.readline().split()
    if not line or line[0] != "go":
        return
    start, count, encoding = int(line[1]), int(line[2]), line[3]
    opts: dict[str, Any] = {}
    if encoding == "raw":  # every save writes all 240 MB: long pack writes to kill
        from deltackpt.format.codecs import RAW, EncodePolicy

        opts["encoding"] = EncodePolicy(codecs=(RAW,))
    for idx in range(start, start + count):
        state = crash_state(base, idx)
        current[0] = idx
        _say("begin", idx)
        deltackpt.save(state, st, crash_name(idx), metadata={"idx": idx}, **opts)
        _say("commit", idx)
    _say("done")


def _rendezvous(directory: Path, label: str, me: str, parties: int, timeout: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{label}.{me}").touch()
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(f"{label}.*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous {label}: the other saver never arrived")
        time.sleep(0.002)


def saver() -> None:
    import json
    import os

    import deltackpt
    from deltackpt.errors import SnapshotExistsError
    from deltackpt.store.store import Store

    real_index = Store.chunk_index
    req: dict[str, Any] = {}

    def chunk_index(self: Store) -> Any:
        # A save asks for the dedupe index while it holds the shared store lock, after it checked
        # that its name is free and before it writes anything.
        if req.get("rdv"):
            _rendezvous(Path(req["rdv_dir"]), req["rdv"], str(os.getpid()), 2, 60.0)
        return real_index(self)

    Store.chunk_index = chunk_index  # type: ignore[method-assign]
    _say("ready")
    for raw in sys.stdin:
        if not raw.strip() or raw.strip() == "quit":
            break
        req.clear()
        req.update(json.loads(raw))
        state = pair_state(req["shared"], req["own"])
        out = {"name": req["name"], "pid": os.getpid()}
        try:
            deltackpt.save(state, req["store"], req["name"], metadata={"pid": os.getpid()})
        except SnapshotExistsError:
            out["result"] = "exists"
        except Exception as e:
            out["result"] = f"error {e!r}"
        else:
            out["result"] = "ok"
        _say(json.dumps(out))


def train_with_dropout(store: str, steps: int, say: Callable[..., None] = _say) -> None:
    """One ``trainer`` run (see the module docstring); also called in-process by tests."""
    import random

    import numpy as np

    import deltackpt

    torch.manual_seed(1234)  # a fresh run's draws; a resume overwrites them from the snapshot
    np.random.seed(1234)
    random.seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optim": opt}
    with deltackpt.Checkpointer(store, every=1, keep_last=3) as ckpt:
        start = ckpt.restore_latest(state)
        say("start", start)
        for step in range(start, steps):
            x = torch.randn(16, 8)
            target = torch.from_numpy(np.random.standard_normal((16, 1)).astype(np.float32))
            scale = random.random() + 0.5
            loss = (model(x) - target).pow(2).mean() * scale
            opt.zero_grad()
            loss.backward()
            opt.step()
            say("loss", step, loss.item().hex())
            ckpt.save(step, state)
    say("done")


def trainer() -> None:
    torch.set_num_threads(1)  # steadier on a loaded machine; every run in the test does the same
    _say("ready")
    for raw in sys.stdin:
        parts = raw.split()
        if not parts or parts[0] != "run":
            break
        train_with_dropout(parts[1], int(parts[2]))


# ---------------------------------------------------------------------------- parent side


class Child:
    """A worker process with line-buffered stdout collected by a thread (never blocks on pipes).

    Every wait has a timeout; ``close`` SIGKILLs the process if it is still alive.
    """

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.log: list[tuple[float, str]] = []  # (monotonic time, line) of every stdout line
        self.stderr: list[str] = []
        self._q: queue.Queue[tuple[float, str] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout:
                # Only whole, non-blank lines are events: a SIGKILL can cut the last one short.
                if not line.endswith("\n") or not line.strip():
                    continue
                item = (time.monotonic(), line.rstrip("\n"))
                self.log.append(item)
                self._q.put(item)
            else:
                self.stderr.append(line)
        if is_stdout:
            self._q.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, want: str | Callable[[str], bool], timeout: float) -> tuple[float, str]:
        """Wait for the next stdout line equal to ``want`` (or matching it); skip others."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {want!r} within {timeout}s; {self.describe()}")
            try:
                item = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if item is None:
                self._q.put(None)  # keep reporting the exit to later calls
                raise AssertionError(f"child exited before {want!r}; {self.describe()}")
            if want(item[1]) if callable(want) else item[1] == want:
                return item

    def kill(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        rc = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=timeout)
        return rc

    def close(self, timeout: float = 30.0) -> int:
        """Ask politely (stdin EOF), then SIGKILL after ``timeout`` seconds."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = self.kill()
        for t in self._threads:
            t.join(timeout=timeout)
        return rc

    def describe(self) -> str:
        tail = "".join(self.stderr[-20:])
        return (
            f"pid {self.proc.pid} rc={self.proc.poll()} stdout tail {self.log[-5:]} stderr:\n{tail}"
        )


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"crash_saver": crash_saver, "saver": saver, "trainer": trainer}[cmd](*args)
