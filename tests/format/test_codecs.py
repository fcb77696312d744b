"""Tests for deltackpt.format.codecs: bit-exact round trips, codec choice, errors, thread safety."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deltackpt.errors import CodecError
from deltackpt.format.codecs import (
    DELTAS,
    PATCH,
    PATCH_PREFERENCE,
    RAW,
    XOR,
    ZSTD,
    Encoded,
    EncodePolicy,
    decode,
    encode,
)

# The pre-0.5 rule: plain zstd whenever it saves 10%. Tests of zstd on dense floats use it.
LOOSE = EncodePolicy(zstd_min_gain=0.9)

SIZES = [0, 1, 7, 4096 + 3, 1 << 20]
ITEMSIZES = [1, 2, 4, 8]


def _random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _float_bytes(n: int, dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """n bytes of real float data (torch.randn), cut to n even when n is not a multiple."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.finfo(dtype).bits // 8
    t = torch.randn(n // elem + 1, dtype=dtype, generator=g)
    return t.view(torch.uint8).numpy()[:n].copy()


def _adamw_step(raw: np.ndarray, dtype: torch.dtype, lr: float = 1e-5, seed: int = 1) -> np.ndarray:
    """The same bytes after a simulated optimizer step w - lr * randn (shape-preserving)."""
    if raw.size == 0:
        return raw.copy()
    w = torch.from_numpy(raw.copy()).view(dtype)
    g = torch.Generator().manual_seed(seed)
    stepped = (w.float() - lr * torch.randn(w.shape, generator=g)).to(dtype)
    return stepped.view(torch.uint8).numpy().copy()


def _roundtrip(enc: Encoded, raw: np.ndarray, base: np.ndarray | None = None) -> np.ndarray:
    out = np.empty(raw.size, dtype=np.uint8)
    decode(enc.codec, enc.payload, raw.size, enc.itemsize, out, base=base)
    return out


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", [RAW, ZSTD, XOR])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("data", ["random", "bf16", "fp32"])
def test_roundtrip_bit_exact(codec: str, itemsize: int, size: int, data: str) -> None:
    if data == "random":
        raw = _random_bytes(size)
        base = _random_bytes(size, seed=7)
    else:
        dtype = torch.bfloat16 if data == "bf16" else torch.float32
        raw = _float_bytes(size, dtype)
        base = _float_bytes(size, dtype, seed=3)
    enc = encode(raw, itemsize, base=base, policy=EncodePolicy(force=codec))
    assert enc.codec == codec
    assert enc.itemsize in (1, itemsize)
    out = _roundtrip(enc, raw, base if codec == XOR else None)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_auto_choice_roundtrips(size: int, itemsize: int) -> None:
    raw = _float_bytes(size, torch.bfloat16)
    base = _adamw_step(raw[: size - size % 2], torch.bfloat16)
    base = np.concatenate([base, raw[base.size :]])  # odd sizes: keep the tail unchanged
    enc = encode(raw, itemsize, base=base)
    assert np.array_equal(_roundtrip(enc, raw, base), raw)


def test_accepts_bytes_memoryview_and_typed_arrays() -> None:
    arr32 = torch.randn(5000).numpy()  # float32 ndarray, not uint8
    raw = arr32.view(np.uint8)
    for src in (arr32, bytes(raw), memoryview(arr32), bytearray(raw)):
        enc = encode(src, 4, policy=EncodePolicy(force=ZSTD))
        out = bytearray(raw.size)
        decode(enc.codec, enc.payload, raw.size, enc.itemsize, memoryview(out))
        assert bytes(out) == raw.tobytes()


# --------------------------------------------------------------------------- choice


def test_delta_chosen_and_small_for_bf16_optimizer_step() -> None:
    raw = _float_bytes(4 << 20, torch.bfloat16)
    base = _adamw_step(raw, torch.bfloat16)
    enc = encode(raw, 2, base=base)
    assert enc.codec in DELTAS  # few elements changed: a patch (tests/format/test_patch_codec.py)
    assert enc.itemsize == 2
    assert len(enc.payload) < 0.4 * raw.size
    # and much smaller than compressing the weights on their own
    alone = encode(raw, 2, policy=LOOSE)
    assert alone.codec == ZSTD
    assert len(enc.payload) < 0.5 * len(alone.payload)
    assert np.array_equal(_roundtrip(enc, raw, base), raw)


def test_byte_grouping_helps_floats() -> None:
    raw = _float_bytes(1 << 20, torch.bfloat16)
    grouped = encode(raw, 2, policy=EncodePolicy(force=ZSTD))
    plain = encode(raw, 1, policy=EncodePolicy(force=ZSTD))
    assert grouped.itemsize == 2 and plain.itemsize == 1
    assert len(grouped.payload) < 0.9 * len(plain.payload)


def test_incompressible_is_raw_zero_copy() -> None:
    raw = _random_bytes(4 << 20)
    enc = encode(raw, 4, base=_random_bytes(4 << 20, seed=9))
    assert enc.codec == RAW
    assert enc.itemsize == 1
    assert len(enc.payload) == raw.size
    # zero copy: the payload shares memory with the input
    assert np.shares_memory(np.frombuffer(enc.payload, np.uint8), raw)


def test_small_incompressible_is_raw() -> None:
    raw = _random_bytes(1000)
    assert encode(raw, 2).codec == RAW


def test_compressible_data_not_raw() -> None:
    raw = np.zeros(1 << 20, dtype=np.uint8)
    enc = encode(raw, 4)
    assert enc.codec == ZSTD
    assert len(enc.payload) < 1000


def test_mostly_random_chunk_with_compressible_probe_falls_back_to_raw() -> None:
    # The probe samples 4 spread slices; zero those and fill the rest with noise, so the probe
    # is fooled but the full result must still fall back to RAW.
    size = 4 << 20
    raw = _random_bytes(size)
    piece = (64 << 10) // 4
    last = size - piece
    for i in range(4):
        s = last * i // 3
        raw[s : s + piece] = 0
    enc = encode(raw, 1)
    assert enc.codec == RAW


def test_xor_not_candidate_when_base_length_differs() -> None:
    raw = _float_bytes(1 << 20, torch.bfloat16)
    base = _adamw_step(raw, torch.bfloat16)[:-2]
    enc = encode(raw, 2, base=base, policy=LOOSE)
    assert enc.codec == ZSTD
    forced = encode(raw, 2, base=base, policy=EncodePolicy(force=XOR))
    assert forced.codec == ZSTD  # documented fallback
    assert np.array_equal(_roundtrip(forced, raw), raw)


def test_force_xor_without_base_falls_back_to_zstd() -> None:
    raw = _float_bytes(4096, torch.float32)
    enc = encode(raw, 4, policy=EncodePolicy(force=XOR))
    assert enc.codec == ZSTD
    assert np.array_equal(_roundtrip(enc, raw), raw)


def test_force_ignores_min_gain() -> None:
    raw = _random_bytes(1 << 16)
    enc = encode(raw, 1, policy=EncodePolicy(force=ZSTD))
    assert enc.codec == ZSTD
    assert len(enc.payload) > raw.size  # would have been RAW without force
    assert np.array_equal(_roundtrip(enc, raw), raw)
    assert encode(np.zeros(4096, np.uint8), 1, policy=EncodePolicy(force=RAW)).codec == RAW


def test_codecs_raw_only_turns_encoding_off() -> None:
    raw = np.zeros(1 << 20, dtype=np.uint8)
    enc = encode(raw, 4, base=raw.copy(), policy=EncodePolicy(codecs=(RAW,)))
    assert enc.codec == RAW
    assert np.shares_memory(np.frombuffer(enc.payload, np.uint8), raw)


def test_codecs_without_raw_always_encodes() -> None:
    raw = _random_bytes(1 << 20)
    enc = encode(raw, 1, policy=EncodePolicy(codecs=(ZSTD,)))
    assert enc.codec == ZSTD
    assert np.array_equal(_roundtrip(enc, raw), raw)


def test_codecs_without_xor_never_xor() -> None:
    raw = _float_bytes(1 << 20, torch.bfloat16)
    base = _adamw_step(raw, torch.bfloat16)
    enc = encode(raw, 2, base=base, policy=EncodePolicy(codecs=(RAW, ZSTD), zstd_min_gain=0.9))
    assert enc.codec == ZSTD


def test_probe_disabled_still_chooses_best() -> None:
    raw = _float_bytes(1 << 20, torch.bfloat16)
    base = _adamw_step(raw, torch.bfloat16)
    enc = encode(raw, 2, base=base, policy=EncodePolicy(probe_bytes=0))
    # the best of the allowed codecs, each compressed in full, a delta listed as xor also
    # written as a patch when that is at most PATCH_PREFERENCE x the best other size (which one
    # wins depends on how many elements the simulated step changed: the draws differ by
    # processor; measured 3 kB of xor here, 24 kB xor / 10 kB patch on an H100 host)
    sizes = {
        c: len(encode(raw, 2, base=base, policy=EncodePolicy(force=c)).payload)
        for c in (RAW, ZSTD, XOR, PATCH)
    }
    others = min(n for c, n in sizes.items() if c != PATCH)
    if sizes[PATCH] <= PATCH_PREFERENCE * others:
        assert enc.codec == PATCH and len(enc.payload) == sizes[PATCH]
    else:
        assert len(enc.payload) == others and enc.codec != RAW
    assert np.array_equal(_roundtrip(enc, raw, base), raw)
    assert encode(_random_bytes(1 << 20), 2, policy=EncodePolicy(probe_bytes=0)).codec == RAW


def test_level_is_applied() -> None:
    # Level 1 is not always larger than higher levels on grouped float noise (measured: level 1
    # was the smallest), so only check that the level reaches zstd and still round-trips.
    raw = _float_bytes(1 << 18, torch.float32)
    fast = encode(raw, 4, policy=EncodePolicy(force=ZSTD, level=1))
    other = encode(raw, 4, policy=EncodePolicy(force=ZSTD, level=9))
    assert bytes(other.payload) != bytes(fast.payload)
    assert np.array_equal(_roundtrip(other, raw), raw)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs",
    [{"codecs": ("lz4",)}, {"codecs": ()}, {"force": "gzip"}, {"min_gain": 0}, {"probe_bytes": -1}],
)
def test_bad_policy(kwargs: dict) -> None:
    with pytest.raises(CodecError):
        EncodePolicy(**kwargs)


