"""Device rounds (``DELTACKPT_DEVICE_ROUNDS``: an ipc link on CUDA; ``always`` here, the CPU
stand-in of a CUDA bucket): with ``detect="version"`` the sender's device scan skips the
tensors not written through torch since the last commit, so a delta round that changed one
tensor fingerprints that tensor alone; ``"hash"`` fingerprints every tensor every round. Either
way the receiver ends bit-exact and only the changed tensor is sent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

BUCKET = 16 << 10


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(32, 32, generator=g) for i in range(6)}  # 4 KiB each


def _trainer(port: int, detect: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.options import overrides

    out: dict[str, Any] = {"scanned": [], "payload": [], "full": []}
    with overrides(DELTACKPT_DEVICE_ROUNDS="always"):
        group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc")
        sender = sync.WeightSender(group, bucket_bytes=BUCKET, detect=detect)
        state = _state()
        for v in (1, 2, 3):
            with torch.no_grad():
                if v == 2:
                    state["w3"].add_(1.0)  # in place: its version counter moves
            st = sender.push(state, version=v)
            out["scanned"].append(sender.mirror.last.scanned_bytes)
            out["payload"].append(st.payload_bytes)
            out["full"].append(st.full)
        out["device"] = sender._device
        group.pg.barrier().wait()
        group.close()
    return out


def _receiver(port: int) -> list[list[str]]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    held: dict[str, torch.Tensor] = {}
    expect = _state()
    bad = []
    for v in (1, 2, 3):
        receiver.pull(lambda ws: held.update((n, t.clone()) for n, t in ws))
        if v == 2:
            expect["w3"] = expect["w3"] + 1.0
        bad.append(sorted(n for n, t in expect.items() if not torch.equal(held[n], t)))
    group.pg.barrier().wait()
    group.close()
    return bad


@pytest.mark.parametrize("detect", ["version", "hash"])
def test_a_delta_round_scans_only_what_torch_wrote_under_version_detection(detect: str) -> None:
    port = free_port()
    trainer, bad = (
        o.unwrap()
        for o in spawn(
            [(_trainer, (port, detect)), (_receiver, (port,))], timeout=90, fast_exit=True
        )
    )
    assert trainer["device"] and trainer["full"] == [True, False, False]
    assert bad == [[], [], []]
    one, every = 32 * 32 * 4, 6 * 32 * 32 * 4
    assert trainer["payload"] == [every, one, 0]  # only the changed tensor goes
    if detect == "version":
        assert trainer["scanned"] == [every, one, 0]
    else:
        assert trainer["scanned"] == [every, every, every]
