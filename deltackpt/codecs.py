"""Public names for choosing an encoding: ``from deltackpt.codecs import EncodePolicy, RAW``.

The policy and the codec names live in :mod:`deltackpt.format.policy`, the payload codecs in
:mod:`deltackpt.format.codecs`; this module keeps the import path docs/api.md documents.
"""

from __future__ import annotations

from deltackpt.format.policy import CODECS, ENCODINGS, RAW, XOR, ZSTD, EncodePolicy

__all__ = ["CODECS", "ENCODINGS", "RAW", "XOR", "ZSTD", "EncodePolicy"]
