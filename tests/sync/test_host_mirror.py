"""The host mirror of a sender whose tensors live on CUDA (deltackpt/sync/host_mirror.py), run
here through its CPU stand-in (``DELTACKPT_DEVICE_SCAN=always``): the same fingerprints, chunk
comparison and copies a GPU runs, with ordinary buffers and synchronous copies.

End to end (one trainer -> one receiver holding every tensor whole, gloo and shm links): rounds
are bit-exact on the receiver; a delta round copies into the mirror only the tensor that changed
(only its changed 1 MiB chunk for a large one) and hashes nothing else; a round the receiver
rejects, and a round whose mirror copy fails on the trainer, fail everywhere and the next
round (full) delivers the right bytes. The mirror alone: commit / abandon semantics, the
``off`` switch, non-contiguous tensors, power-of-two segments. The ``gpu`` test pushes CUDA
tensors to a receiver on the shm link.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from deltackpt.options import overrides
from deltackpt.sync.host_mirror import CHUNK_BYTES, HostMirror, wire_casts
from tests._dist import free_port, spawn
from tests.sync._common import make_state

# version -> the tensors that change from the version before (cumulative)
CHANGES = {2: ["odd"], 3: ["embed"], 4: ["q"], 5: ["big"], 6: ["norm"], 7: ["half"]}
VERSIONS = (1, 2, 3, 4, 5, 6, 7)
REJECTED = 3  # the receiver votes no
STAGE_FAILS = 6  # the trainer's mirror copy raises
BIG_AT = CHUNK_BYTES // 4 + 7  # an fp32 element in the big tensor's second chunk
BUCKET = 64 << 10  # the big tensor goes in pieces over many buckets


def state(version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``make_state(1)`` plus a 3 MiB tensor, then the changes of ``CHANGES`` up to ``version``."""
    s = make_state(1)
    s["big"] = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)
    for v in range(2, version + 1):
        for n in CHANGES[v]:
            if n == "big":
                s[n] = s[n].clone()
                s[n][BIG_AT] += v
            else:
                s[n] = s[n] + v
    return {n: t.to(device) for n, t in s.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owner(host: dict[str, torch.Tensor], ptr: int) -> str:
    """The mirrored tensor whose bytes hold address ``ptr`` ("?": none)."""
    for n, t in host.items():
        if t.data_ptr() <= ptr < t.data_ptr() + max(1, _nbytes(t)):
            return n
    return "?"


def _trainer(port: int, links: str, device: str) -> list[dict[str, Any]]:
    from deltackpt import sync
    from deltackpt.sync import host_mirror, wire

    knobs = {"DELTACKPT_DEVICE_SCAN": "always"} if device == "cpu" else {}
    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links=links)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, zero_copy_min=0)
    hashed: list[int] = []
    orig_hash = wire.hash_tensor

    def counting(t: torch.Tensor) -> tuple[int, int]:
        hashed.append(t.data_ptr())
        return orig_hash(t)

    wire.hash_tensor = counting  # type: ignore[assignment]
    orig_stage = host_mirror.HostMirror.stage
    out = []
    versions = VERSIONS if device == "cpu" else (1, 2, 3)
    with overrides(**knobs):
        for v in versions:
            hashed.clear()
            if v == STAGE_FAILS:

                def failing(*a: Any, **kw: Any) -> Any:
                    raise RuntimeError("no pinned memory left")

                host_mirror.HostMirror.stage = failing  # type: ignore[method-assign]
            rec: dict[str, Any] = {"error": None}
            try:
                st = sender.push(state(v, device), version=v)
                rec.update(full=st.full, mirrored=st.mirrored_bytes)
            except sync.SyncError as e:
                rec.update(error=type(e).__name__, message=str(e))
            host_mirror.HostMirror.stage = orig_stage  # type: ignore[method-assign]
            last = sender.mirror.last
            rec.update(
                copied=sorted(last.copied),
                copied_bytes=last.copied_bytes,
                unchanged=sorted(last.unchanged),
                hashed=sorted({_owner(sender.mirror.host, p) for p in hashed}),
            )
            out.append(rec)
    out.append(
        {
            "pinned": all(s.is_pinned() for s in sender.mirror.segments),
            "segments": [s.numel() for s in sender.mirror.segments],
        }
    )
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(port: int, links: str, device: str) -> list[dict[str, Any]]:
    from deltackpt import sync
    from deltackpt.sync.receiver import WeightReceiver

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links=links)
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    pulls = [0]
    orig = WeightReceiver._verify

    def rejecting(self: Any, *a: Any, **kw: Any) -> str | None:
        if pulls[0] == REJECTED:
            return "rejected by the test"
        return orig(self, *a, **kw)

    WeightReceiver._verify = rejecting  # type: ignore[method-assign]
    held: dict[str, torch.Tensor] = {}
    out = []
    versions = VERSIONS if device == "cpu" else (1, 2, 3)
    for _ in versions:
        pulls[0] += 1
        got: list[str] = []

        def load(ws: list[tuple[str, torch.Tensor]], got: list[str] = got) -> None:
            for n, t in ws:
                got.append(n)
                held[n] = t.clone()

        rec: dict[str, Any] = {"error": None}
        try:
            receiver.pull(load)
        except sync.SyncError as e:
            rec["error"] = type(e).__name__
        want = state(receiver.version or 0)
        rec.update(
            version=receiver.version,
            loaded=sorted(got),
            bad=sorted(n for n, t in want.items() if n not in held or not torch.equal(held[n], t)),
        )
        out.append(rec)
    group.pg.barrier().wait()
    group.close()
    return out