def test_unknown_codec() -> None:
    with pytest.raises(CodecError, match="unknown codec 'lz4'"):
        decode("lz4", b"x", 1, 1, np.empty(1, np.uint8))


def test_bad_itemsize() -> None:
    with pytest.raises(CodecError, match="itemsize"):
        encode(b"abc", 0)


def _zstd_payload(size: int = 1 << 16) -> tuple[np.ndarray, Encoded]:
    raw = _float_bytes(size, torch.float32)
    enc = encode(raw, 4, policy=EncodePolicy(force=ZSTD))
    return raw, enc


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_corrupted_payload(where: str) -> None:
    raw, enc = _zstd_payload()
    bad = bytearray(enc.payload)
    pos = {"header": 0, "middle": len(bad) // 2, "end": len(bad) - 1}[where]
    bad[pos] ^= 0x5A
    with pytest.raises(CodecError, match="zstd"):
        decode(ZSTD, bad, raw.size, enc.itemsize, np.empty(raw.size, np.uint8))


def test_truncated_payload() -> None:
    raw, enc = _zstd_payload()
    with pytest.raises(CodecError):
        decode(
            ZSTD, enc.payload[: len(enc.payload) // 2], raw.size, 4, np.empty(raw.size, np.uint8)
        )


def test_wrong_size() -> None:
    raw, enc = _zstd_payload()
    with pytest.raises(CodecError, match=f"expected {raw.size + 1}"):
        decode(ZSTD, enc.payload, raw.size + 1, 4, np.empty(raw.size + 1, np.uint8))
    with pytest.raises(CodecError, match="out has"):
        decode(ZSTD, enc.payload, raw.size, 4, np.empty(raw.size - 1, np.uint8))
    with pytest.raises(CodecError, match="raw payload has 3 bytes, expected 4"):
        decode(RAW, b"abc", 4, 1, np.empty(4, np.uint8))


def test_xor_missing_or_wrong_base() -> None:
    raw = _float_bytes(1 << 16, torch.bfloat16)
    base = _adamw_step(raw, torch.bfloat16)
    enc = encode(raw, 2, base=base, policy=EncodePolicy(force=XOR))
    out = np.empty(raw.size, np.uint8)
    with pytest.raises(CodecError, match="needs base"):
        decode(XOR, enc.payload, raw.size, 2, out)
    with pytest.raises(CodecError, match="base has"):
        decode(XOR, enc.payload, raw.size, 2, out, base=base[:-2])


def test_readonly_out() -> None:
    raw, enc = _zstd_payload(4096)
    with pytest.raises(CodecError, match="read-only"):
        decode(ZSTD, enc.payload, raw.size, 4, bytes(raw.size))


# --------------------------------------------------------------------------- buffers & threads


def test_decode_into_reused_out_buffer() -> None:
    out = np.full(1 << 20, 0xAB, dtype=np.uint8)
    for seed, (codec, itemsize) in enumerate([(ZSTD, 2), (XOR, 4), (RAW, 1), (ZSTD, 8)]):
        raw = _float_bytes(out.size, torch.float32, seed=seed)
        base = _adamw_step(raw, torch.float32, seed=seed)
        enc = encode(raw, itemsize, base=base, policy=EncodePolicy(force=codec))
        decode(enc.codec, enc.payload, raw.size, enc.itemsize, out, base=base)
        assert np.array_equal(out, raw)
    # a slice of a larger reused buffer works too, and nothing outside it is touched
    big = np.full(2 << 20, 0xCD, dtype=np.uint8)
    decode(enc.codec, enc.payload, raw.size, enc.itemsize, big[100 : 100 + raw.size])
    assert np.array_equal(big[100 : 100 + raw.size], raw)
    assert (big[:100] == 0xCD).all() and (big[100 + raw.size :] == 0xCD).all()


def test_xor_decode_in_place_over_base() -> None:
    # Weight sync: the receiver holds the base in its tensor and applies the delta in place.
    raw = _float_bytes((1 << 20) + 3, torch.float32)
    base = np.concatenate([_adamw_step(raw[:-3], torch.float32), raw[-3:]])
    enc = encode(raw, 4, base=base)
    assert enc.codec == XOR
    decode(enc.codec, enc.payload, raw.size, enc.itemsize, base, base=base)
    assert np.array_equal(base, raw)


def test_payload_independent_of_scratch_reuse() -> None:
    # Encoded payloads must not alias per-thread scratch: a later encode must not change them.
    raw1 = _float_bytes(1 << 18, torch.float32, seed=1)
    enc1 = encode(raw1, 4, policy=EncodePolicy(force=ZSTD))
    saved = bytes(enc1.payload)
    encode(_float_bytes(1 << 19, torch.float32, seed=2), 4, policy=EncodePolicy(force=ZSTD))
    assert bytes(enc1.payload) == saved


def test_concurrent_encode_decode_4_threads() -> None:
    n_chunks = 24
    chunks = []
    for i in range(n_chunks):
        dtype = [torch.bfloat16, torch.float32][i % 2]
        size = [1 << 20, (1 << 18) + 3, 4096][i % 3]
        raw = _float_bytes(size, dtype, seed=i)
        base = _adamw_step(raw[: size - size % 4], dtype, seed=100 + i)
        base = np.concatenate([base, raw[base.size :]])
        # every third chunk has no base (a new tensor): ZSTD instead of XOR
        chunks.append((raw, None if i % 3 == 1 else base, 2 if dtype == torch.bfloat16 else 4))
    chunks[3] = (_random_bytes(1 << 20, seed=3), None, 1)  # one RAW in the mix

    barrier = threading.Barrier(4)

    def work(idx: int) -> tuple[str, bool]:
        if idx < 4:
            barrier.wait(timeout=10)  # make the first four really overlap
        raw, base, itemsize = chunks[idx]
        ok = True
        for _ in range(3):
            enc = encode(raw, itemsize, base=base, policy=LOOSE)
            out = np.empty(raw.size, np.uint8)
            decode(enc.codec, enc.payload, raw.size, enc.itemsize, out, base=base)
            ok &= bool(np.array_equal(out, raw))
        return enc.codec, ok

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(work, range(n_chunks)))
    assert all(ok for _, ok in results)
    assert {codec for codec, _ in results} == {RAW, ZSTD, XOR, PATCH}  # every path, concurrently


def test_default_keeps_dense_floats_raw_but_compresses_sparse_data_and_deltas() -> None:
    dense = _float_bytes(1 << 20, torch.bfloat16)  # zstd reaches only ~0.7 here
    assert encode(dense, 2).codec == RAW
    assert encode(dense, 2, policy=LOOSE).codec == ZSTD
    sparse = np.zeros(1 << 20, dtype=np.uint8)
    sparse[::97] = 7
    assert encode(sparse, 1).codec == ZSTD
    base = _adamw_step(dense, torch.bfloat16)
    assert encode(dense, 2, base=base).codec in DELTAS
