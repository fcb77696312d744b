"""deltackpt: incremental, checksummed, crash-safe checkpoints and weight sync for PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"