def _run(links: str, device: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    port = free_port()
    outcomes = spawn(
        [(_trainer, (port, links, device)), (_receiver, (port, links, device))],
        timeout=120,
        fast_exit=True,
    )
    trainer, receiver = (o.unwrap() for o in outcomes)
    return trainer, receiver


@pytest.mark.multiproc
@pytest.mark.parametrize("links", ["gloo", "shm"])
def test_mirror_rounds_are_bit_exact_and_copy_only_what_changed(links: str) -> None:
    trainer, rec = _run(links, "cpu")
    rounds, tail = trainer[:-1], trainer[-1]
    everything = sorted(state(1))
    sizes = {n: _nbytes(t) for n, t in state(1).items()}
    assert [r["error"] for r in rounds] == [
        None, None, "RoundAbortedError", None, None, "SyncError", None,
    ]  # fmt: skip
    assert "host mirror" in rounds[STAGE_FAILS - 1]["message"]
    assert [r.get("full") for r in rounds] == [True, False, None, True, False, None, True]
    # a full round copies everything; a delta round the one tensor that changed
    assert rounds[0]["copied"] == everything and rounds[0]["mirrored"] == sum(sizes.values())
    assert rounds[1]["copied"] == ["odd"] and rounds[1]["mirrored"] == sizes["odd"]
    assert rounds[1]["unchanged"] == sorted(set(everything) - {"odd"})
    assert rounds[2]["copied"] == ["embed"]  # the rejected round
    assert rounds[3]["copied"] == everything  # full after the failure
    # one element of the 3 MiB tensor: its 1 MiB chunk crossed, nothing else
    assert rounds[4]["copied"] == ["big"] and rounds[4]["mirrored"] == CHUNK_BYTES
    assert rounds[6]["copied"] == everything
    # the detector hashed only the changed tensor (the others: unchanged on the device)
    assert rounds[1]["hashed"] == ["odd"] and rounds[4]["hashed"] == ["big"]
    assert not tail["pinned"]  # the stand-in: ordinary host buffers
    assert all(n & (n - 1) == 0 for n in tail["segments"])
    # the receiver: bit-exact after every round, a failed round keeps the last commit
    assert [r["version"] for r in rec] == [1, 2, 2, 4, 5, 5, 7]
    assert all(r["bad"] == [] for r in rec), rec
    assert rec[2]["error"] is not None and rec[5]["error"] == "RoundAbortedError"
    assert rec[1]["loaded"] == ["odd"] and rec[4]["loaded"] == ["big"]


def test_mirror_compares_with_the_last_committed_round() -> None:
    local = {"big": torch.zeros(3 * CHUNK_BYTES // 4), "small": torch.ones(10)}
    m = HostMirror()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        out, unchanged = m.stage(local, full=True)
        assert m.last.copied_bytes == sum(_nbytes(t) for t in local.values()) and not unchanged
        assert all(torch.equal(out[n], local[n]) for n in local)
        assert all(out[n].data_ptr() != local[n].data_ptr() for n in local)
        m.commit()
        _, unchanged = m.stage(local, full=False)
        assert m.last.copied == [] and unchanged == {"big", "small"}
        m.commit()
        local["big"][2 * CHUNK_BYTES // 4 + 1] = 5.0  # the third chunk
        out, unchanged = m.stage(local, full=False)
        assert m.last.copied == ["big"] and m.last.copied_bytes == CHUNK_BYTES
        assert unchanged == {"small"} and torch.equal(out["big"], local["big"])
        m.abandon()  # the round failed: the next compares with the last commit again
        m.stage(local, full=False)
        assert m.last.copied == ["big"] and m.last.copied_bytes == CHUNK_BYTES
        m.commit()
        m.stage(local, full=False)
        assert m.last.copied == []
        m.commit()
    with overrides(DELTACKPT_DEVICE_SCAN="off"):  # host tensors: packed in place, as "auto"
        out, unchanged = m.stage(local, full=False)
        assert out["big"] is local["big"] and m.last.copied == [] and not unchanged
        m.commit()  # a round that took no fingerprints
    with overrides(DELTACKPT_DEVICE_SCAN="always"):  # none recorded under "off"
        m.stage(local, full=False)
        assert sorted(m.last.copied) == ["big", "small"]


def test_mirror_layout_non_contiguous_tensors_and_mixed_devices() -> None:
    base = torch.randn(64, 48)
    local = {
        "cols": base[:, 8:40],  # a column slice: not contiguous
        "scalar": torch.tensor(3.5),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(5, 7).half(),
    }
    m = HostMirror()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        out, _ = m.stage(local, full=True)
        m.commit()
        for n, t in local.items():
            assert out[n].shape == t.shape and out[n].dtype == t.dtype and torch.equal(out[n], t)
            assert out[n].is_contiguous()
        base[3, 10] += 1  # inside the slice
        out, unchanged = m.stage(local, full=False)
        assert m.last.copied == ["cols"] and torch.equal(out["cols"], local["cols"])
        assert "half" in unchanged
    assert all(s.numel() & (s.numel() - 1) == 0 for s in m.segments)
    spans = sorted((t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in m.host.values() if t.numel())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    # by default ("auto") host tensors are not mirrored: the sender packs them in place
    assert HostMirror().stage(local, full=True, scan="auto")[0]["cols"] is local["cols"]


def test_tensors_sent_in_another_dtype_are_mirrored_in_it() -> None:
    # an fp32 master sent as bf16: its cast is fingerprinted and mirrored (half the bytes), so
    # an optimizer step that moves every fp32 element copies nothing where no bf16 one moved
    master = torch.randn(3 * CHUNK_BYTES // 4).bfloat16().float()  # on bf16 values
    local = {"master": master, "steps": torch.arange(8), "norm": torch.randn(16)}
    pieces = [("master", torch.bfloat16), ("steps", torch.int64), ("norm", torch.bfloat16)]
    pieces.append(("norm", torch.float32))  # two receivers want it in two dtypes: as it is
    cast = wire_casts(pieces, local)
    assert cast == {"master": torch.bfloat16}
    m = HostMirror()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        out, _ = m.stage(local, full=True, cast=cast)
        m.commit()
        assert out["master"].dtype == torch.bfloat16 and out["norm"].dtype == torch.float32
        assert torch.equal(out["master"], master.bfloat16())
        assert m.last.copied_bytes == master.numel() * 2 + 8 * 8 + 16 * 4
        was = master.clone()
        master.add_(master.abs() * 1e-5)  # every fp32 element moves, no bf16 cast does
        assert (master != was).all() and torch.equal(master.bfloat16(), was.bfloat16())
        out, unchanged = m.stage(local, full=False, cast=cast)
        assert m.last.copied == [] and "master" in unchanged
        m.commit()
        master[CHUNK_BYTES // 2 + 3] += 1.0  # one bf16 element, in the second bf16 chunk
        out, unchanged = m.stage(local, full=False, cast=cast)
        assert m.last.copied == ["master"] and m.last.copied_bytes == CHUNK_BYTES // 2
        assert torch.equal(out["master"], master.bfloat16())


@pytest.mark.gpu
@pytest.mark.multiproc
def test_cuda_tensors_reach_a_shm_receiver_bit_exact() -> None:
    trainer, rec = _run("shm", "cuda")
    rounds, tail = trainer[:-1], trainer[-1]
    assert [r["error"] for r in rounds] == [None, None, "RoundAbortedError"]
    assert rounds[0]["copied"] == sorted(state(1)) and rounds[1]["copied"] == ["odd"]
    assert rounds[1]["hashed"] == [] or set(rounds[1]["hashed"]) <= {"odd"}
    assert tail["pinned"]
    assert [r["version"] for r in rec] == [1, 2, 2]
    assert all(r["bad"] == [] for r in rec), rec
