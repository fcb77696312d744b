"""The sync delta codec: bit-exact round trips, kind selection, and hostile payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt.sync.delta_codec import (
    _PROBE_ALL,
    _PROBE_MARGIN,
    _TINY,
    ALL,
    DENSE,
    PACKED,
    PLANES,
    SPARSE,
    Encoded,
    Scratch,
    encode,
    max_payload,
)
from deltackpt.sync.delta_decode import decode_into
from deltackpt.sync.errors import SyncError

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 64  # bytes of canary either side of out, to catch out-of-bounds writes


def pair(n: int, itemsize: int, frac: float, seed: int = 0, lowbits: bool = True):
    """(new, base) of n elements; ``frac`` of them changed (low bits only when ``lowbits``)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    new = base.copy()
    changed = rng.random(n) < frac
    elems = new.view(UINT[itemsize])
    flips = rng.integers(1, 4 if lowbits else 255, int(changed.sum()), dtype=np.uint8)
    elems[changed] ^= flips.astype(UINT[itemsize])
    return new, base


def guarded(size: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole, out): out is the middle of a canary-filled buffer."""
    whole = np.full(size + 2 * GUARD, 0xA5, dtype=np.uint8)
    return whole, whole[GUARD : GUARD + size]


def assert_guard_intact(whole: np.ndarray) -> None:
    assert (whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all()


def roundtrip(new: np.ndarray, base: np.ndarray, itemsize: int, enc: Encoded) -> None:
    whole, out = guarded(new.size)
    decode_into(enc.kind, enc.payload, base, itemsize, out)
    assert np.array_equal(out, new)
    assert_guard_intact(whole)
    inplace = base.copy()
    decode_into(enc.kind, enc.payload, inplace, itemsize, inplace)
    assert np.array_equal(inplace, new)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("frac", [0.0001, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 7, 1001, 40_000])
def test_roundtrip_every_kind(itemsize: int, frac: float, n: int) -> None:
    new, base = pair(n, itemsize, frac, seed=n)
    if np.array_equal(new, base):
        new.view(UINT[itemsize])[n // 2] ^= 1
    encs = {k: encode(new, base, itemsize, allow=frozenset({k})) for k in (SPARSE, PLANES, DENSE)}
    encs[0] = encode(new, base, itemsize)
    for enc in encs.values():
        assert enc is not None and enc.nbytes <= max_payload(new.size, itemsize)
        assert enc.nbytes == len(enc.payload)
        roundtrip(new, base, itemsize, enc)
    assert_smallest(encs[0], min(e.nbytes for e in encs.values()), new.size)


def assert_smallest(chosen: Encoded, best: int, nbytes: int) -> None:
    """The chosen payload is the smallest, but for the documented zstd skips."""
    tiny = chosen.nbytes * _TINY <= nbytes  # rule 1: already tiny, zstd not tried
    probed = nbytes > _PROBE_ALL and chosen.nbytes * _PROBE_MARGIN <= best  # rule 2's margin
    # few changes: the smaller of PACKED / SPARSE, without a zstd pass over the piece (PLANES)
    few = chosen.kind in (PACKED, SPARSE)
    assert chosen.nbytes == best or tiny or probed or few, (chosen, best, nbytes)


def test_equal_and_empty_pieces_encode_to_none() -> None:
    new, base = pair(1000, 2, 0.0)
    assert encode(new, base, 2) is None
    empty = np.empty(0, dtype=np.uint8)
    assert encode(empty, empty, 4) is None
    decode_into(DENSE, b"", None, 4, empty)  # an empty dense piece decodes to nothing


def test_sparse_forms_and_chosen_kind() -> None:
    n = 200_000
    new, base = pair(n, 2, 0.0001, lowbits=False)
    enc = encode(new, base, 2, allow=frozenset({DENSE, SPARSE}))
    assert enc is not None and enc.kind == SPARSE and enc.payload[0] == 4  # u32 index list
    new, base = pair(n, 2, 0.2, lowbits=False)
    enc = encode(new, base, 2, allow=frozenset({DENSE, SPARSE}))
    assert enc is not None and enc.kind == SPARSE and enc.payload[0] == 0  # bitmap
    small_new, small_base = pair(1000, 4, 0.001)
    enc = encode(small_new, small_base, 4, allow=frozenset({DENSE, SPARSE}))
    assert enc is not None and enc.payload[0] == 2  # u16 indices for small pieces
    roundtrip(small_new, small_base, 4, enc)


def test_dense_is_zero_copy_and_fallback() -> None:
    new, base = pair(5000, 2, 1.0, lowbits=False)
    enc = encode(new, base, 2, allow=frozenset({SPARSE}))  # sparse would exceed the piece
    assert enc is not None and enc.kind == DENSE
    assert isinstance(enc.payload, np.ndarray) and np.shares_memory(enc.payload, new)


def test_low_bit_changes_pick_planes_random_ones_do_not() -> None:
    new, base = pair(300_000, 2, 0.05)  # 600 KB: probed, not compressed whole
    enc = encode(new, base, 2, allow=frozenset({DENSE, SPARSE, PLANES}))
    assert enc is not None and enc.kind == PLANES
    roundtrip(new, base, 2, enc)
    packed = encode(new, base, 2)  # 5% changed: the changed elements, compressed
    assert packed is not None and packed.kind == PACKED and packed.nbytes < 2 * enc.nbytes
    roundtrip(new, base, 2, packed)
    new, base = pair(300_000, 2, 0.4)  # more than PACKED_BELOW changed: the planes
    enc = encode(new, base, 2)
    assert enc is not None and enc.kind == PLANES
    roundtrip(new, base, 2, enc)
    # the time-first policy (what gloo links use): a list of changes or the piece, never zstd
    # over the whole piece
    fast = encode(new, base, 2, allow=frozenset({PACKED, SPARSE}), packed_below=1 / 16)
    assert fast is not None and fast.kind == DENSE and fast.nbytes == new.size
    new, base = pair(300_000, 2, 0.03)
    fast = encode(new, base, 2, allow=frozenset({PACKED, SPARSE}), packed_below=1 / 16)
    assert fast is not None and fast.kind == PACKED
    roundtrip(new, base, 2, fast)
    new, base = pair(300_000, 2, 0.3, lowbits=False)
    rng = np.random.default_rng(1)
    new.view(np.uint16)[new.view(np.uint16) != base.view(np.uint16)] = rng.integers(
        0, 1 << 16, int((new != base).reshape(-1, 2).any(1).sum()), dtype=np.uint16
    )
    enc = encode(new, base, 2)
    assert enc is not None and enc.kind == SPARSE


def test_explicit_scratch_reuses_payload_buffer() -> None:
    scratch = Scratch()
    new, base = pair(50_000, 2, 0.01, lowbits=False)
    a = encode(new, base, 2, allow=frozenset({DENSE, SPARSE}), scratch=scratch)
    b = encode(new, base, 2, allow=frozenset({DENSE, SPARSE}), scratch=scratch)
    assert a is not None and b is not None and np.shares_memory(a.payload, b.payload)


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 3000),
    frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    allow=st.sets(st.sampled_from([DENSE, SPARSE, PLANES]), min_size=1),
)
def test_roundtrip_property(itemsize: int, n: int, frac: float, seed: int, allow: set[int]) -> None:
    new, base = pair(n, itemsize, frac, seed=seed, lowbits=seed % 2 == 0)
    enc = encode(new, base, itemsize, allow=frozenset(allow))
    if enc is None:
        assert np.array_equal(new, base)
        return
    assert enc.kind in allow | {DENSE} and enc.nbytes <= new.size
    roundtrip(new, base, itemsize, enc)


# --------------------------------------------------------------------------- hostile payloads


def sparse_payload(mode: int, k: int, values: bytes, positions: bytes) -> bytes:
    vals = values + bytes(-len(values) % 8)
    return struct.pack("<B7xQ", mode, k) + vals + positions


def rejects(kind: int, payload: bytes | np.ndarray, n: int = 100, itemsize: int = 2) -> None:
    base = np.arange(n * itemsize, dtype=np.uint8)
    whole, out = guarded(n * itemsize)
    before = whole.copy()
    with pytest.raises(SyncError):
        decode_into(kind, payload, base, itemsize, out)
    assert np.array_equal(whole, before)  # nothing written, in bounds or out


def test_malformed_sparse_payloads() -> None:
    two = np.array([3, 7], np.uint16).tobytes()
    rejects(SPARSE, b"")
    rejects(SPARSE, b"\x04" + bytes(6))  # shorter than the header
    rejects(SPARSE, sparse_payload(4, 2, two, np.array([1, 2], np.uint32).tobytes())[:-1])
    rejects(SPARSE, sparse_payload(4, 2, two, np.array([1, 100], np.uint32).tobytes()))
    rejects(SPARSE, sparse_payload(8, 2, two, np.array([1, 2**63], np.uint64).tobytes()))
    rejects(SPARSE, sparse_payload(3, 2, two, bytes(6)))  # unknown mode
    rejects(SPARSE, sparse_payload(4, 2**40, two, bytes(8)))  # count beyond the piece
    rejects(SPARSE, sparse_payload(4, 3, two, bytes(8)))  # count vs index list length
    bitmap = np.packbits(np.arange(100) < 2)
    rejects(SPARSE, sparse_payload(0, 2, two, bitmap.tobytes()[:-1]))  # bitmap too short
    rejects(SPARSE, sparse_payload(0, 2, two, bitmap.tobytes() + b"\0"))  # bitmap too long
    rejects(SPARSE, sparse_payload(0, 2, two, np.packbits(np.arange(100) < 3).tobytes()))
    padded = bitmap.copy()
    padded[-1] |= 1  # a padding bit past element 100
    rejects(SPARSE, sparse_payload(0, 2, two, np.packbits(np.arange(100) < 1).tobytes()))
    rejects(SPARSE, sparse_payload(0, 2, two, padded.tobytes()))
    bad_header = bytearray(sparse_payload(2, 2, two, np.array([1, 2], np.uint16).tobytes()))
    bad_header[3] = 1
    rejects(SPARSE, bytes(bad_header))


def test_malformed_planes_and_dense_payloads() -> None:
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    rejects(PLANES, b"")
    rejects(PLANES, b"not a zstd frame at all")
    rejects(PLANES, cctx.compress(bytes(199)))  # claims 199 bytes, piece is 200
    rejects(PLANES, cctx.compress(bytes(201)))
    rejects(PLANES, zstandard.ZstdCompressor(write_content_size=False).compress(bytes(200)))
    good = cctx.compress(bytes(200))
    rejects(PLANES, good[:-3])  # truncated
    rejects(PLANES, good + good)  # a second frame after the piece
    rejects(PLANES, bytes(201))  # longer than the piece: never a valid planes payload
    rejects(DENSE, bytes(199))
    rejects(DENSE, bytes(201))
    rejects(7, bytes(200))  # unknown kind


def test_bad_arguments() -> None:
    new, base = pair(10, 2, 0.5)
    with pytest.raises(SyncError):
        encode(new, base[:-2], 2)
    with pytest.raises(SyncError):
        encode(new, base, 3)
    with pytest.raises(SyncError):
        encode(new[:-1], base[:-1], 2)  # not whole elements
    with pytest.raises(SyncError):
        encode(new.view(np.uint16), base.view(np.uint16), 2)
    new, base = pair(1000, 2, 0.01)
    enc = encode(new, base, 2, allow=frozenset({SPARSE}))
    assert enc is not None and enc.kind == SPARSE
    with pytest.raises(SyncError):
        decode_into(enc.kind, enc.payload, None, 2, np.empty(2000, np.uint8))
    overlap = np.zeros(4000, np.uint8)
    with pytest.raises(SyncError):
        decode_into(enc.kind, enc.payload, overlap[:2000], 2, overlap[10:2010])
    assert max_payload(1 << 20, 2) == 1 << 20
    assert frozenset({DENSE, SPARSE, PLANES, PACKED}) == ALL


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_packed_without_the_native_loop_gives_the_same_bytes(
    itemsize: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numpy fallback of the C loop (installs without a compiler) lists the same changes:
    the same payload, the same decoded piece, the same refusal when too many changed."""
    from deltackpt.format import changes

    cases = [pair(n, itemsize, frac, seed=n) for n in (3, 1001, 40_000) for frac in (0.01, 0.3)]
    native = [encode(new, base, itemsize) for new, base in cases]
    monkeypatch.setattr(changes, "_native_diff", None)
    for (new, base), want in zip(cases, native, strict=True):
        got = encode(new, base, itemsize)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got.kind == want.kind and bytes(got.payload) == bytes(want.payload)
            roundtrip(new, base, itemsize, got)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000])
