"""Folding delta chains into keyframes in the store (issue 39): every snapshot still loads
bit-exact, readers and gc running meanwhile see whole manifests, fold never deletes, a damaged
chain stops it with nothing repointed, and a fresh reader of a folded snapshot reads only the
short chains (counted on the payloads it reads)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.cli.main import main
from deltackpt.errors import CorruptChunkError, InvalidArgumentError, SnapshotNotFoundError
from deltackpt.store.fold import chain_links, deepest_chain, used_chunks
from deltackpt.store.leases import write_lease
from deltackpt.store.packs import PackReaders
from deltackpt.store.store import Store

CHUNK = 64 << 10
POSITIONS = 8
VERSIONS = 12


def _state(seed: int = 0, positions: int = POSITIONS) -> dict[str, torch.Tensor]:
    """A bf16 tensor of ``positions`` chunks and a small fp32 one (a group chunk)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(positions * CHUNK // 2, generator=g).to(torch.bfloat16),
        "b": torch.randn(1000, generator=g),  # a small tensor: a group chunk
    }


def _step(sd: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """An RL-like step: a few elements of every chunk change (patch deltas)."""
    positions = sd["w"].numel() * 2 // CHUNK
    w = sd["w"].view(positions, -1)
    idx = torch.randint(0, w.shape[1], (positions, 16), generator=g)
    w.scatter_add_(1, idx, torch.full(idx.shape, 0.25, dtype=w.dtype))
    sd["b"][int(torch.randint(0, 1000, (1,), generator=g))] += 1.0


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(_u8(a[k]), _u8(b[k])) for k in a)


def _chained(tmp_path: Path, versions: int = VERSIONS) -> tuple[Store, list[dict[str, Any]]]:
    """A store whose snapshots v0..v{n-1} are one growing chain of patch deltas per chunk."""
    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=CHUNK)
    sd, g = _state(), torch.Generator().manual_seed(1)
    saved = []
    for v in range(versions):
        deltackpt.save(sd, st, f"v{v}", encoding="smallest")
        saved.append({k: t.clone() for k, t in sd.items()})
        _step(sd, g)
    assert deepest_chain(st.manifest(f"v{versions - 1}")) == versions - 1
    return st, saved


def _packs(st: Store) -> set[str]:
    return {p.name for p in Path(st.root, "packs").iterdir()}


def _manifest_bytes(st: Store, name: str) -> bytes:
    return Path(st.root, "snapshots", name, "MANIFEST.json").read_bytes()


@pytest.mark.parametrize(("max_chain", "keep_links"), [(4, 1), (0, 0), (2, 2)])
def test_fold_keeps_every_snapshot_bit_exact(tmp_path, max_chain, keep_links):
    st, saved = _chained(tmp_path)
    before = {f"v{v}": _manifest_bytes(st, f"v{v}") for v in range(VERSIONS - 1)}
    r = deltackpt.fold(st, max_chain=max_chain, keep_links=keep_links)
    last = f"v{VERSIONS - 1}"
    assert r.snapshot == last and r.chunks_folded > 0 and r.bytes_written > 0
    assert (r.deepest_before, r.deepest_after) == (VERSIONS - 1, keep_links)
    assert deepest_chain(st.manifest(last)) == keep_links <= max_chain
    deltackpt.fold(st, "v6", max_chain=max_chain, keep_links=keep_links)  # a middle one too
    assert deepest_chain(st.manifest("v6")) <= max_chain
    for v, state in enumerate(saved):
        assert _same(deltackpt.load(st, f"v{v}"), state), v
    for name, blob in before.items():  # fold touched only the manifests it was asked to
        if name != "v6":
            assert _manifest_bytes(st, name) == blob, name
    assert deltackpt.verify(st).ok
    again = deltackpt.fold(st, max_chain=max_chain, keep_links=keep_links)
    assert again.chunks_folded == 0 and again.pack is None  # nothing over the bound


