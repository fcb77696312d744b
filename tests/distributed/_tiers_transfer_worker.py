"""The rank body of tests/distributed/test_tiers_transfer.py: two ranks move local snapshots
through ``deltackpt.tiers.transfer.transfer`` in many small batches (``BATCH_BYTES`` lowered),
both ways at once as the replication ring does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def state_of(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"t{i}": torch.randn(64 * 1024, generator=g) for i in range(6)}  # 6 x 256 KiB


def save_local(root: str, rank: int) -> None:
    """Rank ``rank``'s snapshot ``step-00000003`` in its own store, as a local tier holds it."""
    import deltackpt
    from deltackpt.tiers.config import TIER_KEY
    from deltackpt.tiers.localize import localize

    mark = {"step": 3, "rank": rank, "world": 2, "layout": localize({})[1]}
    st = deltackpt.open_store(Path(root) / f"own{rank}", chunk_bytes=64 * 1024, small_bytes=4096)
    deltackpt.save(
        state_of(rank), st, "step-00000003", metadata={TIER_KEY: mark}, encoding="fast-restore"
    )


def corrupt_chunk(store_dir: Path, nth: int) -> str:
    """Flip a byte of the ``nth`` chunk (in manifest order) of the store's only snapshot."""
    from deltackpt.store.store import open_store

    st = open_store(store_dir, create=False)
    m = st.manifest("step-00000003")
    d = sorted(m.chunks, key=lambda k: (m.chunks[k].pack, m.chunks[k].offset))[nth]
    rec = m.chunks[d]
    data = np.fromfile(st.pack_path(rec.pack), dtype=np.uint8)
    data[rec.offset + 7] ^= 0xFF
    data.tofile(st.pack_path(rec.pack))
    return d


def run(rank: int, world: int, port: int, root: str) -> dict[str, Any]:
    import deltackpt
    from deltackpt.store.store import open_store
    from deltackpt.tiers import transfer as tr
    from tests._dist import init_gloo

    pg = init_gloo(rank, world, port, 20.0)
    tr.BATCH_BYTES = 200 * 1024  # 24 chunks of 64 KiB: 3 a batch, 8 batches each way
    link = tr.Link(pg)
    peer = 1 - rank
    own = open_store(Path(root) / f"own{rank}", create=False)
    held = open_store(Path(root) / f"held{peer}-on{rank}")
    moved = tr.transfer(link, (peer, own, "step-00000003"), (peer, held, tr.Expect(peer, 3, 2)))
    out: dict[str, Any] = {"problems": moved.problems, "committed": moved.committed}
    out["sent"], out["received"] = moved.sent_bytes, moved.received_bytes
    if moved.committed:
        got = deltackpt.load(held, "step-00000003")
        out["exact"] = all(torch.equal(got[k], v) for k, v in state_of(peer).items())
    return out