def test_a_patch_is_verified_without_assembling_its_bytes(
    itemsize: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``patches.patched_digest`` (the receiver's check of a host patch whose base is its own
    contiguous copy) gives the digest of the patched bytes: across chunks (64 elements here),
    chunks with no change hashed in place, a short last chunk, the first and last elements."""
    import xxhash

    from deltackpt.sync import patches, wire

    monkeypatch.setattr(patches, "PATCHED_CHUNK", 64)
    rng = np.random.default_rng(n * 10 + itemsize)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    keep = base.copy()
    spread = {i for i in range(n) if rng.random() < 0.05 and not 384 <= i < 512}  # 2 chunks
    chosen = {0, n - 1} | {i for i in range(n) if 200 <= i < 260} | spread
    idx = np.array(sorted(chosen), dtype=np.int64)
    vals = rng.integers(0, 2**63, idx.size, dtype=np.uint64).astype(UINT[itemsize])
    new = base.copy()
    new.view(UINT[itemsize])[idx] = vals
    h = xxhash.xxh3_128()
    h.update(new)
    assert patches.patched_digest(base, idx, vals) == wire.digest_words(h)
    assert np.array_equal(base, keep)  # the base is read, never written
    assert patches.patched_digest(base, idx[:0], vals[:0]) == wire.digest_words(
        xxhash.xxh3_128(base)
    )


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_a_host_patch_is_written_in_one_pass_and_taken_back(itemsize: int) -> None:
    # apply_round writes a host patch into its target with the C pass that keeps the old
    # values (the receiver's undo); the same bytes as torch's indexing, and revert() undoes it
    import torch

    from deltackpt.sync import apply

    if apply._native_apply is None:
        pytest.skip("no C extension: torch's indexing is the only path")
    sdt, ndt = apply._SIGNED[itemsize]
    rng = np.random.default_rng(itemsize)
    n = 4099
    base = torch.from_numpy(rng.integers(0, 256, n * itemsize, dtype=np.uint8)).view(sdt)
    idx = np.sort(rng.choice(n, 97, replace=False)).astype(np.int64)
    idx[0], idx[-1] = 0, n - 1  # the first and last elements
    vals = rng.integers(0, 256, idx.size * itemsize, dtype=np.uint8).view(ndt)
    want = base.clone()
    want[torch.from_numpy(idx)] = torch.from_numpy(vals)
    words, undo = base.clone(), []
    assert apply._host_patch(words, idx, vals, undo)
    assert torch.equal(words, want) and len(undo) == 1
    apply.revert(undo)
    assert torch.equal(words, base)
    # indices the C pass refuses (not increasing): nothing written, torch's indexing then
    bad = idx[::-1].copy()
    assert not apply._host_patch(words, bad, vals, undo)
    assert torch.equal(words, base) and undo == []


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_c_diff_gives_the_same_changes_with_and_without_avx2(itemsize: int) -> None:
    """The C loop compares 64 words at a time into a mask (AVX2 where the processor has it,
    plain C elsewhere: ``plain=True`` forces it here): both list what numpy lists, the same
    linear-digest terms, and refuse the same overflow. Sizes cut blocks of 4 and 64 words and
    leave tails shorter than a word; changes fall on block edges too."""
    from deltackpt.format import changes

    native = changes._native_diff
    if native is None:
        pytest.skip("deltackpt._native was not built (no C compiler at install)")
    for n_words, frac in [(0, 0.5), (3, 0.5), (63, 0.05), (64, 0.0), (65, 0.3), (1027, 0.02)]:
        for tail in (0, itemsize) if itemsize < 8 else (0,):
            n = (8 * n_words + tail) // itemsize
            new, base = pair(n, itemsize, frac, seed=n_words + tail)
            for at in (63 * 8, 64 * 8):  # a change on each edge of the first block
                if at < new.size:
                    new[at] ^= 1
            cap = n + 8
            got = []
            for plain in (False, True):
                idx = np.empty(cap, np.uint32)
                vals = np.empty(cap, UINT[itemsize])
                lin = np.zeros(4, np.uint64)
                k = native(new, base, itemsize, idx, vals, lin, plain)
                got.append((idx[:k].copy(), vals[:k].copy(), lin.copy()))
            e_new, e_base = new.view(UINT[itemsize]), base.view(UINT[itemsize])
            want = np.flatnonzero(e_new != e_base).astype(np.uint32)
            for idx, vals, _ in got:
                assert np.array_equal(idx, want) and np.array_equal(vals, e_new[want])
            assert np.array_equal(got[0][2], got[1][2])
            if want.size > 1:  # too little room: refused, by both
                for plain in (False, True):
                    small = np.empty(1, np.uint32), np.empty(1, UINT[itemsize])
                    assert native(new, base, itemsize, *small, None, plain) == -1


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("native", [True, False])
def test_the_list_brings_the_base_to_the_new_bytes_on_the_way(
    itemsize: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encode(update_base=True)`` (the sender's bases under the time-first policy): the
    changed words are written into the base as the diff finds them, so the base equals the new
    bytes afterwards; the payload is the one a plain encode writes; a piece nothing changed in
    is None with its base as it was; with zstd planes allowed the base is left to the caller.
    Sizes leave tails shorter than a word; the C loop and its numpy fallback alike."""
    from deltackpt.format import changes

    if not native:
        monkeypatch.setattr(changes, "_native_diff", None)
    fast = frozenset({PACKED, SPARSE})
    for n, frac in [(1, 1.0), (7, 0.3), (1001, 0.02), (40_003, 0.01), (40_003, 0.0)]:
        new, base = pair(n, itemsize, frac, seed=n)
        want = encode(new, base.copy(), itemsize, allow=fast, packed_below=1 / 4)
        held = base.copy()
        got = encode(new, held, itemsize, allow=fast, packed_below=1 / 4, update_base=True)
        if want is None:
            assert got is None and np.array_equal(held, base)
            continue
        assert got is not None and got.kind == want.kind
        assert bytes(got.payload) == bytes(want.payload)
        roundtrip(new, base, itemsize, got)
        if got.kind == DENSE and not got.base_updated:  # too many changes for the list: the
            continue  # caller drops or rewrites this base (it may be partly written)
        assert got.base_updated and np.array_equal(held, new)
    new, base = pair(1001, itemsize, 0.02, seed=5)
    held = base.copy()
    got = encode(new, held, itemsize, update_base=True)  # planes allowed: base untouched
    assert got is not None and not got.base_updated and np.array_equal(held, base)


@pytest.mark.parametrize("native", [True, False])
def test_index_lists_decode_alike_with_and_without_the_c_pass(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unpack_changes`` sums and checks the index gaps in one C pass (``unpack_gaps``) or with
    numpy: the same indices for lists with gaps of every byte width, and the same refusals of a
    repeated element and of an index past the buffer, including gaps that would wrap."""
    from deltackpt.errors import CodecError
    from deltackpt.format import changes

    if not native:
        monkeypatch.setattr(changes, "_native_gaps", None)
    elif changes._native_gaps is None:
        pytest.skip("deltackpt._native was not built (no C compiler at install)")
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    rng = np.random.default_rng(3)
    gaps = rng.integers(1, 1 << 24, 5000, dtype=np.uint64)
    gaps[::7] = 1
    gaps[::11] = 0xFFFF_FFFF
    idx = np.cumsum(gaps).astype(np.int64)
    n = int(idx[-1]) + 1
    vals = rng.integers(0, 1 << 16, idx.size, dtype=np.uint16)

    # the gaps (the first index, then differences) laid out as pack_changes writes them
    def payload(g: np.ndarray) -> np.ndarray:
        k = g.size
        body = np.empty(k * 6, np.uint8)
        changes._group(g.astype(np.uint32).view(np.uint8), 4, body[: 4 * k])
        changes._group(vals[:k].view(np.uint8), 2, body[4 * k :])
        return np.frombuffer(changes.HEADER.pack(k) + cctx.compress(body), np.uint8)

    got_idx, got_vals = changes.unpack_changes(payload(gaps), 2, n)
    assert np.array_equal(got_idx, idx) and np.array_equal(got_vals, vals)
    repeated = gaps.copy()
    repeated[100] = 0
    with pytest.raises(CodecError, match="twice"):
        changes.unpack_changes(payload(repeated), 2, n)
    with pytest.raises(CodecError, match="out of range"):
        changes.unpack_changes(payload(gaps), 2, n - 1)
    past = np.full(5000, 0xFFFF_FFFF, np.uint64)  # the third index passes 2**33
    with pytest.raises(CodecError, match="out of range"):
        changes.unpack_changes(payload(past), 2, 1 << 33)