def test_catch_up_after_fold_still_patches_from_the_previous_version(tmp_path):
    """keep_links=1: the folded snapshot's newest delta still reaches the previous version's
    chunk, so a follower holding it patches instead of reading whole chunks."""
    st, saved = _chained(tmp_path)
    deltackpt.fold(st, max_chain=2)
    held = {k: t.clone() for k, t in saved[-2].items()}
    stats = deltackpt.LoadStats()
    last = f"v{VERSIONS - 1}"
    deltackpt.load(st, last, into=held, since=f"v{VERSIONS - 2}", stats=stats)
    assert _same(held, saved[-1])
    assert stats.chunks_read == 0 and stats.chunks_patched >= POSITIONS, stats


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record the (pack, offset) of every payload read through PackReaders."""
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()
    read_into, readv_into = PackReaders.read_into, PackReaders.readv_into

    def rec_read(self: PackReaders, pack: str, offset: int, out: Any) -> int:
        with lock:
            seen.append((pack, offset))
        return read_into(self, pack, offset, out)

    def rec_readv(self: PackReaders, pack: str, offset: int, bufs: Any) -> int:
        with lock:
            seen.append((pack, offset))
        return readv_into(self, pack, offset, bufs)

    monkeypatch.setattr(PackReaders, "read_into", rec_read)
    monkeypatch.setattr(PackReaders, "readv_into", rec_readv)
    return seen


def test_fresh_reader_of_a_folded_snapshot_reads_only_short_chains(tmp_path, monkeypatch):
    st, saved = _chained(tmp_path)
    last = f"v{VERSIONS - 1}"
    seen = _reads(monkeypatch)
    assert _same(deltackpt.load(st, last), saved[-1])
    before = set(seen)
    deltackpt.fold(st, max_chain=3, keep_links=1)
    m = st.manifest(last)
    # what a reader of the folded snapshot may read: each used chunk's chain, at most 1 link
    allowed: set[tuple[str, int]] = set()
    for d in used_chunks(m):
        assert chain_links(d, m.chunks) <= 1
        cur: str | None = d
        while cur is not None:
            allowed.add((m.chunks[cur].pack, m.chunks[cur].offset))
            cur = m.chunks[cur].base
    seen.clear()
    assert _same(deltackpt.load(st, last), saved[-1])
    after = set(seen)
    assert after <= allowed, after - allowed
    assert len(after) <= 2 * len(used_chunks(m)) < len(before), (len(after), len(before))


def test_fold_never_deletes_and_leased_snapshots_keep_their_chains(tmp_path):
    st, saved = _chained(tmp_path)
    packs = _packs(st)
    deltackpt.fold(st, max_chain=1)
    assert packs < _packs(st)  # only added
    write_lease(st.storage, "eval-0", ["v3"], ttl=600)  # a follower holds v3
    r = deltackpt.gc(st, keep_last=1, compact_below=0.99)
    assert r.leased == ["v3"] and "v3" not in r.deleted
    assert _same(deltackpt.load(st, "v3"), saved[3])  # its chain payloads were kept for it
    assert _same(deltackpt.load(st, f"v{VERSIONS - 1}"), saved[-1])
    assert deltackpt.verify(st).ok


def test_damaged_chain_stops_fold_with_nothing_repointed(tmp_path):
    st, _ = _chained(tmp_path)
    last = f"v{VERSIONS - 1}"
    m = st.manifest(last)
    d = sorted(used_chunks(m))[0]
    bottom = d
    while m.chunks[bottom].base is not None:
        bottom = m.chunks[bottom].base
    rec = m.chunks[bottom]  # the keyframe every later version decodes from
    path = Path(st.root, "packs", f"{rec.pack}.pack")
    raw = bytearray(path.read_bytes())
    raw[rec.offset + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    blob, packs = _manifest_bytes(st, last), _packs(st)
    with pytest.raises(
        CorruptChunkError, match=r"fold of snapshot 'v11'.*nothing was repointed"
    ) as e:
        deltackpt.fold(st, max_chain=2)
    base = m.chunks[d].base
    assert base is not None and base in str(e.value) and "(w)" in str(e.value)  # chunk, tensor
    assert _manifest_bytes(st, last) == blob  # not repointed
    assert _packs(st) == packs  # its new pack removed


def _on_repoint(monkeypatch: pytest.MonkeyPatch, st: Store, run: Any) -> None:
    """Call ``run()`` between fold's shared lock and its exclusive one."""
    lock = Store.lock

    def hooked(self: Store, *, exclusive: bool, timeout: float, what: str) -> Any:
        if exclusive and what.startswith("repointing"):
            run()
        return lock(self, exclusive=exclusive, timeout=timeout, what=what)

    monkeypatch.setattr(Store, "lock", hooked)


