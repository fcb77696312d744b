"""Change detection of delta rounds: which pieces a trainer must send because their tensor
changed since the last committed round. Used by :class:`~deltackpt.sync.sender.WeightSender`
from its packing threads (and, for untouched buckets, its calling thread), one round at a time:
two threads may look at one tensor at once (its pieces in two buckets), and then both hash it,
with the same result.

* ``"hash"`` (default): one in-place xxh3-128 of each local tensor per delta round, compared with
  its digest at the last commit. Hashing the whole local tensor once reads every source byte
  once, in place, whatever the pieces are (column slices of a row shard would each be hashed
  through a scratch copy, row by row); the price is that a tensor that changed anywhere sends
  all its pieces (on links that patch, a piece whose bytes did not change is then dropped by
  the patch encoder). Right after a full round no tensor digest is known: pieces are hashed.
* ``"version"``: tensors whose storage pointer and PyTorch in-place version counter did not move
  since the last commit are skipped unread, the others sent unhashed. Writes that bypass
  autograd's counter (``p.data.copy_``, ``.numpy()``, DLPack, foreign kernels) are not seen. The
  detector holds a reference to every committed tensor, so a freed tensor's memory cannot be
  reused by a new one at the same address.

Either way, a sender with a host mirror (``host_mirror.py``: CUDA tensors, or the CPU stand-in)
names the tensors whose bytes its device fingerprints found unchanged since the last commit
(``start_round(unchanged=)``): their pieces are skipped unread, as ``"version"`` skips an
untouched tensor, and the others go through the mode's own test on the mirror's host copy.
"""

from __future__ import annotations

import torch

from deltackpt.sync import wire

__all__ = ["DETECTS", "Detector", "PieceKey"]

DETECTS = ("hash", "version")

#: A piece as the sender's bookkeeping names it: (receiver rank, bucket index, piece index).
PieceKey = tuple[int, int, int]


class Detector:
    """What the last committed round left behind to compare with, and this round's readings."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # piece -> digest of its bytes at the last commit
        self.committed: dict[PieceKey, tuple[int, int]] = {}
        # tensor name -> digest of its local bytes at the last commit / this round (None: not
        # known this round: sent unhashed, or not contiguous)
        self._tcommitted: dict[str, tuple[int, int]] = {}
        self._tround: dict[str, tuple[int, int] | None] = {}
        # tensor name -> (data_ptr, _version, the tensor) at the last commit / this round
        self._vers: dict[str, tuple[int, int, torch.Tensor]] = {}
        self._round_vers: dict[str, tuple[int, int, torch.Tensor]] = {}
        self._local: dict[str, torch.Tensor] = {}
        # tensors the sender's device fingerprints found unchanged since the last commit, and
        # (a device round) those it scanned: the others of these changed
        self._unchanged: frozenset[str] = frozenset()
        self._scanned: frozenset[str] = frozenset()

    def clear(self) -> None:
        """Forget everything (a new schedule)."""
        self.committed.clear()
        self._tcommitted.clear()

    def start_round(
        self,
        local: dict[str, torch.Tensor],
        unchanged: frozenset[str] = frozenset(),
        scanned: frozenset[str] = frozenset(),
    ) -> None:
        """A round over ``local``; ``unchanged``: tensors known not to have changed since the
        last commit (a host mirror's device fingerprints), skipped unread in a delta round;
        ``scanned`` (a device round): tensors whose fingerprints were compared, so those not
        ``unchanged`` changed (sent unhashed: their bytes stay on the device)."""
        self._local = local
        self._unchanged = unchanged
        self._scanned = scanned
        self._tround = {}
        if self.mode == "version":  # before reading anything: a later write shows next round
            self._round_vers = {n: (t.data_ptr(), t._version, t) for n, t in local.items()}

    def commit(self, full: bool, digests: dict[PieceKey, tuple[int, int]]) -> None:
        """The round was committed with these piece digests (all of them if ``full``)."""
        if full:
            self.clear()
        self.committed.update(digests)
        for n, d in self._tround.items():  # None: not known now (do not keep an old one)
            if d is None:
                self._tcommitted.pop(n, None)
            else:
                self._tcommitted[n] = d
        self._vers = self._round_vers if self.mode == "version" else {}

    def known(self, name: str) -> tuple[int, int] | None:
        """This round's digest of tensor ``name``'s local bytes, if taken."""
        return self._tround.get(name)

    def record(self, name: str, digest: tuple[int, int]) -> None:
        """A full round packed tensor ``name`` whole: its digest for the next delta round."""
        self._tround.setdefault(name, digest)

    def piece_changed(
        self, name: str, key: PieceKey, src: torch.Tensor, dt: torch.dtype, scratch: torch.Tensor
    ) -> bool:
        """Whether piece ``key`` (``src`` as ``dt``) must be sent in a delta round."""
        changed = self.moved(name, key)
        if changed:  # sent unhashed: no digest of the tensor this round
            self._tround[name] = None
        if changed is None:
            changed = self._tensor_changed(name, key)
        if changed is None:  # no digest of the whole tensor to compare: this piece's
            changed = wire.hash_piece(src, dt, scratch) != self.committed.get(key)
        return changed

    def moved(self, name: str, key: PieceKey) -> bool | None:
        """Whether tensor ``name`` changed since the last commit, when that is known unread:
        False for a tensor the sender's device found unchanged; with ``"version"``, whether it
        was written through torch (storage or in-place version counter changed); None when
        that cannot tell (hash detection, or piece ``key`` / the tensor not seen at a commit
        yet)."""
        if name in self._unchanged and key in self.committed:
            return False
        if name in self._scanned:
            return True
        if self.mode != "version" or key not in self.committed or name not in self._vers:
            return None
        return self._vers[name][:2] != self._round_vers[name][:2]

    def _tensor_changed(self, name: str, key: PieceKey) -> bool | None:
        """From one in-place hash of tensor ``name``'s local bytes per round; None when that
        cannot tell (no digest of it committed yet, or not contiguous): then the piece is
        hashed."""
        if name not in self._tround:
            t = self._local[name]
            self._tround[name] = wire.hash_tensor(t) if t.is_contiguous() else None
        now = self._tround[name]
        before = self._tcommitted.get(name)
        if now is None or before is None or key not in self.committed:
            return None
        return now != before
