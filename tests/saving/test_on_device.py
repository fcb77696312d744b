"""Saves of device state: chunk fingerprints found where the state lives, only changed chunks
copied to the host (saving/on_device.py, format/fingerprint.py).

The CPU suite runs the device path on CPU tensors (``DELTACKPT_DEVICE_SCAN=always``): the same
torch operations a GPU runs. The ``gpu`` tests check that CUDA gives the same fingerprints and
that CUDA state takes this path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import deltackpt
from deltackpt.errors import InvalidArgumentError
from deltackpt.format import fingerprint, fingerprint_kernel
from deltackpt.format.fingerprint import source_fingerprints
from deltackpt.options import overrides
from deltackpt.saving.engine import saver_for
from deltackpt.saving.hooks import hooks
from tests._dist import free_port, init_gloo, run_ranks

M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def reference(data: bytes, chunk: int) -> list[list[int]]:
    """format/fingerprint.py's definition, in plain Python integers."""
    out = []
    for lo in range(0, len(data), chunk):
        c = data[lo : lo + chunk]
        c += bytes(-len(c) % 8)
        a = b = 0
        for i in range(len(c) // 8):
            w = int.from_bytes(c[8 * i : 8 * i + 8], "little")
            p = _mix((i * 0x9E3779B97F4A7C15 + 0x243F6A8885A308D3) & M64)
            q = _mix((i * 0x9E3779B97F4A7C15 + 0x13198A2E03707344) & M64) | 1
            m = _mix(w ^ p)
            a, b = (a + m) & M64, (b + m * q) & M64
        out.append([_signed(a), _signed(b)])
    return out


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 200, 1000])
def test_fingerprints_follow_their_definition(n):
    data = _bytes(n)
    assert source_fingerprints(data, 64).tolist() == reference(bytes(data.tolist()), 64)


def test_the_host_c_pass_gives_the_torch_operations_integers(monkeypatch):
    """On host bytes the fingerprints run in one C pass (``_native.fp_rows``); the torch
    operations (what a GPU runs) must give the same integers, slabs, tails and mixed sources."""
    if fingerprint._native_rows is None:
        pytest.skip("no C extension in this install (the torch operations are the only path)")
    sources = [_bytes(n, seed=n) for n in (0, 5, 8, 4096, 1 << 20, (1 << 20) + 13, 3 << 20)]
    chunk = 1 << 20
    native = fingerprint.many_fingerprints(sources, chunk)
    one = [source_fingerprints(s, chunk) for s in sources]
    monkeypatch.setattr(fingerprint, "_native_rows", None)
    assert [t.tolist() for t in fingerprint.many_fingerprints(sources, chunk)] == [
        t.tolist() for t in native
    ]
    assert [t.tolist() for t in one] == [source_fingerprints(s, chunk).tolist() for s in sources]


def test_unaligned_bytes_give_the_fingerprint_of_their_values():
    data = _bytes(301)
    for offset in (1, 3, 5):
        view = data[offset:]  # data_ptr not 8-byte aligned: fingerprinted from a copy
        assert source_fingerprints(view, 64).tolist() == reference(bytes(view.tolist()), 64)


def test_chunk_bytes_must_be_whole_words():
    with pytest.raises(ValueError, match="multiple of 8"):
        source_fingerprints(_bytes(64), 12)


