"""Public names for choosing an encoding: ``from deltackpt.codecs import EncodePolicy, RAW``.

The codecs themselves live in :mod:`deltackpt.format.codecs`; this module keeps the import path
the README documents.
"""

from __future__ import annotations

from deltackpt.format.codecs import CODECS, ENCODINGS, RAW, XOR, ZSTD, EncodePolicy

__all__ = ["CODECS", "ENCODINGS", "RAW", "XOR", "ZSTD", "EncodePolicy"]
