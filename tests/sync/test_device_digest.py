"""The digests of a device round (deltackpt/sync/device_digest.py): one piece's digest wherever
it lies in a message, blind to the bytes past its end, moved by any change of one word or a
swap of two words or two chunks, the same from a sender's known chunk fingerprints as from the
bytes, and the same on CUDA as on the CPU (gpu)."""

from __future__ import annotations

import pytest
import torch

from deltackpt.format.fingerprint import source_fingerprints
from deltackpt.options import overrides
from deltackpt.sync.device_digest import (
    CHUNK,
    message_digest_rows,
    message_digests,
    piece_digest,
    rows_on_host,
)

SIZES = (0, 3, 8, 13, 64, CHUNK, 2 * CHUNK + 5)  # empty, within a word, one, two chunks + a tail


def _message(seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]
    buf = torch.randint(
        0, 256, (sum(SIZES) + 64 * len(SIZES) + 256,), dtype=torch.uint8, generator=g
    )
    spans, pos = [], 128
    for p in pieces:
        buf[pos : pos + p.numel()] = p
        spans.append((pos, p.numel()))
        pos = -(-(pos + p.numel()) // 64) * 64
    return buf, spans, pieces


def test_a_piece_has_one_digest_wherever_it_lies_and_whatever_follows_it() -> None:
    buf, spans, pieces = _message()
    got = message_digests(buf, spans)
    assert got == [piece_digest(p) for p in pieces]
    assert len(set(got[1:])) == len(got) - 1  # distinct pieces, distinct digests
    # the bytes after a piece that ends inside a word are not part of it
    other = buf.clone()
    for o, n in spans:
        if n % 8:
            other[o + n : -(-(o + n) // 8) * 8] ^= 0xFF
    assert message_digests(other, spans) == got
    # the spans in another order: the same digests, in that order
    assert message_digests(buf, spans[::-1]) == got[::-1]
    # spans that overlap (each piece read where it lies, not cut from its neighbour's end)
    (o, n) = spans[5]
    twice = [(o, n), (o + 8, n - 8), (o + n - 3, 3)]
    assert message_digests(buf, twice) == [got[5], piece_digest(pieces[5][8:]),
                                           piece_digest(pieces[5][-3:])]  # fmt: skip


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_changed_byte_or_two_swapped_words_move_the_digest(where: str) -> None:
    buf, spans, _ = _message()
    got = message_digests(buf, spans)
    o, n = spans[-1]
    at = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    bad = buf.clone()
    bad[o + at] ^= 1
    moved = message_digests(bad, spans)
    assert moved[-1] != got[-1] and moved[:-1] == got[:-1]
    # two different words exactly one chunk apart swapped (the same position keys)
    w = CHUNK // 8
    words = buf[o : o + 2 * CHUNK].clone().view(torch.int64)
    words[0], words[w] = words[w].clone(), words[0].clone()
    assert piece_digest(words.view(torch.uint8)) != piece_digest(buf[o : o + 2 * CHUNK])
    # two whole chunks swapped: the fold's position keys see it
    chunks = buf[o : o + 2 * CHUNK].clone().view(2, CHUNK).flip(0).reshape(-1)
    assert piece_digest(chunks) != piece_digest(buf[o : o + 2 * CHUNK])


def test_a_senders_known_chunk_fingerprints_fold_into_the_same_digests() -> None:
    """The sender's device scan fingerprinted a whole tensor this round: its digest is the fold
    of those fingerprints, the one the receiver computes from the bytes."""
    buf, spans, pieces = _message(3)
    known = {k: source_fingerprints(p, CHUNK) for k, p in enumerate(pieces)}
    assert known[0].shape == (0, 2)  # an empty tensor's scan: no chunk (the digest counts one)
    assert message_digests(buf, spans, known) == message_digests(buf, spans)


def test_digests_taken_from_the_sources_are_those_of_the_buffer() -> None:
    """A GPU's tensors packed into a host bucket: the digests are taken from the bytes where
    they were copied from (``sources``), some spans known, and equal the bucket's; a source
    that is not its span's size is refused. (On a GPU: ``test_cuda_gives_the_cpu_digests``.)"""
    buf, spans, pieces = _message(4)
    ref = message_digests(buf, spans)
    known = {1: source_fingerprints(pieces[1], CHUNK)}
    sources = {k: p.clone() for k, p in enumerate(pieces) if k != 1 and p.numel()}
    scribbled = torch.zeros_like(buf)  # nothing of the buffer is read
    assert message_digests(scribbled, spans, known, sources) == ref
    with pytest.raises(ValueError, match="its span's bytes"):
        message_digests(buf, spans, None, {6: pieces[6][:-1]})


def test_spans_past_the_buffer_are_refused() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="lie in the buffer"):
        message_digests(buf, [(56, 16)])


@pytest.mark.gpu
def test_cuda_gives_the_cpu_digests() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU on this machine)")
    buf, spans, _ = _message(2)
    ref = message_digests(buf, spans)
    assert message_digests(buf.cuda(), spans) == ref
    known = {k: source_fingerprints(buf.cuda()[o : o + n], CHUNK) for k, (o, n) in enumerate(spans)}
    assert message_digests(buf.cuda(), spans, known) == ref
    # the fingerprints fused by torch.compile (DELTACKPT_FINGERPRINT_COMPILE=on): same integers
    for o, n in spans:
        piece = buf.cuda()[o : o + n]
        fused = source_fingerprints(piece, CHUNK, "compile")
        assert torch.equal(fused.cpu(), source_fingerprints(buf[o : o + n], CHUNK)), n
    # a GPU's pieces copied into a host bucket: digests taken on the GPU, left there
    sources = {k: buf.cuda()[o : o + n] for k, (o, n) in enumerate(spans) if n}
    rows = message_digest_rows(torch.zeros_like(buf), spans, None, sources)
    assert rows.is_cuda and [tuple(r) for r in rows.cpu().tolist()] == ref
    for knob in ("on", "triton"):  # torch.compile, the Triton kernel: the same digests
        with overrides(DELTACKPT_FINGERPRINT_COMPILE=knob):
            assert message_digests(buf.cuda(), spans) == ref, knob
            assert message_digests(buf.cuda(), spans, known) == ref, knob


# ---- device patches (sync/device_delta.py): untrusted bytes of a bucket -------------------


def _patch(idx: list[int], size: int = 2) -> tuple[torch.Tensor, int]:
    from deltackpt.sync.device_delta import INT, patch_bytes, write_patch

    room = torch.zeros(patch_bytes(len(idx), size) + 16, dtype=torch.uint8)
    vals = torch.arange(len(idx), dtype=INT[size])
    return room, write_patch(room, torch.tensor(idx, dtype=torch.int32), vals)


def test_a_device_patch_reads_back_what_was_written() -> None:
    from deltackpt.sync.device_delta import read_patch

    room, n = _patch([0, 5, 99])
    idx, vals = read_patch(room, n, 2, 100)
    assert idx.tolist() == [0, 5, 99] and vals.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("idx", "numel", "length_delta", "count", "why"),
    [
        ([0, 5, 100], 100, 0, None, "lie in the piece"),  # an element past the piece
        ([5, 5], 100, 0, None, "rise strictly"),  # twice the same element
        ([7, 3], 100, 0, None, "rise strictly"),  # out of order
        ([1, 2], 100, 8, None, "expected"),  # a length that is not the count's
        ([1, 2], 100, 0, 1 << 40, "claims"),  # a huge count
        ([1, 2], 100, 0, -1, "claims"),  # a negative count
        ([1, 2], 1, 0, None, "claims"),  # more elements than the piece has
    ],
)
def test_a_hostile_device_patch_is_refused(
    idx: list[int], numel: int, length_delta: int, count: int | None, why: str
) -> None:
    """Nothing is indexed or allocated from a count, length or index before it is checked
    against the piece the schedule planned."""
    from deltackpt.sync.device_delta import read_patch

    room, n = _patch(idx)
    if count is not None:
        room[:8].view(torch.int64).fill_(count)
    with pytest.raises(ValueError, match=why):
        read_patch(room, n + length_delta, 2, numel)
    with pytest.raises(ValueError):
        read_patch(room, 4, 2, numel)  # too short to hold its count


def test_rows_on_host_keeps_each_tensors_rows_in_order() -> None:
    """A round's digest rows read per device (never concatenated across devices: the rows of
    a bucket with nothing to digest lie on the CPU, the others on the GPU that took them)."""
    rows = [
        torch.tensor([[1, 2], [3, 4]]),
        torch.zeros(0, 2, dtype=torch.int64),
        torch.tensor([[5, 6]]),
    ]
    assert rows_on_host(rows) == [[[1, 2], [3, 4]], [], [[5, 6]]]
    assert rows_on_host([]) == []


def test_fold_gives_each_pieces_fingerprint_of_its_chunk_fingerprints() -> None:
    """The fold stacks lists of as many words and fingerprints them together: the same
    integers as each list fingerprinted alone, in the pieces' order, whatever lengths mix."""
    from deltackpt.sync.device_digest import fold

    g = torch.Generator().manual_seed(3)
    chunks = [1, 3, 0, 1, 2, 3, 1, 0, 5, 1]  # interleaved lengths, empty lists among them
    fps = [torch.randint(-(2**62), 2**62, (c, 2), dtype=torch.int64, generator=g) for c in chunks]
    want = []
    for f in fps:
        rows = source_fingerprints(f.reshape(-1).view(torch.uint8), CHUNK)
        want.append(rows[0].tolist() if rows.shape[0] else [0, 0])
    assert fold(fps).tolist() == want
    assert fold(fps[:1]).tolist() == want[:1]  # one length: no reordering
    assert fold([fps[1], fps[5]]).tolist() == [want[1], want[5]]
