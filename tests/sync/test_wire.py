"""The bucket message: piece layout with zero-copy pieces, and header validation (a
received header is untrusted input)."""

from __future__ import annotations

import random

import pytest
import torch

from deltackpt.sync import wire
from deltackpt.sync.errors import SyncError


def _capacity(sizes: list[int], align: int) -> int:
    """The schedule's capacity: every piece, in planned order, each at an aligned offset."""
    used = 0
    for n in sizes:
        used = -(-used // align) * align + n
    return used


def test_layout_puts_message_pieces_first_and_fits_the_slot() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        align = rng.choice([1, 8, 64, 256])
        sizes = [rng.choice([1, 3, 64, 100, 255, 4096]) for _ in range(rng.randint(1, 9))]
        flags = [rng.choice([0, wire.IN_MESSAGE, wire.DIRECT]) for _ in sizes]
        start = 2 * align  # payload_start() is aligned
        offsets, msg_end, end = wire.layout(sizes, flags, start, align)
        placed = sorted((o, k) for k, o in enumerate(offsets) if o is not None)
        assert [k for _, k in placed] == [k for k, f in enumerate(flags) if f == 1] + [
            k for k, f in enumerate(flags) if f == 2
        ]
        pos = start
        for o, k in placed:  # aligned, in order, no overlap
            assert o % align == 0 and o >= pos
            pos = o + sizes[k]
        assert end == pos and start <= msg_end <= end
        assert all(offsets[k] is None for k, f in enumerate(flags) if f == 0)
        ins = [offsets[k] + sizes[k] for k, f in enumerate(flags) if f == 1]  # type: ignore[operator]
        assert msg_end == (max(ins) if ins else start)
        # any subset in this order fits in the room message_bytes() gives: capacity + align
        assert end - start <= _capacity(sizes, align) + align


SIZES = [100, 50, 40, 30]


def _header(
    flags: list[int],
    status: int = wire.OK,
    payload: int = 0,
    kinds: list[int] | None = None,
    base: int | None = None,
) -> torch.Tensor:
    buf = torch.zeros(wire.header_words(len(flags)) * 8, dtype=torch.uint8)
    kinds = kinds or [wire.RAW] * len(flags)
    pieces = [
        wire.Piece(f, kd, n if kd == wire.RAW else n // 2, (k, -k)) if f else None
        for k, (f, kd, n) in enumerate(zip(flags, kinds, SIZES, strict=False))
    ]
    wire.write_header(buf, 5, 7, 3, status, pieces, payload, base)
    return buf


def test_header_round_trip_with_zero_copy_flags_and_patches() -> None:
    flags = [wire.IN_MESSAGE, 0, wire.DIRECT, wire.IN_MESSAGE]
    kinds = [wire.RAW, wire.RAW, wire.RAW, 3]
    h = wire.read_header(_header(flags, payload=99, kinds=kinds, base=6), 5, 3, SIZES, 100)
    assert (h.status, h.version, h.payload, h.base) == (wire.OK, 7, 99, 6)
    assert h.flags == flags
    assert h.lengths == [100, 0, 40, 15]
    assert [None if p is None else p.digest for p in h.pieces] == [(0, 0), None, (2, -2), (3, -3)]
    assert wire.read_header(_header(flags), 5, 3, SIZES, 100).base is None


def test_header_rejects_unknown_flags_and_pieces_in_an_abort() -> None:
    buf = _header([wire.IN_MESSAGE, wire.DIRECT])
    words = buf.numpy().view("int64")
    words[wire.HEAD + 3] = 3 | 50 << 8  # piece 1: flag 3
    with pytest.raises(SyncError, match="piece 1 has flag 3"):
        wire.read_header(buf, 5, 3, SIZES[:2], 100)
    with pytest.raises(SyncError, match="none in an abort message"):
        wire.read_header(_header([wire.DIRECT], status=wire.ABORT), 5, 3, SIZES[:1], 100)
    with pytest.raises(SyncError, match="out of step"):
        wire.read_header(_header([wire.DIRECT]), 6, 3, SIZES[:1], 100)  # another round
    with pytest.raises(SyncError, match="capacity"):
        wire.read_header(_header([wire.DIRECT], payload=101), 5, 3, SIZES[:1], 100)


@pytest.mark.parametrize(
    ("flag", "kind", "length", "why"),
    [
        (wire.IN_MESSAGE, wire.RAW, 99, "raw piece shorter than planned"),
        (wire.IN_MESSAGE, 3, 101, "patch longer than its piece"),
        (wire.IN_MESSAGE, 3, 0, "empty patch"),
        (wire.DIRECT, 3, 10, "zero-copy patch"),
        (wire.IN_MESSAGE, 9, 10, "unknown kind"),
        (0, 3, 10, "an absent piece with a kind and a length"),
        (wire.IN_MESSAGE, wire.RAW, -1, "a negative word"),
    ],
)
def test_header_rejects_bad_piece_lengths_and_kinds(
    flag: int, kind: int, length: int, why: str
) -> None:
    buf = _header([wire.IN_MESSAGE])
    buf.numpy().view("int64")[wire.HEAD] = flag | kind << 2 | length << 8
    with pytest.raises(SyncError, match="piece 0 has flag"):
        wire.read_header(buf, 5, 3, SIZES[:1], 200)


@pytest.mark.parametrize(
    ("device", "kind", "ok"),
    [
        (False, wire.DEVICE_PATCH, False),  # a device patch in a host round's message
        (True, 3, False),  # a host patch in a device round's message
        (True, wire.DEVICE_PATCH, True),
        (True, wire.RAW, True),
    ],
)
def test_a_patch_kind_is_taken_only_in_its_kind_of_message(
    device: bool, kind: int, ok: bool
) -> None:
    """Device rounds (wire.MAGIC_DEVICE) carry raw pieces and device patches, host rounds raw
    pieces and host patches: a header that mixes them is refused before anything is read."""
    buf = torch.zeros(wire.header_words(1) * 8, dtype=torch.uint8)
    n = SIZES[0] if kind == wire.RAW else 24
    wire.write_header(buf, 5, 7, 3, wire.OK, [wire.Piece(1, kind, n, (1, 2))], n, 6, device)
    if ok:
        h = wire.read_header(buf, 5, 3, SIZES[:1], 200)
        assert h.device and h.pieces[0] is not None and h.pieces[0].kind == kind
    else:
        with pytest.raises(SyncError, match="piece 0 has flag"):
            wire.read_header(buf, 5, 3, SIZES[:1], 200)


def test_direct_tags_are_distinct_from_bucket_tags() -> None:
    tags = {
        wire.direct_tag(i, j)
        for i in (0, 1, wire.MAX_DIRECT_BUCKETS - 1)
        for j in (0, 1, wire.MAX_DIRECT - 1)
    }
    assert len(tags) == 9
    assert min(tags) >= 1 << 30 and max(tags) < 1 << 31  # above every bucket index, an int32


@pytest.mark.parametrize(
    ("src", "dt"),
    [
        (torch.randn(300, 1000), torch.bfloat16),  # a cast, several chunks
        (torch.randn(64, 40).t(), torch.float32),  # strided, no cast
        (torch.tensor(1.5), torch.float16),  # a scalar
        (torch.zeros(0, 2), torch.float16),  # empty
    ],
)
def test_pack_digest_names_the_bytes_meant_for_dst(
    src: torch.Tensor, dt: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of packing a cast or strided piece write the same bytes and return the digest
    ``hash_piece`` computes; through the scratch (``shared``, a link window) a write into
    ``dst`` right after each copy is not in the digest."""
    want = src.to(dt).contiguous().reshape(-1).view(torch.uint8)
    scratch = torch.empty(wire.SCRATCH, dtype=torch.uint8)
    expect = wire.hash_piece(src, dt, scratch)
    for shared in (True, False):
        dst = torch.empty(want.numel(), dtype=torch.uint8)
        assert wire.pack(src, dst, dt, None, scratch, shared=shared) == expect
        assert torch.equal(dst, want)
    real = wire.copy_into

    def copy_then_write(d: torch.Tensor, s: torch.Tensor) -> None:
        real(d, s)
        d.view(-1).view(torch.uint8)[0] ^= 0xFF  # another process writes the window

    monkeypatch.setattr(wire, "copy_into", copy_then_write)
    dst = torch.empty(want.numel(), dtype=torch.uint8)
    assert wire.pack(src, dst, dt, None, scratch) == expect
