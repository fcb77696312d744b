"""Which encoding a save writes: the codec names, :class:`EncodePolicy` and the named choices.

The codec names (``raw``, ``zstd``, ``xor``) are what manifests record; an :class:`EncodePolicy`
says which of them :func:`deltackpt.format.codecs.encode` may pick and how it chooses (probe
size, the gain a codec must reach); :data:`ENCODINGS` names the policies ``save(...,
encoding=...)`` accepts. The payloads themselves are :mod:`deltackpt.format.codecs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltackpt.errors import CodecError, InvalidArgumentError

#: The most xor links a chain may have on its keyframe: the validator refuses a manifest with a
#: longer chain (deltackpt/format/validate.py) and writers never write one. Writers cut chains
#: much earlier (``SaveOptions.chain_budget`` by bytes, ``keyframe_every`` by links); 64 only
#: bounds what a forged or foreign manifest can make a reader walk (64 decodes of one chunk).
MAX_CHAIN = 64

RAW = "raw"
ZSTD = "zstd"
XOR = "xor"
PATCH = "patch"
CODECS: tuple[str, ...] = (RAW, ZSTD, XOR, PATCH)
#: The codecs whose payload is a delta against a base chunk (the record names it): ``xor``
#: decodes to the whole chunk; ``patch`` lists the changed elements and applies by scatter.
DELTAS: tuple[str, ...] = (XOR, PATCH)


@dataclass(frozen=True)
class EncodePolicy:
    """How :func:`deltackpt.format.codecs.encode` chooses an encoding.

    ``codecs`` lists the allowed codecs; ``(RAW,)`` turns encoding off. A delta against the
    previous version may be written as ``xor`` or ``patch`` (:data:`DELTAS`) when either is
    listed: the smaller wins, ``patch`` also when it is up to ``PATCH_PREFERENCE`` times the
    ``xor`` size, since it applies by scatter where ``xor`` decodes the whole chunk. If ``RAW`` is not listed,
    the best allowed encoding is used even when it does not meet ``min_gain``.
    ``force`` always uses that codec, ignoring ``codecs`` and ``min_gain`` (``XOR`` falls back to
    ``ZSTD`` when no usable base is given). ``probe_bytes=0`` disables the probe (every candidate
    is compressed in full).
    """

    codecs: tuple[str, ...] = (RAW, ZSTD, XOR)
    force: str | None = None
    level: int = 1
    min_gain: float = 0.9
    probe_bytes: int = 64 << 10
    # Plain zstd must do better than this to be used: dense float weights only reach 0.68-0.84
    # byte-grouped, and on a few cores compressing them costs more time than writing the saved
    # bytes, and every later load pays a decode (measured: full save 0.37x torch.save, loads
    # 10-20x slower than raw). xor deltas keep ``min_gain``: they are sparse and cheap to code.
    zstd_min_gain: float = 0.5

    def __post_init__(self) -> None:
        self._check_types()
        unknown = [c for c in self.codecs if c not in CODECS]
        if not self.codecs or unknown:
            raise CodecError(
                f"EncodePolicy.codecs={self.codecs!r} is invalid (unknown: {unknown!r}); "
                f"pass a non-empty tuple drawn from {CODECS!r}"
            )
        if self.force is not None and self.force not in CODECS:
            raise CodecError(
                f"EncodePolicy.force={self.force!r} is not a known codec; use None or one of {CODECS!r}"
            )
        if not isinstance(self.level, int) or not -(1 << 17) <= self.level <= 22:
            raise CodecError(f"EncodePolicy.level={self.level!r}: zstd levels are integers <= 22")
        if not self.min_gain > 0:
            raise CodecError(f"EncodePolicy.min_gain={self.min_gain!r} must be > 0 (e.g. 0.9)")
        if not self.zstd_min_gain > 0:
            raise CodecError(
                f"EncodePolicy.zstd_min_gain={self.zstd_min_gain!r} must be > 0 (e.g. 0.5)"
            )
        if self.probe_bytes < 0:
            raise CodecError(f"EncodePolicy.probe_bytes={self.probe_bytes!r} must be >= 0")

    def _check_types(self) -> None:
        """Wrong types raise InvalidArgumentError (a TypeError too); a bare string for
        ``codecs`` would otherwise be read as its letters."""

        def bad(name: str, expected: str, example: str) -> InvalidArgumentError:
            value = getattr(self, name)
            return InvalidArgumentError(
                f"EncodePolicy.{name}={value!r} is invalid: expected {expected}, got "
                f"{type(value).__name__}. Pass e.g. EncodePolicy({name}={example})"
            )

        if not isinstance(self.codecs, (tuple, list)) or not all(
            isinstance(c, str) for c in self.codecs
        ):
            raise bad("codecs", f"a tuple of codec names from {CODECS!r}", "(RAW, ZSTD)")
        if isinstance(self.codecs, list):  # frozen: normalise so the policy stays hashable
            object.__setattr__(self, "codecs", tuple(self.codecs))
        if self.force is not None and not isinstance(self.force, str):
            raise bad("force", f"None or one of {CODECS!r}", "ZSTD")
        if not isinstance(self.level, int) or isinstance(self.level, bool):
            raise bad("level", "an int zstd level <= 22", "3")
        for name in ("min_gain", "zstd_min_gain"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise bad(name, "a number > 0 (encoded size / raw size to beat)", "0.9")
        if not isinstance(self.probe_bytes, int) or isinstance(self.probe_bytes, bool):
            raise bad("probe_bytes", "an int number of bytes >= 0", "64 << 10")


DEFAULT_POLICY = EncodePolicy()

#: The named choices of ``save(..., encoding=...)``; what each costs is measured in docs/api.md ("Bytes or speed").
#: ``auto`` (the default) never writes xor deltas on a local disk: measured here, a bf16 delta
#: (14% of the bytes) took 2.2x a raw save to encode and 10x a raw load to decode at the end of
#: its chain, and under ``keep_last=3`` held 2.78x the state on disk against raw's 3x: it cost
#: more time than it saved bytes. Unchanged chunks are still deduplicated (free), and zstd is
#: used only where it at least halves a chunk (zeros, masks, small ints). No delta bases are
#: kept in memory. ``fast-restore`` never encodes (loads at read speed); ``smallest`` takes any
#: 10% saving, xor deltas included (bf16 after a step: ~14% of the bytes; slow to restore).
ENCODINGS: dict[str, EncodePolicy] = {
    "auto": EncodePolicy(codecs=(RAW, ZSTD), zstd_min_gain=0.5),
    "fast-restore": EncodePolicy(codecs=(RAW,)),
    "smallest": EncodePolicy(min_gain=0.9, zstd_min_gain=0.9),
}

#: What ``auto`` means on an object store (a storage whose ``remote`` is true): every byte
#: crosses a network, so ``auto`` writes what ``smallest`` writes. Measured against a loopback S3
#: server (BENCHMARKS.md, object stores): a save after a dense bf16 step moved 384 kB in 0.19 s
#: with xor deltas against 67 MB in 0.81 s raw, for a load 1.2x slower at the end of a chain
#: (``SaveOptions.chain_budget`` and ``keyframe_every`` bound it). The price is host memory:
#: the delta bases (one copy of the state, within ``memory_budget``). Pass ``encoding="fast-restore"`` to opt out.
AUTO_REMOTE = ENCODINGS["smallest"]
