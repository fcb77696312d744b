"""1 -> N broadcast is the case of receivers that want every tensor whole: one trainer with plain
fp32 tensors, two receivers that declare nothing (``WeightReceiver(group)``), over gloo and
shared memory. Bit-exact after every round in the dtypes asked for (the sender casts), delta
rounds send only what changed, ``load_weights`` sees exactly the changed tensors, and a
:class:`ModuleAdapter` fills a real ``nn.Module``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

VERSIONS = (1, 2, 3)
KINDS = ("gloo", "shm")


def _state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    s = {
        "lin.weight": torch.randn(32, 16, generator=g),
        "lin.bias": torch.randn(32, generator=g),
        "head.weight": torch.randn(8, 32, generator=g),
        "steps": torch.arange(5),
    }
    if v >= 2:
        s["lin.bias"] = s["lin.bias"] + 2  # round 2: one tensor changed
    if v >= 3:
        s["head.weight"][0, :3] += 1.0  # round 3: a few elements of another
    return s


def _cast(name: str, dtype: torch.dtype) -> torch.dtype | None:
    return torch.bfloat16 if name.endswith("weight") else None  # keep the bias in fp32


def _trainer(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    out = {}
    for kind, port in zip(KINDS, ports, strict=True):
        group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], timeout=60, links=kind)
        sender = sync.WeightSender(group, bucket_bytes=4 << 10, dtype=_cast)
        out[kind] = [sender.push(_state(v), version=v) for v in VERSIONS]
        group.pg.barrier().wait()
        group.close()
    return out


def _receiver(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    out: dict[str, Any] = {}
    for kind, port in zip(KINDS, ports, strict=True):
        group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], timeout=60, links=kind)
        # rank 1 takes the dtypes the trainer casts to; rank 2 also casts the bias
        spec = None if rank == 1 else (lambda n, d: torch.bfloat16 if d.is_floating_point else None)
        receiver = sync.WeightReceiver(group, dtype=spec, bucket_bytes=4 << 10)
        module = torch.nn.Module()
        module.lin = torch.nn.Linear(16, 32)
        module.head = torch.nn.Linear(32, 8, bias=False)
        module.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
        adapter = sync.ModuleAdapter(module)
        rounds = []
        for v in VERSIONS:
            seen: list[tuple[str, torch.dtype]] = []

            def load(
                ws: list[tuple[str, torch.Tensor]], seen: list = seen, ad: Any = adapter
            ) -> None:
                seen.extend((n, t.dtype) for n, t in ws)
                ad(ws)

            stats = receiver.pull(load)
            got = {k: v.detach().clone() for k, v in module.state_dict().items()}
            rounds.append(
                {
                    "stats": stats,
                    "seen": seen,
                    "version": receiver.version,
                    "state": {k: t.numpy() for k, t in got.items()},  # not shared memory
                }
            )
        out[kind] = {"rounds": rounds, "wants": [w.name for w in receiver.wants]}
        group.pg.barrier().wait()
        group.close()
    return out


def test_one_trainer_to_two_receivers_that_want_everything() -> None:
    ports = [free_port() for _ in KINDS]
    outs = spawn(
        [(_trainer, (0, 3, ports)), (_receiver, (1, 3, ports)), (_receiver, (2, 3, ports))],
        timeout=150,
    )
    trainer, *receivers = [o.unwrap() for o in outs]
    for kind in KINDS:
        full, delta1, delta2 = trainer[kind]
        assert full.full and not delta1.full and not delta2.full
        assert 0 < delta1.payload_bytes < full.payload_bytes / 4, kind
        for rank, rec in enumerate(receivers, start=1):
            assert rec[kind]["wants"] == ["lin.weight", "lin.bias", "head.weight", "steps"]
            r1, r2, r3 = rec[kind]["rounds"]
            assert [r["version"] for r in (r1, r2, r3)] == [1, 2, 3]
            bias_dt = torch.float32 if rank == 1 else torch.bfloat16
            assert dict(r1["seen"]) == {
                "lin.weight": torch.bfloat16,
                "lin.bias": bias_dt,
                "head.weight": torch.bfloat16,
                "steps": torch.int64,
            }
            assert [n for n, _ in r2["seen"]] == ["lin.bias"]
            assert [n for n, _ in r3["seen"]] == ["head.weight"]
            for v, r in zip(VERSIONS, (r1, r2, r3), strict=True):
                for k, t in _state(v).items():
                    wire = torch.bfloat16 if k.endswith("weight") else bias_dt
                    want = t if k == "steps" else t.to(wire).to(torch.float32)
                    got = torch.from_numpy(r["state"][k])
                    assert torch.equal(got, want), (kind, rank, v, k)
