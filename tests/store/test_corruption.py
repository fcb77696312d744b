"""A flipped byte is found by verify and refused by load with a typed error naming the key."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from deltackpt.errors import CorruptChunkError
from deltackpt.format.codecs import RAW, EncodePolicy


def _flip(store_dir, name: str, key: str, delta: int = 17) -> str:
    st = deltackpt.open_store(store_dir)
    m = st.manifest(name)
    entry = next(e for e in m.tensors if e.path == key)
    digest = entry.all_slices()[0][0]
    rec = m.chunks[digest]
    path = st.pack_path(rec.pack)
    with open(path, "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([(b[0] + 1) % 256]))
    return digest


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_flipped_byte_is_reported_and_refused(store_dir, codec):
    policy = EncodePolicy(codecs=(RAW,)) if codec == "raw" else EncodePolicy(force="zstd")
    state = {"good": torch.arange(1 << 18, dtype=torch.float32), "bad": torch.ones(1 << 18) * 3}
    deltackpt.save(state, store_dir, "s1", encoding=policy)
    digest = _flip(store_dir, "s1", "bad")

    report = deltackpt.verify(store_dir)
    assert not report.ok
    assert [(p.snapshots, p.keys, p.chunk) for p in report.problems] == [
        (("s1",), ("bad",), digest)
    ]

    with pytest.raises(CorruptChunkError) as ei:
        deltackpt.load(store_dir, "s1")
    msg = str(ei.value)
    assert "'s1'" in msg and "'bad'" in msg and digest in msg and "deltackpt verify" in msg

    # verify=False skips the check (raw data loads with the flipped byte, as the user asked).
    if codec == "raw":
        out = deltackpt.load(store_dir, "s1", verify=False)
        assert not torch.equal(out["bad"], state["bad"])
        assert torch.equal(out["good"], state["good"])


def test_missing_and_truncated_pack(store_dir):
    deltackpt.save(
        {"w": torch.randn(1 << 18)}, store_dir, "s", encoding=EncodePolicy(codecs=(RAW,))
    )
    st = deltackpt.open_store(store_dir)
    rec = next(iter(st.manifest("s").chunks.values()))
    path = st.pack_path(rec.pack)
    with open(path, "r+b") as f:
        f.truncate(rec.offset + 100)
    with pytest.raises(CorruptChunkError, match="truncated"):
        deltackpt.load(store_dir, "s")
    path.unlink()
    with pytest.raises(CorruptChunkError, match="missing"):
        deltackpt.load(store_dir, "s")
    assert len(deltackpt.verify(store_dir).problems) == 1


def test_damaged_manifest_is_a_typed_error(store_dir):
    deltackpt.save({"w": torch.ones(3)}, store_dir, "s")
    path = deltackpt.open_store(store_dir).manifest_path("s")
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(deltackpt.errors.ManifestError, match="not valid JSON"):
        deltackpt.load(store_dir, "s")
    assert isinstance(deltackpt.errors.ManifestError("x"), deltackpt.errors.StoreFormatError)


def test_corrupt_keyframe_is_reported_for_every_delta_built_on_it(store_dir):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1 << 20, generator=g).to(torch.bfloat16)}
    for i in range(3):
        deltackpt.save(state, store_dir, f"s{i}", encoding="smallest")
        state["w"].sub_(4e-3 * torch.randn(1 << 20, generator=g).sign() * state["w"].abs())
    st = deltackpt.open_store(store_dir)
    s2 = st.manifest("s2")
    assert any(r.codec == "xor" for r in s2.chunks.values())  # s2 really is a delta chain
    keyframe = _flip(store_dir, "s0", "w")
    report = deltackpt.verify(store_dir)
    assert report.damaged == ["s0", "s1", "s2"]
    # the damaged keyframe is one problem naming every snapshot that holds it
    (kf,) = [p for p in report.problems if p.chunk == keyframe]
    assert kf.snapshots == ("s0", "s1", "s2") and kf.keys[0] == "w"
    assert len({p.chunk for p in report.problems}) == len(report.problems)
    with pytest.raises(CorruptChunkError):
        deltackpt.load(store_dir, "s2")


def test_a_cycle_of_xor_bases_is_reported_not_skipped(store_dir):
    """A manifest whose xor bases loop is refused when read, and verify reports it once."""
    import dataclasses

    deltackpt.save(
        {"a": torch.randn(1 << 18), "b": torch.randn(1 << 18)},
        store_dir,
        "s",
        encoding=EncodePolicy(codecs=(RAW,)),
    )
    st = deltackpt.open_store(store_dir)
    m = st.manifest("s")
    (da, db) = (m.tensors[0].data[0][0], m.tensors[1].data[0][0])
    chunks = dict(m.chunks)
    chunks[da] = dataclasses.replace(chunks[da], codec="xor", base=db)
    chunks[db] = dataclasses.replace(chunks[db], codec="xor", base=da)
    st.write_manifest(dataclasses.replace(m, chunks=chunks), overwrite=True)
    report = deltackpt.verify(store_dir)
    assert [(p.snapshots, p.keys) for p in report.problems] == [(("s",), ("<manifest>",))]
    assert "cycle" in report.problems[0].reason
    with pytest.raises(deltackpt.errors.ManifestError, match="cycle"):
        deltackpt.load(store_dir, "s")
