"""The ``patch`` codec: the changed elements of a chunk against its base (format/changes.py).

Chosen over ``xor`` when few elements changed (an RL-like optimizer step), never when most did;
decodes bit-exactly whole, in place and inside chains mixed with ``xor``; refuses malformed
payloads before writing anything; the numpy fallback of the C loop writes the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import CodecError
from deltackpt.format import changes
from deltackpt.format.codecs import (
    PATCH,
    RAW,
    XOR,
    ZSTD,
    EncodePolicy,
    decode,
    decode_chain,
    encode,
    patch_in_place,
)


def _weights(n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def _step(w: torch.Tensor, frac: float, seed: int = 1) -> torch.Tensor:
    """``w`` with about ``frac`` of its elements nudged by one or a few ulps."""
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(w.shape, generator=g) < frac
    up = w.float() * (1 + 2**-6 * torch.randn(w.shape, generator=g).abs())
    return torch.where(hit, up.to(w.dtype), w)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def test_rl_like_step_is_a_patch_and_round_trips() -> None:
    base = _weights(1 << 20)
    new = _step(base, 0.03)
    raw, b = _u8(new), _u8(base)
    enc = encode(raw, 2, base=b, policy=EncodePolicy(min_gain=0.9, zstd_min_gain=0.9))
    assert enc.codec == PATCH and enc.itemsize == 2
    xor = encode(raw, 2, base=b, policy=EncodePolicy(force=XOR))
    assert len(enc.payload) <= 1.25 * len(xor.payload)
    assert len(enc.payload) < 0.1 * raw.size
    out = np.full(raw.size, 0xAB, np.uint8)
    decode(PATCH, enc.payload, raw.size, 2, out, base=b)
    assert np.array_equal(out, raw)
    held = b.copy()
    patch_in_place(enc.payload, raw.size, 2, held)
    assert np.array_equal(held, raw)


def test_dense_step_is_not_a_patch() -> None:
    base = _weights(1 << 18)
    new = _step(base, 0.9)
    enc = encode(_u8(new), 2, base=_u8(base), policy=EncodePolicy(min_gain=0.9))
    assert enc.codec in (XOR, RAW, ZSTD)
    forced = encode(_u8(new), 2, base=_u8(base), policy=EncodePolicy(force=PATCH))
    assert forced.codec == XOR  # too many changes for a patch: the documented fallback


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_numpy_fallback_writes_the_same_payload(
    itemsize: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(itemsize)
    base = rng.integers(0, 256, 40_000 * itemsize + itemsize * 3, dtype=np.uint8)
    new = base.copy()
    hit = rng.choice(base.size // itemsize, 500, replace=False)
    new.reshape(-1, itemsize)[hit, 0] ^= 0x5A
    policy = EncodePolicy(force=PATCH)
    native = encode(new, itemsize, base=base, policy=policy)
    monkeypatch.setattr(changes, "_native_diff", None)
    numpy = encode(new, itemsize, base=base, policy=policy)
    assert native.codec == numpy.codec == PATCH
    assert bytes(native.payload) == bytes(numpy.payload)


def test_chain_of_xor_and_patch_levels_decodes() -> None:
    v0 = _weights(1 << 16)
    v1 = _step(v0, 0.5, seed=2)  # dense: xor
    v2 = _step(v1, 0.02, seed=3)  # sparse: patch
    v3 = _step(v2, 0.02, seed=4)
    key = encode(_u8(v0), 2, policy=EncodePolicy(force=RAW))
    x1 = encode(_u8(v1), 2, base=_u8(v0), policy=EncodePolicy(force=XOR))
    p2 = encode(_u8(v2), 2, base=_u8(v1), policy=EncodePolicy(force=PATCH))
    p3 = encode(_u8(v3), 2, base=_u8(v2), policy=EncodePolicy(force=PATCH))
    assert (x1.codec, p2.codec, p3.codec) == (XOR, PATCH, PATCH)
    levels = [(e.codec, e.payload, e.itemsize) for e in (key, x1, p2, p3)]
    out = np.empty(v0.numel() * 2, np.uint8)
    decode_chain(levels, out.size, out)
    assert np.array_equal(out, _u8(v3))
    with pytest.raises(CodecError, match="keyframe"):
        decode_chain(levels[1:], out.size, out)


def _payload(idx: list[int], vals: list[int], itemsize: int = 2) -> bytes:
    cctx = __import__("zstandard").ZstdCompressor(level=1, write_content_size=True)
    return changes.pack_changes(
        np.array(idx, np.uint32), np.array(vals, changes.UINT[itemsize]), itemsize, cctx
    )


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x01\x00", "expected >= 8"),
        ((0).to_bytes(8, "little") + b"x", "claims 0 changed"),
        ((9999).to_bytes(8, "little") + b"x", "claims 9999 changed"),
        (_payload([1, 2], [7, 7])[:8] + b"not zstd at all", "not a zstd frame"),
        ((3).to_bytes(8, "little") + _payload([1, 2], [7, 7])[8:], "declares"),
        (_payload([5, 5], [1, 2]), "twice"),
        (_payload([3, 100], [1, 2]), "out of range"),
    ],
)
def test_malformed_payloads_raise_before_writing(payload: bytes, match: str) -> None:
    base = np.arange(100, dtype=np.uint16).view(np.uint8).copy()
    out = np.full(base.size, 0xEE, np.uint8)
    with pytest.raises(CodecError, match=match):
        decode(PATCH, payload, base.size, 2, out, base=base)
    assert (out == 0xEE).all()  # nothing written
    held = base.copy()
    with pytest.raises(CodecError):
        patch_in_place(payload, base.size, 2, held)
    assert np.array_equal(held, base)


def test_patch_needs_a_base_and_a_whole_element_size() -> None:
    p = _payload([1], [9])
    with pytest.raises(CodecError, match="needs base"):
        decode(PATCH, p, 200, 2, np.empty(200, np.uint8))
    with pytest.raises(CodecError, match="itemsize"):
        decode(PATCH, p, 200, 3, np.empty(200, np.uint8), base=np.zeros(200, np.uint8))


def test_saved_rl_steps_write_patches_and_load_and_catch_up_bit_exact(tmp_path) -> None:
    w = _weights(1 << 20, seed=5)
    states = []
    for step in range(4):
        if step:
            w = _step(w, 0.03, seed=10 + step)
        states.append({"w": w.clone()})
        deltackpt.save(states[-1], tmp_path, f"s{step}", encoding="smallest")
    m = deltackpt.open_store(tmp_path).manifest("s3")
    codecs_used = {m.chunks[d].codec for e in m.tensors for d, _, _ in (e.data or [])}
    assert PATCH in codecs_used
    for step, want in enumerate(states):
        assert torch.equal(deltackpt.load(tmp_path, f"s{step}")["w"], want["w"])
    held = {"w": states[1]["w"].clone()}
    stats = deltackpt.LoadStats()
    deltackpt.load(tmp_path, "s3", into=held, since="s1", stats=stats)
    assert torch.equal(held["w"], states[3]["w"])
    assert stats.bytes_read < 0.25 * w.numel() * 2  # two patches, not the tensor


def test_a_corrupt_patch_after_good_ones_leaves_into_unchanged(tmp_path) -> None:
    """Patches are applied onto copies, never onto into's own bytes before every chunk checked
    out: the last chunk's payload is damaged, the earlier ones were fine."""
    from deltackpt.errors import CorruptChunkError
    from deltackpt.store.packs import pack_name

    st = deltackpt.open_store(tmp_path)
    v0 = {f"w{i}": _weights(1 << 19, seed=i) for i in range(4)}
    v1 = {k: _step(t, 0.03, seed=20 + i) for i, (k, t) in enumerate(v0.items())}
    deltackpt.save({"m": v0}, st, "s0", encoding="smallest")
    deltackpt.save({"m": v1}, st, "s1", encoding="smallest")
    m = st.manifest("s1")
    recs = [m.chunks[e.data[0][0]] for e in m.tensors]
    assert all(r.codec == PATCH for r in recs)
    last = recs[-1]
    with open(tmp_path / "packs" / pack_name(last.pack), "r+b") as f:
        f.seek(last.offset + last.length // 2)
        b = f.read(1)
        f.seek(last.offset + last.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    into = {"m": {k: t.clone() for k, t in v0.items()}}
    with pytest.raises(CorruptChunkError, match="m/w3"):
        deltackpt.load(st, "s1", into=into, since="s0", threads=1)
    assert all(torch.equal(into["m"][k], v0[k]) for k in v0)


def test_in_place_patches_are_all_undone_when_one_result_is_wrong() -> None:
    """loading/inplace.py: the first patch applies and checks out, the second's result does not
    hash to its digest: both buffers get their old bytes back."""
    from deltackpt.errors import CorruptChunkError
    from deltackpt.format.hashing import digest
    from deltackpt.loading.inplace import InPlace, apply_all

    bufs = [np.arange(1000, dtype=np.uint16).view(np.uint8).copy() for _ in range(2)]
    before = [b.copy() for b in bufs]
    idx, vals = np.array([3, 500], np.uint64), np.array([7, 9], np.uint16)
    good = bufs[0].copy()
    good.view(np.uint16)[idx] = vals
    b = digest(before[0])
    items = [
        InPlace(digest(good), b, bufs[0].view(), 2, [(idx, vals)], "first"),
        InPlace("0" * 32, b, bufs[1].view(), 2, [(idx, vals)], "second"),
    ]

    def held_error(chunk: str, actual: str) -> Exception:
        return AssertionError(f"held bytes were right: {chunk} {actual}")

    with pytest.raises(CorruptChunkError, match="second"):
        apply_all(items, lambda fn, xs: [fn(x) for x in xs], "s0", held_error)
    assert all(np.array_equal(b, o) for b, o in zip(bufs, before, strict=True))
    apply_all(items[:1], lambda fn, xs: [fn(x) for x in xs], "s0", held_error)
    assert np.array_equal(bufs[0], good)


def test_a_policy_with_patch_but_not_xor_keeps_delta_bases_and_writes_patches(tmp_path) -> None:
    """EncodePolicy(codecs=(RAW, PATCH)): the saver keeps delta bases for patch deltas too (it
    kept them only when xor was allowed, so such a policy never wrote a delta)."""
    st = deltackpt.open_store(tmp_path)
    w = _weights(1 << 20, seed=7)
    policy = EncodePolicy(codecs=(RAW, PATCH))
    saved = []
    for step in range(3):
        if step:
            w = _step(w, 0.02, seed=30 + step)
        saved.append(w.clone())
        deltackpt.save({"w": w}, st, f"s{step}", encoding=policy)
    m = st.manifest("s2")
    used = {m.chunks[d].codec for e in m.tensors for d, _, _ in (e.data or [])}
    assert used == {PATCH}
    for step, want in enumerate(saved):
        assert torch.equal(deltackpt.load(st, f"s{step}")["w"], want)


def test_a_raw_keyframe_and_its_patches_decode_in_place_bit_exact(tmp_path) -> None:
    """store/chunks.py: a chain of a raw keyframe and patches is read straight into the target
    and patched there (no payload copy of the keyframe); every version loads bit-exact."""
    import deltackpt
    from deltackpt.codecs import EncodePolicy
    from deltackpt.store import chunks

    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=1 << 16)
    w = torch.randn(256, 256).to(torch.bfloat16)
    saved = []
    for k in range(5):
        saved.append(w.clone())
        deltackpt.save({"w": w}, st, f"v{k}", encoding=EncodePolicy(codecs=("raw", "patch")))
        w.view(-1)[k * 100 : k * 100 + 3] += 1
    assert {r.codec for r in st.manifest("v4").chunks.values()} == {"raw", "patch"}
    straight = []
    orig = chunks.ChunkReader._read_payload

    def spy(self, d, rec, out, where):
        straight.append(rec.codec == "raw" and out.size == rec.size)
        return orig(self, d, rec, out, where)

    chunks.ChunkReader._read_payload = spy  # type: ignore[method-assign]
    try:
        for k in range(5):
            got = deltackpt.load(st, f"v{k}")["w"]
            assert torch.equal(got.view(torch.int16), saved[k].view(torch.int16))
    finally:
        chunks.ChunkReader._read_payload = orig  # type: ignore[method-assign]
    assert any(straight)