def test_gc_between_the_locks_makes_fold_start_over(tmp_path, monkeypatch):
    st, saved = _chained(tmp_path)
    calls: list[Any] = []

    def gc_once() -> None:
        if not calls:
            calls.append(deltackpt.gc(st))  # removes the new pack: nothing names it yet

    _on_repoint(monkeypatch, st, gc_once)
    r = deltackpt.fold(st, max_chain=2)
    assert calls[0].packs_removed == 1 and r.attempts == 2 and r.chunks_folded > 0
    assert deepest_chain(st.manifest(f"v{VERSIONS - 1}")) == 1
    assert _same(deltackpt.load(st, f"v{VERSIONS - 1}"), saved[-1])
    assert deltackpt.verify(st).ok


def test_snapshot_deleted_while_folding_is_not_brought_back(tmp_path, monkeypatch):
    st, _ = _chained(tmp_path)
    packs = _packs(st)
    _on_repoint(monkeypatch, st, lambda: deltackpt.delete(st, "v5") if st.has("v5") else None)
    with pytest.raises(SnapshotNotFoundError, match="deleted while it was being folded"):
        deltackpt.fold(st, "v5", max_chain=1)
    assert not st.has("v5") and _packs(st) == packs


def test_readers_and_gc_running_beside_fold_always_get_the_right_bytes(tmp_path):
    st, saved = _chained(tmp_path)
    stop, errors = threading.Event(), []
    loads = [0]

    def reader(names: list[int]) -> None:
        try:
            while not stop.is_set():
                for v in names:
                    assert _same(deltackpt.load(st, f"v{v}"), saved[v]), v
                    loads[0] += 1
        except BaseException as e:
            errors.append(e)

    def collector() -> None:
        try:
            while not stop.is_set():
                deltackpt.gc(st, compact_below=0.99)  # compaction moves packs under readers
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=([VERSIONS - 1, 7],)) for _ in range(2)]
    threads.append(threading.Thread(target=collector))
    for t in threads:
        t.start()
    try:
        for bound, name in [(8, "v11"), (5, "v11"), (3, "v7"), (2, "v11"), (0, "v11"), (1, "v7")]:
            deltackpt.fold(st, name, max_chain=bound, keep_links=min(bound, 1))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert loads[0] > 0
    assert deepest_chain(st.manifest("v11")) == 0 and deepest_chain(st.manifest("v7")) <= 1
    for v, state in enumerate(saved):
        assert _same(deltackpt.load(st, f"v{v}"), state), v
    assert deltackpt.verify(st).ok


def test_saves_beside_fold_continue_the_chains(tmp_path):
    """A save while fold writes (both hold the lock shared), then more saves on the folded
    chain: every version loads bit-exact."""
    st, saved = _chained(tmp_path, versions=8)
    sd = {k: t.clone() for k, t in saved[-1].items()}
    g = torch.Generator().manual_seed(9)
    _step(sd, g)
    t = threading.Thread(target=lambda: deltackpt.fold(st, "v7", max_chain=2))
    t.start()
    deltackpt.save(sd, st, "v8", encoding="smallest")
    saved.append({k: v.clone() for k, v in sd.items()})
    t.join()
    for v in range(9, 12):
        _step(sd, g)
        deltackpt.save(sd, st, f"v{v}", encoding="smallest")
        saved.append({k: t.clone() for k, t in sd.items()})
    for v, state in enumerate(saved):
        assert _same(deltackpt.load(st, f"v{v}"), state), v
    assert deltackpt.verify(st).ok


def test_fold_arguments_are_checked(tmp_path):
    st, _ = _chained(tmp_path, versions=2)
    for kw in ({"max_chain": -1}, {"max_chain": 65}, {"max_chain": 1.5}, {"max_chain": True},
               {"max_chain": 1, "keep_links": 2}, {"encoding": "tiny"}):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            deltackpt.fold(st, **kw)
    with pytest.raises(SnapshotNotFoundError):
        deltackpt.fold(st, "nope")


def test_cli_fold(tmp_path, capsys):
    st, saved = _chained(tmp_path)
    code = main(["fold", str(st.root), "--max-chain", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    (snap,) = doc["snapshots"]
    assert snap["name"] == "v11" and snap["chunks_folded"] > 0
    assert (snap["deepest_before"], snap["deepest_after"]) == (VERSIONS - 1, 1)
    assert main(["fold", str(st.root), "v3", "v5", "--max-chain", "0", "--keep-links", "0"]) == 0
    assert "v5" in capsys.readouterr().out
    assert deepest_chain(st.manifest("v3")) == 0 == deepest_chain(st.manifest("v5"))
    assert main(["fold", str(st.root), "--max-chain", "1", "--keep-links", "2"]) == 2  # usage
    assert _same(deltackpt.load(st, "v5"), saved[5])
