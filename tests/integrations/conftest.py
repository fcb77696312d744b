"""Shared by the Lightning and HF Trainer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Parent and forked child compute with one intra-op thread: the same floats."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys and, for each, the very same bytes."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )
