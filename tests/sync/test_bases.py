"""The sender's bases (``patches.Bases``): a patch updates the base to the new bytes at once;
under the time-first policy a piece that changed too much rests without a base (no diff, no
copy) for ``REST_ROUNDS`` rounds and then gets one again."""

from __future__ import annotations

import numpy as np
import torch

from deltackpt.sync import delta_codec
from deltackpt.sync.patches import REST_ROUNDS, Bases

KEY = (0, (0,), (4096,), "bfloat16")


def _committed(bases: Bases, t: torch.Tensor) -> None:
    bases.start_round()
    bases.sent(KEY, t, torch.bfloat16)
    bases.commit()


def test_patch_brings_the_base_to_the_new_bytes() -> None:
    bases = Bases()
    old = torch.randn(4096).bfloat16()
    _committed(bases, old)
    new = old.clone()
    new[::100] += 1  # 1% changed
    bases.start_round()
    kind, payload = bases.encode(KEY, new.view(torch.uint8), 2)  # type: ignore[misc]
    assert kind == delta_codec.PACKED and 0 < payload.size < new.numel() * 2 // 10
    assert torch.equal(bases._base[KEY].view(torch.bfloat16), new)
    assert bases.encode(KEY, new.view(torch.uint8), 2) == (kind, payload)  # cached per round


def test_a_piece_that_changed_too_much_rests_then_gets_a_base_again() -> None:
    bases = Bases()
    bases.allow, bases.packed_below = frozenset({delta_codec.PACKED, delta_codec.SPARSE}), 1 / 16
    old = torch.randn(4096).bfloat16()
    _committed(bases, old)
    dense = old + 1  # every element changed
    bases.start_round()
    assert bases.encode(KEY, dense.view(torch.uint8), 2) is None  # send it whole
    bases.sent(KEY, dense, torch.bfloat16)  # the sender records every piece it sent
    bases.commit()
    assert not bases.has(KEY)
    for _ in range(REST_ROUNDS - 1):
        _committed(bases, dense)
        assert not bases.has(KEY)  # no base kept, nothing copied
    _committed(bases, dense)
    assert bases.has(KEY)
    assert np.array_equal(bases._base[KEY].numpy(), dense.view(torch.uint8).numpy())
