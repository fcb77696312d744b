"""A device round's patch (``wire.DEVICE_PATCH``): the changed elements of a whole tensor,
written into and read from the bucket where it lives, and the digest of base + patch computed
without building it. How an RL step's round on a CUDA ipc link moves and checks the ~3% of
elements that changed instead of the whole model.

The sender finds the changed elements against its device base (``device_patches.py``,
``DELTACKPT_DEVICE_PATCH``); a piece that is a whole tensor, a whole number of 8-byte words,
goes as a patch when that is at most ``DEVICE_PATCH_BELOW`` of its elements. Payload, in the
piece's room of the message::

    k (int64) | k element indices (int32) | zero padding to 8 bytes | k new values (itemsize)

Its digest in the header is that of the piece's *new* bytes (``device_digest.py``), which the
sender has for the cost of a fold (its device scan fingerprinted the tensor this round). The
receiver checks it against its own bytes with the patch applied, without writing them: the
chunk fingerprints of its current piece (one pass at fingerprint speed), corrected by the words
the patch changes (each changed word's two terms, old out and new in: work in proportion to the
change), folded. So the check covers the receiver's actual base (a hand edit since the last
round fails it, as a host patch's does) and the patch, and the piece is written only after the
vote, element by element (``apply.py``).
"""

from __future__ import annotations

import torch

from deltackpt.format.fingerprint import _mix_, many_fingerprints, position_keys
from deltackpt.options import fingerprint_kernel
from deltackpt.sync.device_digest import CHUNK, fold

__all__ = [
    "INT",
    "patch_bytes",
    "patch_count",
    "patched_digest",
    "patched_digest_rows",
    "read_patch",
    "read_patch_lazy",
    "write_patch",
]

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WORDS = CHUNK // 8