@settings(max_examples=60, deadline=None)
@given(
    n=hst.integers(1, 600),
    pos=hst.integers(0, 10**6),
    flip=hst.integers(1, 255),
    seed=hst.integers(0, 1000),
)
def test_a_changed_byte_always_changes_its_chunks_fingerprint(n, pos, flip, seed):
    data = _bytes(n, seed)
    before = source_fingerprints(data, 128)
    i = pos % n
    data[i] ^= flip
    after = source_fingerprints(data, 128)
    changed = (before != after).any(dim=1).tolist()
    assert changed == [c == i // 128 for c in range(len(changed))]


def test_swapped_words_change_the_fingerprint():
    data = _bytes(64, 3)
    words = data.view(torch.int64).clone()
    swapped = words[[1, 0, *range(2, 8)]].contiguous().view(torch.uint8)
    assert source_fingerprints(data, 64).tolist() != source_fingerprints(swapped, 64).tolist()


def _many_sources(chunk: int) -> list[torch.Tensor]:
    """Sources of every kind many_fingerprints treats apart: empty, within a word, whole words,
    tails of every width class, one and several chunks, big enough to pass in place, and
    starting at unaligned bytes (views of one buffer at odd offsets)."""
    sizes = [0, 3, 8, 13, 64, 4096, 8197, chunk, chunk + 7, 2 * chunk + 5, 5 * chunk, 9 * chunk + 1]
    sizes += [100, chunk - 1, 3 * chunk]
    buf, pos, out = _bytes(sum(sizes) + 3 * len(sizes) + 1, 11), 1, []
    for n in sizes:
        out.append(buf[pos : pos + n])
        pos += n + 3
    return out


@pytest.mark.parametrize("chunk", [64, 4096, 1 << 16])
def test_many_fingerprints_are_each_sources_fingerprints(chunk, monkeypatch):
    """The batched form (device rounds' digests, the sync scan): the same integers as one call
    per source, whatever slabs the sources are grouped into (a slab of 8 chunks here, so that
    some sources pass alone, in place, and the others are concatenated across several slabs)."""
    monkeypatch.setattr(fingerprint, "SLAB_BYTES", 8 * chunk)
    srcs = _many_sources(chunk)
    got = fingerprint.many_fingerprints(srcs, chunk)
    for s, g in zip(srcs, got, strict=True):
        assert torch.equal(g, source_fingerprints(s, chunk)), s.numel()
    assert fingerprint.many_fingerprints([], chunk) == []
    with pytest.raises(ValueError, match="1-D uint8"):
        fingerprint.many_fingerprints([torch.zeros(8)], chunk)


@pytest.mark.parametrize("chunk", [64, 4096])
def test_the_kernels_table_points_at_every_chunk_of_every_source(chunk):
    """The Triton kernel's rows (built for all sources at once, ``fingerprint_kernel.table``):
    read here on the CPU, each row's first bytes are the bytes of its chunk in order (the
    kernel counts only those of a row's last word), an unaligned source read from an aligned
    copy; the rows of a source are its chunks and partial last chunk; a tail ending inside a
    word is read in place where its last word lies in its storage, else from a zero-padded
    copy. (The kernel itself: the gpu tests and TRITON_INTERPRET.)"""
    import ctypes

    srcs = _many_sources(chunk)
    addr, nbytes, rows_of, keep = fingerprint_kernel.table(srcs, chunk)
    assert rows_of.tolist() == [-(-s.numel() // chunk) for s in srcs]
    assert addr.size == nbytes.size == sum(rows_of.tolist())
    assert all(int(a) % 8 == 0 for a in addr)
    assert keep  # the unaligned sources were copied
    at = 0
    for s in srcs:
        for c in range(-(-s.numel() // chunk)):
            want = bytes(s[c * chunk : (c + 1) * chunk].tolist())
            assert int(nbytes[at]) == len(want)
            assert ctypes.string_at(int(addr[at]), len(want)) == want, (s.numel(), c)
            at += 1
    aligned = torch.zeros(3 * chunk, dtype=torch.uint8)  # none copied: the sources' own bytes
    a2, w2, r2, k2 = fingerprint_kernel.table(
        [aligned, aligned[:0], aligned[8 : chunk + 16], aligned[16 : 2 * chunk + 29]], chunk
    )
    base = aligned.data_ptr()
    # the last source's tail of 13 bytes is read in place: its last word is in the storage
    at16 = [base + 16, base + 16 + chunk, base + 16 + 2 * chunk]
    assert a2.tolist() == [base, base + chunk, base + 2 * chunk, base + 8, base + 8 + chunk, *at16]
    assert w2.tolist() == [chunk] * 4 + [8] + [chunk] * 2 + [13] and r2.tolist() == [3, 0, 2, 3]
    assert not k2
    # a tail whose last word lies past its storage (a tensor of its own): a zero-padded copy
    own = _bytes(chunk + 13, 5)
    a3, w3, _, k3 = fingerprint_kernel.table([own], chunk)
    assert a3[0] == own.data_ptr() and a3[1] == k3[0].data_ptr() and w3.tolist() == [chunk, 13]
    assert ctypes.string_at(int(a3[1]), 16) == bytes(own[chunk:].tolist()) + bytes(3)


def _message(chunk: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A message (what ``fingerprint_kernel.copy_spans`` copies) and its pieces' spans, each
    at an aligned offset as a message lays them out: empty, one byte, one word, pieces ending
    inside a word, a partial chunk, one and several chunks with tails of words and of bytes."""
    sizes = [0, 1, 8, 13, 64, 4094, chunk, chunk + 8, chunk + 3, 3 * chunk + 64]
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, n))
        pos = -(-(pos + n) // 64) * 64
    return _bytes(pos + 64, 12), spans


def test_the_fused_copy_refuses_what_it_cannot_copy_word_by_word():
    """``fingerprint_kernel.copy_spans``'s arguments are checked before anything launches."""
    p, q = fingerprint.position_keys(torch.device("cpu"), 8)
    src, dst = torch.zeros(72, dtype=torch.uint8), torch.zeros(80, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1-D uint8"):
        fingerprint_kernel.copy_spans(src.view(8, 9), dst, [(0, 8)], 64, p, q)
    with pytest.raises(ValueError, match="aligned words"):
        fingerprint_kernel.copy_spans(src, dst, [(0, 8), (4, 8)], 64, p, q)
    with pytest.raises(ValueError, match="aligned words"):
        fingerprint_kernel.copy_spans(src[1:], dst[1:], [(0, 8)], 64, p, q)
    with pytest.raises(ValueError, match="past the 72 bytes"):
        fingerprint_kernel.copy_spans(src, dst, [(64, 9)], 64, p, q)  # its last word: 72..79
    with pytest.raises(ValueError, match="cannot be negative"):
        fingerprint_kernel.copy_spans(src, dst, [(0, -8)], 64, p, q)
    with pytest.raises(ValueError, match="one device"):
        fingerprint_kernel.copy_spans(src, dst.to("meta"), [(0, 8)], 64, p, q)
    assert fingerprint_kernel.copy_spans(src, dst, [], 64, p, q) == []


def _pieces(chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sources of a sender's fused pack (``fingerprint_kernel.copy_into``): views of one
    buffer at aligned words, of every kind of length (their last words inside the buffer)."""
    sizes = [0, 1, 8, 13, 64, 4094, chunk, chunk + 8, chunk + 3, 3 * chunk + 64]
    buf, pos, out = _bytes(sum(sizes) + 8 * len(sizes) + 64, 5), 0, []
    for n in sizes:
        out.append(buf[pos : pos + n])
        pos = -(-(pos + n) // 8) * 8 + 8
    return buf, out


def test_the_fused_pack_refuses_what_it_cannot_copy_word_by_word():
    """``fingerprint_kernel.copy_into``'s arguments are checked before anything launches; a
    source whose last word lies past its storage is not read past it."""
    p, q = fingerprint.position_keys(torch.device("cpu"), 8)
    dst = torch.zeros(64, dtype=torch.uint8)
    src = torch.zeros(24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 sources but 2"):
        fingerprint_kernel.copy_into([src], dst, [0, 8], 64, p, q)
    with pytest.raises(ValueError, match="aligned word and its last word"):
        fingerprint_kernel.copy_into([src[1:9]], dst, [0], 64, p, q)
    with pytest.raises(ValueError, match="aligned word and its last word"):
        fingerprint_kernel.copy_into([torch.zeros(13, dtype=torch.uint8)], dst, [0], 64, p, q)
    assert fingerprint_kernel.whole_words(src[8:21])  # its last word is the storage's
    with pytest.raises(ValueError, match="offset 4 is not"):
        fingerprint_kernel.copy_into([src[:8]], dst, [4], 64, p, q)
    with pytest.raises(ValueError, match="offset 48 is not"):
        fingerprint_kernel.copy_into([src], dst, [48], 64, p, q)
    with pytest.raises(ValueError, match="1-D uint8 on cpu"):
        fingerprint_kernel.copy_into([src.view(torch.int64)], dst, [0], 64, p, q)
    assert fingerprint_kernel.copy_into([], dst, [], 64, p, q) == []
    got = fingerprint.pack_fingerprinted([src], dst, [0], 64)
    if fingerprint_kernel.available(torch.device("cpu")):  # Triton's interpreter
        assert got is not None and torch.equal(got[0], source_fingerprints(src, 64))
    else:  # no kernel: nothing copied, the caller copies and fingerprints apart
        assert got is None
    not_dense = torch.zeros(48, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="aligned word and its last word"):
        fingerprint_kernel.copy_into([not_dense], dst, [0], 64, p, q)
    with pytest.raises(ValueError, match="contiguous"):
        fingerprint_kernel.copy_spans(not_dense, dst[:24], [(0, 8)], 64, p, q)


# ---- saves through the device path, on CPU tensors ------------------------------------------


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300_000, generator=g),  # 1.2 MB: 5 chunks of 256 KiB
        "h": torch.randn(100_000, generator=g).to(torch.bfloat16)[1:],  # unaligned bytes
        "small": torch.randn(10, generator=g),  # grouped with other small tensors
        "step": 7,
    }


def _save(state, store, name: str) -> tuple[deltackpt.SnapshotInfo, int]:
    copied: list[int] = []
    with overrides(DELTACKPT_DEVICE_SCAN="always"), hooks.override(on_stage_copy=copied.append):
        info = deltackpt.save(state, store, name)
    return info, len(copied)


def _same(out: dict, state: dict) -> bool:
    return all(
        torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v
        for k, v in state.items()
    )


def test_unchanged_chunks_are_not_copied_and_changes_are(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=256 << 10)
    state = _state()
    info, copied = _save(state, store, "a")
    chunks = info.chunks_new
    assert copied == chunks and chunks >= 7  # first save: every chunk
    info, copied = _save(state, store, "b")
    assert copied == 1 and info.chunks_new == 0  # only the group of small tensors
    state["w"][299_000] += 1  # the last chunk of "w"
    state["h"][:3] = 0  # its first chunk
    info, copied = _save(state, store, "c")
    assert copied == 3 and info.chunks_new == 2
    assert _same(deltackpt.load(store, "c"), state)
    assert not torch.equal(deltackpt.load(store, "b")["w"], state["w"])


def test_a_chunk_gc_removed_is_copied_and_written_again(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=256 << 10)
    state = _state(1)
    _save(state, store, "a")
    deltackpt.delete(store, "a")
    deltackpt.gc(store)
    info, copied = _save(state, store, "b")  # same fingerprints, but the store lost the chunks
    assert copied == info.chunks_new and info.chunks_new >= 7
    assert _same(deltackpt.load(store, "b"), state)


def test_a_failed_save_leaves_nothing_that_a_later_save_trusts(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=256 << 10)
    state = _state(2)
    _save(state, store, "a")
    state["w"][0] = 42.0

    def fail(name: str) -> None:
        raise OSError(28, "No space left on device")

    with hooks.override(before_commit=fail), pytest.raises(deltackpt.errors.StoreIOError):
        _save(state, store, "b")
    info, copied = _save(state, store, "c")  # "w"'s first chunk is new to the store again
    assert info.chunks_new == 1 and copied == 2
    assert _same(deltackpt.load(store, "c"), state)


def test_host_memory_of_a_device_save_is_a_ring_not_a_copy_of_the_state(store_dir, monkeypatch):
    """The hash pass copies changed chunks through RING_SLOTS buffers of SLOT_BYTES, step 3
    copies each chunk it writes into a buffer of its thread: the host memory a sync save of
    device state allocates stays bounded however large the state, and the arena holds only the
    small sources of group chunks; every chunk written is still the state's."""
    from deltackpt.saving import on_device

    monkeypatch.setattr(on_device, "SLOT_BYTES", 256 << 10)
    made: list[int] = []
    real = on_device.host_buffer
    monkeypatch.setattr(on_device, "host_buffer", lambda n, pin: made.append(n) or real(n, pin))
    store = deltackpt.open_store(store_dir, chunk_bytes=64 << 10)
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(250_000, generator=g) for i in range(4)}  # 4 MB, 64 chunks
    state["small"] = torch.randn(10, generator=g)
    info, copied = _save(state, store, "a")
    assert info.chunks_new == copied == 64 + 1
    threads = 16  # at most one chunk buffer per writing thread
    assert sum(made) <= on_device.RING_SLOTS * (256 << 10) + threads * (64 << 10)
    assert sum(made) < 4_000_000 / 2  # well under a copy of the state
    assert saver_for(store)._arenas[0].nbytes() < 1 << 10  # the small tensor's bytes only
    assert _same(deltackpt.load(store, "a"), state)
    # a step that changes a few chunks: only they are copied, twice, and written
    made.clear()
    state["w2"][1000] += 1.0
    info, copied = _save(state, store, "b")
    assert info.chunks_new == 1 and copied == 2
    assert _same(deltackpt.load(store, "b"), state)


def test_state_written_during_a_device_save_fails_it_naming_the_tensor(store_dir):
    """A chunk whose bytes change between the hash pass and its write (a write from another
    stream or thread during a sync save) fails the save, naming the tensor; nothing is
    committed, and the next save writes the state as it is then."""
    store = deltackpt.open_store(store_dir, chunk_bytes=64 << 10)
    state = {"w": torch.zeros(100_000), "v": torch.ones(50_000)}

    def scribble(ci: int) -> None:  # after the hash pass copied chunk ci
        state["w"][-1] = float(ci + 1)

    with (
        overrides(DELTACKPT_DEVICE_SCAN="always"),
        hooks.override(on_stage_copy=scribble),
        pytest.raises(deltackpt.errors.SaveFailedError, match="'w' changed while it was being"),
    ):
        deltackpt.save(state, store, "a")
    assert deltackpt.snapshots(store) == []
    _save(state, store, "b")
    assert _same(deltackpt.load(store, "b"), state)


def test_a_resized_tensor_is_not_matched_by_an_old_fingerprint(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=256 << 10)
    state = {"w": torch.zeros(1000)}
    _save(state, store, "a")
    state["w"] = torch.zeros(1002)  # the same words plus zeros: the same fingerprint
    info, copied = _save(state, store, "b")
    assert copied == 1 and info.chunks_new == 1
    assert torch.equal(deltackpt.load(store, "b")["w"], state["w"])


def test_the_knob_is_validated(store_dir):
    with (
        overrides(DELTACKPT_DEVICE_SCAN="sometimes"),
        pytest.raises(InvalidArgumentError, match="DELTACKPT_DEVICE_SCAN"),
    ):
        deltackpt.save({"x": torch.ones(2)}, store_dir, "a")


def _two_ranks(rank: int, world: int, port: int, path: str) -> list[tuple[int, int, bool]]:
    pg = init_gloo(rank, world, port)
    store = deltackpt.open_store(path, chunk_bytes=256 << 10)
    state = _state()  # the same on both ranks: replicated
    out = []
    for name in ("a", "b", "c"):
        if name == "c":
            state["w"][5] = 1.0
        info, copied = _save_pg(state, store, name, pg)
        out.append((copied, info.chunks_new, _same(deltackpt.load(store, name), state)))
    return out


def _save_pg(state, store, name, pg):
    copied: list[int] = []
    with overrides(DELTACKPT_DEVICE_SCAN="always"), hooks.override(on_stage_copy=copied.append):
        info = deltackpt.save(state, store, name, process_group=pg)
    return info, len(copied)


@pytest.mark.multiproc
def test_a_distributed_save_takes_the_device_path_on_every_rank(tmp_path):
    results = run_ranks(_two_ranks, 2, free_port(), str(tmp_path / "s"), timeout=120)
    for a, b, c in results:
        assert a[0] >= 7 and a[2]
        assert b[0] == 1 and b[1] == 0 and b[2]  # the group of small tensors only
        assert c[0] == 2 and c[1] == 1 and c[2]


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_fingerprints_equal_the_cpu_ones():
    for n, chunk in ((1, 64), (1000, 64), (3 << 20, 1 << 20), ((5 << 20) + 3, 4 << 20)):
        data = _bytes(n, n)
        cpu = source_fingerprints(data, chunk)
        assert torch.equal(source_fingerprints(data.cuda(), chunk).cpu(), cpu)
        assert torch.equal(source_fingerprints(data.cuda()[1:], chunk).cpu(),
                           source_fingerprints(data[1:], chunk))  # fmt: skip


@pytest.mark.gpu
def test_cuda_many_fingerprints_equal_the_cpu_ones():
    chunk = 1 << 20
    srcs = _many_sources(chunk)
    cpu = fingerprint.many_fingerprints(srcs, chunk)
    kernels = ["torch", "compile"]
    kernels += ["triton"] if fingerprint_kernel.available(torch.device("cuda")) else []
    for kernel in kernels:
        got = fingerprint.many_fingerprints([s.cuda() for s in srcs], chunk, kernel)
        for s, g, c in zip(srcs, got, cpu, strict=True):
            assert torch.equal(g.cpu(), c), (s.numel(), kernel)
        one = fingerprint.source_fingerprints(srcs[-1].cuda(), chunk, kernel)
        assert torch.equal(one.cpu(), cpu[-1]), kernel
    assert "triton" in kernels, "Triton is not importable next to torch's CUDA build"


@pytest.mark.gpu
def test_the_fused_copy_on_cuda_copies_and_gives_the_cpu_fingerprints():
    chunk = 1 << 20
    msg, spans = _message(chunk)
    on = msg.cuda()
    dest = torch.full_like(on, 0xAB)
    p, q = fingerprint.position_keys(torch.device("cuda"), chunk // 8)
    got = fingerprint_kernel.copy_spans(on, dest, spans, chunk, p, q)
    back = dest.cpu()
    for (o, n), g in zip(spans, got, strict=True):
        assert torch.equal(back[o : o + n], msg[o : o + n]), n
        assert torch.equal(g.cpu(), fingerprint.source_fingerprints(msg[o : o + n], chunk)), n
    buf, srcs = _pieces(chunk)  # the pack: sources into one bucket
    on_buf = buf.cuda()
    on = [on_buf[s.data_ptr() - buf.data_ptr() :][: s.numel()] for s in srcs]
    offs = [64 * 1024 * i + (0 if i < 6 else chunk * (i - 5) * 4) for i in range(len(srcs))]
    bucket = torch.full((offs[-1] + 4 * chunk,), 0xAB, dtype=torch.uint8, device="cuda")
    packed = fingerprint.pack_fingerprinted(on, bucket, offs, chunk)
    assert packed is not None, "the fused pack did not run on CUDA"
    back = bucket.cpu()
    for s, o, g in zip(srcs, offs, packed, strict=True):
        assert torch.equal(back[o : o + s.numel()], s), s.numel()
        assert torch.equal(g.cpu(), fingerprint.source_fingerprints(s, chunk)), s.numel()


def test_auto_falls_back_to_torch_ops_once_the_kernel_fails(monkeypatch):
    """DELTACKPT_FINGERPRINT_COMPILE=auto (the default): a kernel that fails (a Triton too old
    for it, a compiler error) is warned about once and not tried again; the fingerprints come
    from the torch operations, the same integers. ``triton`` raises the error instead."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no such intrinsic")

    monkeypatch.setattr(fingerprint_kernel, "tl", object())  # as if Triton were importable
    monkeypatch.setattr(fingerprint_kernel, "many", broken)
    monkeypatch.setattr(fingerprint_kernel, "_FAILED", [])
    cpu = torch.device("cpu")
    monkeypatch.setattr(fingerprint_kernel, "available", lambda d: not fingerprint_kernel._FAILED)
    srcs = _many_sources(4096)
    ref = [source_fingerprints(s, 4096) for s in srcs]
    with pytest.raises(RuntimeError, match="no such intrinsic"):
        fingerprint.many_fingerprints(srcs, 4096, "triton")
    with pytest.warns(RuntimeWarning, match="Triton fingerprint kernel failed"):
        got = fingerprint.many_fingerprints(srcs, 4096, "auto")
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    again = fingerprint.source_fingerprints(srcs[-1], 4096, "auto")  # not tried again
    assert torch.equal(again, ref[-1]) and len(calls) == 2 and not fingerprint_kernel.available(cpu)


_INTERPRET = """
import sys, torch
sys.path[:0] = sys.argv[1:]
from deltackpt.format import fingerprint, fingerprint_kernel
from tests.saving.test_on_device import _many_sources, _message, _pieces
assert fingerprint_kernel.available(torch.device("cpu"))
fingerprint_kernel.INTERPRET_BLOCK = fingerprint_kernel.BLOCK  # the GPU's programs, one by one
for chunk in (64, 4096, 1 << 16):
    # views of one buffer (odd tails read in place) and a tensor of its own (its tail copied)
    srcs = _many_sources(chunk) + [torch.randint(0, 256, (chunk + 13,), dtype=torch.uint8)]
    got = fingerprint.many_fingerprints(srcs, chunk, "triton")
    for s, g in zip(srcs, got, strict=True):
        assert torch.equal(g, fingerprint.source_fingerprints(s, chunk)), (chunk, s.numel())
    # the fused copy: every byte copied, the fingerprints of what was written
    msg, spans = _message(chunk)
    dest = torch.full_like(msg, 0xAB)
    p, q = fingerprint.position_keys(torch.device("cpu"), chunk // 8)
    fused = fingerprint_kernel.copy_spans(msg, dest, spans, chunk, p, q)
    for (o, n), g in zip(spans, fused, strict=True):
        assert torch.equal(dest[o : o + n], msg[o : o + n]), (chunk, n)
        assert torch.equal(g, fingerprint.source_fingerprints(msg[o : o + n], chunk)), (chunk, n)
    # the fused pack: each source at its offset, the fingerprints of each
    _, srcs = _pieces(chunk)
    offs = [0]
    for s in srcs[:-1]:
        offs.append(-(-(offs[-1] + s.numel()) // 64) * 64)
    dest = torch.full((offs[-1] + srcs[-1].numel() + 64,), 0xAB, dtype=torch.uint8)
    packed = fingerprint_kernel.copy_into(srcs, dest, offs, chunk, p, q)
    for s, o, g in zip(srcs, offs, packed, strict=True):
        assert torch.equal(dest[o : o + s.numel()], s), (chunk, s.numel())
        assert torch.equal(g, fingerprint.source_fingerprints(s, chunk)), (chunk, s.numel())
print("same")
"""


def test_the_triton_kernel_gives_the_torch_fingerprints_in_its_interpreter():
    """DELTACKPT_FINGERPRINT_COMPILE=triton: the hand-written kernel, run by Triton's
    interpreter on CPU tensors (it must be asked for before Triton is imported: a process of
    its own), gives the torch operations' integers for every kind of source."""
    r = _triton_script(_INTERPRET, TRITON_INTERPRET="1")
    assert r.returncode == 0 and "same" in r.stdout, r.stderr[-3000:]


def _triton_script(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by a Python of its own (Triton reads ``TRITON_INTERPRET`` when it is
    imported) with this checkout first on its path and ``env`` added to the environment (an
    empty value removes the variable); skipped where Triton is not installed."""
    pytest.importorskip("triton", reason="Triton is not installed (torch's CUDA builds bring it)")
    root = str(Path(__file__).resolve().parents[2])
    full = {**os.environ, **env}
    full = {k: v for k, v in full.items() if v or k not in env}
    return subprocess.run(
        [sys.executable, "-c", script, root], env=full, capture_output=True, text=True, timeout=300
    )


_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path[:0] = sys.argv[1:]
from deltackpt.format import fingerprint_kernel as fk
sig = {k: "*i64" for k in ("addr_ptr", "dst_ptr", "bytes_ptr", "p_ptr", "q_ptr", "out_ptr")}
sig.update(NBLK="i32", BLOCK="constexpr", COPY="constexpr")
for copy in (False, True):
    src = ASTSource(fn=fk._kernel(), signature=sig, constexprs={"BLOCK": fk.BLOCK, "COPY": copy})
    for cap in (80, 90):
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32))
        assert k.asm["cubin"] and ".entry" in k.asm["ptx"], (copy, cap)
        print("compiled", copy, cap)
"""


def test_the_triton_kernel_compiles_for_the_gpus_without_one(tmp_path):
    """The kernel (both variants: fingerprints only, and the fused copy) compiled all the way to
    machine code for an A100 (sm_80) and an H100/H200 (sm_90) by Triton's own NVIDIA backend
    and the ptxas its wheel carries, on a machine with no GPU: a change that no longer compiles
    fails here, not in the minutes a GPU machine is lent (the interpreter test above checks the
    integers, not that the GPU compiler takes the kernel)."""
    r = _triton_script(
        _COMPILE, TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", TRITON_INTERPRET=""
    )
    assert r.returncode == 0 and r.stdout.count("compiled") == 4, r.stderr[-3000:]


@pytest.mark.gpu
def test_an_unchanged_save_of_cuda_state_copies_nothing(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=1 << 20)
    state = {"w": torch.randn(1 << 20, device="cuda"), "m": torch.randn(1 << 20, device="cuda")}
    copied: list[int] = []
    with hooks.override(on_stage_copy=copied.append):
        deltackpt.save(state, store, "a")
        first = len(copied)
        deltackpt.save(state, store, "b")
        assert len(copied) == first  # fingerprints on the device: nothing crossed
        state["w"][7] += 1
        deltackpt.save(state, store, "c")
        assert len(copied) == first + 1
    out = deltackpt.load(store, "c")
    assert all(torch.equal(out[k], v.cpu()) for k, v in state.items())
    arena = saver_for(store).arenas[0]
    assert all(b.is_pinned() for b in arena.buffers.values())


@pytest.mark.gpu
def test_mixed_cpu_and_cuda_state_and_the_off_switch(store_dir):
    store = deltackpt.open_store(store_dir, chunk_bytes=1 << 20)
    state = {
        "w": torch.randn(1 << 20, device="cuda"),
        "cpu": torch.randn(1 << 19),  # an RNG state or a counter kept on the host
        "step": 3,
    }
    copied: list[int] = []
    with hooks.override(on_stage_copy=copied.append):
        deltackpt.save(state, store, "a")
        first = len(copied)
        with overrides(DELTACKPT_DEVICE_SCAN="off"):  # trust no fingerprint: copy every chunk
            deltackpt.save(state, store, "b")
        assert len(copied) == 2 * first
        deltackpt.save(state, store, "c")  # the fingerprints of "a" were kept: nothing moved
        assert len(copied) == 2 * first
    out = deltackpt.load(store, "c")
    assert torch.equal(out["w"], state["w"].cpu()) and torch.equal(out["cpu"], state["cpu"])


@pytest.mark.gpu
def test_cuda_state_round_trips_through_save_async_save_and_load_into(store_dir):
    state = {"w": torch.randn(3 << 20, device="cuda").to(torch.bfloat16), "b": torch.ones(7).cuda()}
    deltackpt.save(state, store_dir, "sync")
    deltackpt.async_save(state, store_dir, "async").result(timeout=120)
    for name in ("sync", "async"):
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        deltackpt.load(store_dir, name, into=into)
        assert all(torch.equal(into[k], state[k]) for k in state), name
