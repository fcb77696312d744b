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


def test_packing_threads_encode_a_shared_piece_once_and_bring_its_base_along() -> None:
    """The sender packs two buckets at once (``DELTACKPT_PACK_THREADS``); a piece broadcast to
    several receivers sits in several buckets, so threads may encode it together. Under the
    time-first policy the diff writes the base as it goes: a second diff running over it at the
    same time would see half-new bytes and send a wrong patch. Each piece is encoded under its
    lock: every thread gets the one payload, it decodes against the old base to the new bytes,
    and the base ends equal to them."""
    from concurrent.futures import ThreadPoolExecutor

    from deltackpt.sync.delta_decode import decode_into

    bases = Bases()
    bases.allow, bases.packed_below = frozenset({delta_codec.PACKED, delta_codec.SPARSE}), 1 / 16
    key = (0, (0,), (1 << 22,), "bfloat16")
    old = torch.randn(1 << 22).bfloat16()
    bases.start_round()
    bases.sent(key, old, torch.bfloat16)
    bases.commit()
    new = old.clone()
    new[::50] += 1  # 2% changed: a PACKED patch, the base written by the diff itself
    raw = new.view(torch.uint8)
    bases.start_round()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: bases.encode(key, raw, 2), range(8)))
    kind, payload = got[0]  # type: ignore[misc]
    assert kind == delta_codec.PACKED
    assert all(g is not None and g[0] == kind and np.array_equal(g[1], payload) for g in got)
    out = np.empty(raw.numel(), np.uint8)
    decode_into(kind, payload, old.view(torch.uint8).numpy(), 2, out)
    assert np.array_equal(out, raw.numpy())
    assert torch.equal(bases._base[key].view(torch.bfloat16), new)