def patch_bytes(k: int, itemsize: int) -> int:
    """The payload bytes of a patch of ``k`` elements of ``itemsize`` bytes."""
    return 8 + -(-4 * k // 8) * 8 + k * itemsize


def write_patch(room: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> int:
    """Write the patch (``idx``: element indices, ``vals``: their new values as integers of
    their width, where the tensor lives) at the start of ``room`` (flat uint8, where the
    bucket lives); returns its length."""
    k, size = idx.numel(), vals.element_size()
    n = patch_bytes(k, size)
    room[:8].view(torch.int64).fill_(k)
    at = 8 + -(-4 * k // 8) * 8
    # from a GPU into a page-locked host bucket: queued, waited for with the bucket's publish
    room[8 : 8 + 4 * k].view(torch.int32).copy_(idx.to(torch.int32), non_blocking=True)
    room[8 + 4 * k : at].zero_()
    room[at:n].view(INT[size]).copy_(vals.view(INT[size]), non_blocking=True)
    return n


def patch_count(length: int, itemsize: int, numel: int) -> int:
    """The element count a device patch of ``length`` bytes holds (it fixes the count: no
    two counts give one length), checked against the piece of ``numel`` elements, from the
    header alone (nothing read on the device). ValueError when none fits."""
    if length < 8 or itemsize not in INT:
        raise ValueError(f"a device patch of {length} bytes cannot hold its count")
    for pad in (0, 4):  # an even count, or an odd one (its indices padded to 8 bytes)
        k, rest = divmod(length - 8 - pad, 4 + itemsize)
        if not rest and k >= 0 and k % 2 == pad // 4 and patch_bytes(k, itemsize) == length:
            if k > numel:
                raise ValueError(
                    f"a device patch of {length} bytes claims {k} elements of {itemsize} bytes "
                    f"(a piece of {numel})"
                )
            return k
    raise ValueError(
        f"a device patch of {length} bytes holds no whole count of {itemsize}-byte elements; "
        f"expected 8 + 4k rounded up to 8 + {itemsize}k bytes"
    )


def read_patch_lazy(
    room: torch.Tensor, length: int, itemsize: int, numel: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The patch at the start of ``room`` (untrusted bytes), without waiting for the device:
    its indices (int64, clamped into the piece, so that nothing indexes outside it whatever the
    bytes say), its values, and a 0-d bool on ``room``'s device that is true only when the
    stored count is the one ``length`` holds and the indices lie in the piece and rise
    strictly; the caller reads it before anything computed from the patch is used (the
    receiver: with the round's digests, before its vote). ValueError for a length that fits
    no count (header values, checked on the host)."""
    k = patch_count(length, itemsize, numel)
    at = 8 + -(-4 * k // 8) * 8
    raw = room[8 : 8 + 4 * k].view(torch.int32).to(torch.int64)
    ok = room[:8].view(torch.int64)[0] == k
    if k:
        ok = ok & ((raw >= 0) & (raw < numel)).all() & (raw[1:] > raw[:-1]).all()
    vals = room[at:length].view(INT[itemsize])
    return raw.clamp(0, max(numel - 1, 0)), vals, ok


def read_patch(
    room: torch.Tensor, length: int, itemsize: int, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_patch_lazy`, checked now: ValueError when the length, count or any index
    does not fit the piece of ``numel`` elements."""
    idx, vals, ok = read_patch_lazy(room, length, itemsize, numel)
    if not bool(ok):
        k = patch_count(length, itemsize, numel)
        stored = int(room[:8].view(torch.int64).item())
        if stored != k:
            raise ValueError(
                f"a device patch of {length} bytes claims {stored} elements of {itemsize} bytes "
                f"(a piece of {numel}); expected {patch_bytes(max(stored, 0), itemsize)} bytes"
            )
        raise ValueError(
            f"a device patch's indices must rise strictly and lie in the piece's {numel} elements"
        )
    return idx, vals


def patched_digest(
    base: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, itemsize: int
) -> tuple[int, int]:
    """The digest (``device_digest.py``) of ``base`` (flat uint8, a whole number of 8-byte
    words, where it lives) with the elements ``idx`` set to ``vals``, without writing it."""
    a, b = patched_digest_rows([(base, idx, vals, itemsize)]).cpu().tolist()[0]
    return int(a), int(b)


def patched_digest_rows(
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
) -> torch.Tensor:
    """:func:`patched_digest` of each ``(base, idx, vals, itemsize)`` (bases on one device),
    as an int64 tensor [len(items), 2] where they live, nothing waited for: the bases'
    chunk fingerprints in one batch, each corrected by its changed words, folded together."""
    for base, _, _, _ in items:
        if base.numel() % 8:
            raise ValueError(
                f"a device patch applies to whole 8-byte words, not {base.numel()} bytes"
            )
    fps = many_fingerprints([b for b, _, _, _ in items], CHUNK, fingerprint_kernel())
    out = []
    for (base, idx, vals, itemsize), fp in zip(items, fps, strict=True):
        if idx.numel():
            fp = fp.clone()
            at, delta = _word_changes(base, idx, vals, itemsize)
            fp.index_add_(0, at, delta)
        out.append(fp)
    return fold(out)


def _word_changes(
    base: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, itemsize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What setting elements ``idx`` (strictly rising: ``read_patch`` checked) to ``vals``
    changes in ``base``'s chunk fingerprints: per changed element, its chunk and the two
    terms its word moves by (new word's minus old word's; counted once per word, on the
    first of its elements, which carries all of that word's changes). Fixed-size work, so
    nothing waits for the device (no ``unique``)."""
    dev = base.device
    per = 8 // itemsize
    idx = idx.to(dev).long()
    k = idx.numel()
    w = idx // per  # each element's word: non-decreasing
    first = torch.ones(k, dtype=torch.bool, device=dev)
    first[1:] = w[1:] != w[:-1]
    pos = torch.arange(k, device=dev)
    head = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values
    old = base.view(torch.int64)[w]
    new = old.clone()
    new.view(INT[itemsize]).view(k, per)[head, idx % per] = vals.to(dev).view(INT[itemsize])
    p, q = position_keys(dev, _WORDS)
    at = w % _WORDS
    terms = []
    for x in (old, new):
        z = torch.bitwise_xor(x, p[at])
        _mix_(z, torch.empty_like(z))
        terms.append(torch.stack([z, z * q[at]], dim=1))
    delta = (terms[1] - terms[0]) * first.unsqueeze(1)
    return w // _WORDS, delta
