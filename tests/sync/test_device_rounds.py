"""Device rounds (``DELTACKPT_DEVICE_ROUNDS``: an ipc link on CUDA; ``always`` here, the CPU
stand-in of a CUDA bucket): with ``detect="version"`` the sender's device scan skips the
tensors not written through torch since the last commit, so a delta round that changed one
tensor fingerprints that tensor alone; ``"hash"`` fingerprints every tensor every round. Either
way the receiver ends bit-exact and only the changed tensor is sent."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

BUCKET = 16 << 10


def _state(big: bool = False) -> dict[str, torch.Tensor]:
    """Six 4 KiB tensors; ``big``: w3 of 4 MiB (four 1 MiB chunks of the device digests)."""
    g = torch.Generator().manual_seed(0)
    out = {f"w{i}": torch.randn(32, 32, generator=g) for i in range(6)}  # 4 KiB each
    if big:
        out["w3"] = torch.randn(1024, 1024, generator=g)
    return out


BIG_BUCKET = 5 << 20  # holds the big w3 whole (a device patch needs the whole tensor)


def _trainer(port: int, detect: str, group_bytes: int | None = None) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.options import overrides
    from deltackpt.sync import sender as sender_mod

    if group_bytes is not None:  # published in groups of this many bytes (default: one group)
        sender_mod._DEVICE_GROUP_BYTES = group_bytes
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


@pytest.mark.parametrize(
    ("detect", "group_bytes"),
    [("version", None), ("hash", None), ("hash", 1)],
    ids=["version", "hash", "hash-one-bucket-per-publish"],
)
def test_a_delta_round_scans_only_what_torch_wrote_under_version_detection(
    detect: str, group_bytes: int | None
) -> None:
    port = free_port()
    trainer, bad = (
        o.unwrap()
        for o in spawn(
            [(_trainer, (port, detect, group_bytes)), (_receiver, (port,))],
            timeout=90,
            fast_exit=True,
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


# ---- device patches: an RL-like step's few changed elements ---------------------------------


def _patch_trainer(port: int, dev: str = "cpu", big: bool = False) -> dict[str, Any]:
    """``dev="cpu"``: the CPU stand-in (``always``); ``"cuda:0"``: the real thing (``auto``)."""
    from deltackpt import sync
    from deltackpt.options import overrides

    out: dict[str, Any] = {"payload": [], "full": [], "errors": []}
    mode = "always" if dev == "cpu" else "auto"
    knobs = {"DELTACKPT_DEVICE_ROUNDS": mode, "DELTACKPT_DEVICE_PATCH": mode}
    with overrides(**knobs):
        group = sync.SyncGroup(
            "127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_device=dev
        )
        sender = sync.WeightSender(group, bucket_bytes=BIG_BUCKET if big else BUCKET)
        state = {n: t.to(dev) for n, t in _state(big).items()}
        for v in (1, 2, 3, 4):
            _step(state, v)
            try:
                st = sender.push(state, version=v)
                out["payload"].append(st.payload_bytes)
                out["full"].append(st.full)
            except sync.SyncError as e:
                out["errors"].append((v, type(e).__name__))
        group.pg.barrier().wait()
        group.close()
    return out


def _step(state: dict[str, torch.Tensor], v: int) -> None:
    """v2: 3% of w3's elements; v3: every element of w1 and 3% of w3; v4: 3% of w3 again."""
    with torch.no_grad():
        if v in (2, 3, 4):
            flat = state["w3"].view(-1)
            flat[torch.arange(v, flat.numel(), 33)] += 1.0
        if v == 3:
            state["w1"].add_(1.0)


def _patch_receiver(port: int, edit: bool, dev: str = "cpu", big: bool = False) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    receiver = sync.WeightReceiver(group, bucket_bytes=BIG_BUCKET if big else BUCKET, device=dev)
    held: dict[str, torch.Tensor] = {}
    expect = _state(big)
    out: dict[str, Any] = {"bad": [], "patched": [], "errors": [], "versions": [], "why": []}
    for v in (1, 2, 3, 4):
        _step(expect, v)
        if edit and v == 3:  # a hand edit of this rank's copy: base + patch is not the round
            receiver._targets[[w.name for w in receiver.wants].index("w3")].view(-1)[0] += 5
        try:
            st = receiver.pull(lambda ws: held.update((n, t.cpu().clone()) for n, t in ws))
            out["patched"].append(st.patched)
        except sync.SyncError as e:
            out["errors"].append((v, type(e).__name__))
            out["why"].append(str(e))
        out["versions"].append(receiver.version)
        out["bad"].append(
            sorted(n for n, t in expect.items() if n not in held or not torch.equal(held[n], t))
        )
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("big", [False, True], ids=["one-chunk", "four-chunks"])
def test_an_rl_step_goes_as_device_patches_bit_exact(big: bool) -> None:
    """``four-chunks``: the changed tensor spans four chunks and its patch less than one, so
    the digest the header announces (the new tensor's, folded from the scan) is not the
    patch bytes'."""
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_patch_trainer, (port, "cpu", big)), (_patch_receiver, (port, False, "cpu", big))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert trainer["errors"] == [] and rec["errors"] == []
    assert trainer["full"] == [True, False, False, False]
    if big:
        assert 0 < trainer["payload"][1] < (4 << 20) // 8  # w3's patch
        assert rec["patched"] == [0, 1, 1, 1]
        assert rec["bad"] == [[], [], [], []] and rec["versions"] == [1, 2, 3, 4]
        return
    one = 32 * 32 * 4
    # 3% of w3's elements: their indices and values, far less than the tensor
    assert 0 < trainer["payload"][1] < one // 4
    assert one < trainer["payload"][2] < 2 * one  # w1 whole (every element), w3 patched
    assert rec["patched"] == [0, 1, 1, 1]
    assert rec["bad"] == [[], [], [], []] and rec["versions"] == [1, 2, 3, 4]


def test_a_device_patch_onto_an_edited_base_fails_the_round_and_the_next_heals_it() -> None:
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_patch_trainer, (port,)), (_patch_receiver, (port, True))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert rec["errors"] == [(3, "DigestMismatchError")]
    assert trainer["errors"] == [(3, "RoundAbortedError")]
    assert rec["versions"] == [1, 2, 2, 4]
    assert trainer["full"] == [True, False, True]  # the round after a failure: whole
    assert rec["bad"][3] == []  # healed bit-exactly


# the fused passes' cases: a stand-in of the kernel, one that lies, the kernel itself run by
# Triton's interpreter on CPU tensors, the kernel on CUDA
_FUSED = [
    ("honest", "cpu"),
    ("lying", "cpu"),
    ("interpreted", "cpu"),
    pytest.param("real", "cuda:0", marks=pytest.mark.gpu),
]
_FUSED_IDS = ["honest", "lying", "interpreted", "cuda"]


def _interpreted(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``how="interpreted"``: the ranks run the Triton kernel itself in its interpreter, which
    must be asked for before Triton is imported: fresh interpreters (not forked from the test
    server, which imported it), ``TRITON_INTERPRET=1`` in their environment."""
    if how != "interpreted":
        return
    pytest.importorskip("triton", reason="Triton is not installed (torch's CUDA builds bring it)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DELTACKPT_TEST_SPAWN", "spawn")


def _fused_receiver(port: int, how: str, dev: str = "cpu") -> dict[str, Any]:
    """``_patch_receiver`` whose copies out of the link's buckets go through a stand-in of the
    fused Triton copy (``fingerprint_kernel.copy_spans``, which this machine cannot run outside
    Triton's interpreter): the spans copied one by one, their fingerprints from the torch
    operations; ``how="lying"``: every fingerprint it returns off by one; ``"real"`` (CUDA) and
    ``"interpreted"`` (Triton's interpreter): the real one, each call noted (whether the kernel
    ran)."""
    from deltackpt.format.fingerprint import many_fingerprints
    from deltackpt.sync import ipc_links

    calls: list[list[tuple[int, int]]] = []
    ran: list[bool] = []
    real = ipc_links.copy_fingerprinted

    def fused(src, dst, spans, chunk_bytes, kernel):
        calls.append(list(spans))
        if how in ("real", "interpreted"):
            got = real(src, dst, spans, chunk_bytes, kernel)
            ran.append(got is not None)
            return got
        for o, n in spans:  # whole words, as the kernel stores them
            w = -(-n // 8) * 8
            dst[o : o + w].copy_(src[o : o + w])
        fps = many_fingerprints([dst[o : o + n] for o, n in spans], chunk_bytes)
        return [f + 1 for f in fps] if how == "lying" else fps

    ipc_links.copy_fingerprinted = fused
    if how == "off":  # DELTACKPT_FUSED_COPY=off: copied, then fingerprinted
        os.environ["DELTACKPT_FUSED_COPY"] = "off"
    out = _patch_receiver(port, False, dev, True)
    out["calls"], out["ran"] = calls, ran
    return out


@pytest.mark.parametrize(("how", "dev"), _FUSED, ids=_FUSED_IDS)
def test_the_receivers_copy_out_of_the_bucket_carries_its_fingerprints_to_the_check(
    how: str, dev: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device round's header comes in the link's cell, so the receiver knows the pieces
    before it copies the bucket out: it copies them and takes their fingerprints in one pass
    (on a GPU the Triton kernel; here a stand-in) and its check folds those fingerprints
    instead of reading the copy again. Honest: every round bit-exact, the copies named the
    pieces (a whole tensor, a patch), patches applied. Lying fingerprints fail the first round
    by digest, though the bytes copied are right: the check used them. On CUDA, and in
    Triton's interpreter here, the kernel itself ran for every message."""
    _interpreted(how, monkeypatch)
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_patch_trainer, (port, dev, True)), (_fused_receiver, (port, how, dev))],
            timeout=90,
            fast_exit=True,
        )
    )
    if how == "lying":
        assert rec["errors"][0] == (1, "DigestMismatchError") and rec["calls"]
        assert rec["versions"][0] is None
        return
    assert trainer["errors"] == [] and rec["errors"] == []
    assert rec["bad"] == [[], [], [], []] and rec["versions"] == [1, 2, 3, 4]
    assert rec["patched"] == [0, 1, 1, 1]
    big = 1024 * 1024 * 4
    sizes = [n for spans in rec["calls"] for _, n in spans]
    assert big in sizes  # round 1: w3 whole (a bucket of its own)
    assert any(0 < n < big // 8 for n in sizes)  # its patches
    assert all(o % 8 == 0 for spans in rec["calls"] for o, _ in spans)
    if how in ("real", "interpreted"):
        assert rec["ran"] and all(rec["ran"]), rec["ran"]


def _fused_trainer(port: int, how: str, dev: str = "cpu") -> dict[str, Any]:
    """``_patch_trainer`` as if the fused Triton pack ran here (``fingerprint.fuses``; its
    kernel, ``fingerprint_kernel.copy_into``, runs here only in Triton's interpreter): a
    stand-in copies the sources and gives the torch operations' fingerprints (``"lying"``:
    each off by one; ``"real"``: the real one, on CUDA; ``"interpreted"``: the real one in
    Triton's interpreter); the bytes the scan fingerprints are noted."""
    from deltackpt.format.fingerprint import many_fingerprints
    from deltackpt.sync import host_mirror, packer, sender

    packs: list[list[int]] = []
    scans: list[list[int]] = []
    real = packer.pack_fingerprinted

    def pack(sources, dst, offsets, chunk_bytes, kernel):
        if how in ("real", "interpreted"):
            got = real(sources, dst, offsets, chunk_bytes, kernel)
            packs.append([s.numel() for s in sources] if got is not None else [])
            return got
        packs.append([s.numel() for s in sources])
        for src, o in zip(sources, offsets, strict=True):
            dst[o : o + src.numel()].copy_(src)
        fps = many_fingerprints(list(sources), chunk_bytes)
        return [f + 1 for f in fps] if how == "lying" else fps

    def scan(sources, chunk_bytes, kernel="torch"):
        scans.append([s.numel() for s in sources])
        return many_fingerprints(sources, chunk_bytes, kernel)

    if how not in ("real", "interpreted"):
        sender.fuses = lambda device, kernel="auto": True
    packer.pack_fingerprinted = pack
    host_mirror.many_fingerprints = scan
    if how == "off":
        os.environ["DELTACKPT_FUSED_COPY"] = "off"
    out = _patch_trainer(port, dev, True)
    out["packs"], out["scans"] = packs, scans
    return out


@pytest.mark.parametrize(("how", "dev"), _FUSED, ids=_FUSED_IDS)
def test_a_full_device_round_fingerprints_its_tensors_as_it_packs_them(
    how: str, dev: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full device round sends every tensor whole, so the sender's scan leaves the
    fingerprints of the tensors a bucket carries whole to the pack, which takes them as it
    copies (on a GPU one Triton pass: each byte read once, not twice; here a stand-in). They
    serve the header's digests and the next round's change detection: the next round finds
    the one changed tensor and sends its patch alone, every round bit-exact. Lying
    fingerprints fail the first round at the receiver: the digests came from them. On CUDA,
    and in Triton's interpreter here, the kernel itself ran."""
    _interpreted(how, monkeypatch)
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_fused_trainer, (port, how, dev)), (_patch_receiver, (port, False, dev, True))],
            timeout=90,
            fast_exit=True,
        )
    )
    big = 1024 * 1024 * 4
    assert trainer["packs"] and big in trainer["packs"][0]  # round 1: every tensor, fused
    if how == "lying":
        assert rec["errors"][0] == (1, "DigestMismatchError") and rec["versions"][0] is None
        return
    assert trainer["errors"] == [] and rec["errors"] == []
    assert trainer["full"] == [True, False, False, False]
    assert len(trainer["packs"]) == 1  # delta rounds scan, then copy what changed
    assert sorted(trainer["packs"][0]) == sorted([32 * 32 * 4] * 5 + [big])
    # the scan read w3 in rounds 2-4 only: round 1's fingerprints came from the pack
    assert sum(sizes.count(big) for sizes in trainer["scans"]) == 3
    assert 0 < trainer["payload"][1] < big // 8  # round 2: w3's patch, nothing else
    assert rec["bad"] == [[], [], [], []] and rec["versions"] == [1, 2, 3, 4]
    assert rec["patched"] == [0, 1, 1, 1]


def test_fused_copies_off_copies_then_fingerprints_on_both_sides() -> None:
    """``DELTACKPT_FUSED_COPY=off`` (the other choice, for a device where the fused pass is
    slower): neither the trainer's pack nor the receiver's copy out fuses, though the kernel
    would run (the stand-ins say it does); the scan fingerprints every tensor every round and
    the rounds are what they are with fusion."""
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_fused_trainer, (port, "off")), (_fused_receiver, (port, "off"))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert trainer["packs"] == [] and rec["calls"] == []
    assert sum(sizes.count(1024 * 1024 * 4) for sizes in trainer["scans"]) == 4
    assert rec["bad"] == [[], [], [], []] and rec["patched"] == [0, 1, 1, 1]


def _baseless_trainer(port: int) -> dict[str, Any]:
    """``_patch_trainer`` whose headers name no base version, its patches kept (a sender's
    bug, or bytes scribbled over the header)."""
    from deltackpt.sync import wire

    real = wire.write_header

    def baseless(*args: Any, **kwargs: Any) -> int:
        if len(args) > 7:
            args = (*args[:7], None, *args[8:])
        kwargs.pop("base", None)
        return real(*args, **kwargs)

    wire.write_header = baseless
    return _patch_trainer(port, "cpu")


def test_patches_whose_header_names_no_base_fail_the_round() -> None:
    """A device patch is read against the version the receiver holds, which its header names;
    a header with patched pieces and no version is refused, not read as whole pieces (a whole
    piece's check would cover bytes the patch never wrote). The full round after each failure
    commits."""
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_baseless_trainer, (port,)), (_patch_receiver, (port, False))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert [v for v, _ in rec["errors"]] == [2, 4], rec["why"]
    assert all("no version they patch" in w for w in rec["why"]), rec["why"]
    assert rec["versions"] == [1, 1, 3, 3]
    assert trainer["full"] == [True, True]  # rounds 1 and 3 committed (2 and 4 raised)


def _hostile_patch_receiver(port: int) -> dict[str, Any]:
    """Round 3's device patch arrives with an index past its piece (the bytes of a bucket are
    untrusted): read without waiting, clamped, flagged, refused with the digests."""
    import deltackpt.sync.receiver as receiver_mod
    from deltackpt import sync

    real = receiver_mod.read_patch_lazy
    rounds: list[int] = []

    def scribbled(room: torch.Tensor, length: int, itemsize: int, numel: int) -> Any:
        if rounds and rounds[-1] == 3:
            room[8:12].view(torch.int32).fill_(numel + 5)  # the first index, past the piece
        return real(room, length, itemsize, numel)

    receiver_mod.read_patch_lazy = scribbled  # type: ignore[assignment]
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    held: dict[str, torch.Tensor] = {}
    expect = _state()
    out: dict[str, Any] = {"errors": [], "versions": [], "bad": []}
    for v in (1, 2, 3, 4):
        rounds.append(v)
        before = {n: t.clone() for n, t in held.items()}
        try:
            receiver.pull(lambda ws: held.update((n, t.cpu().clone()) for n, t in ws))
            _step(expect, v)
        except sync.SyncError as e:
            _step(expect, v)  # the trainer stepped; this rank kept version 2
            out["errors"].append((v, type(e).__name__, str(e)))
            out["untouched"] = all(torch.equal(held[n], t) for n, t in before.items())
        out["versions"].append(receiver.version)
        if receiver.version == v:
            out["bad"].append(sorted(n for n, t in expect.items() if not torch.equal(held[n], t)))
    group.pg.barrier().wait()
    group.close()
    return out


def test_a_device_patch_with_an_index_past_its_piece_fails_the_round_unapplied() -> None:
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_patch_trainer, (port,)), (_hostile_patch_receiver, (port,))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert [e[:2] for e in rec["errors"]] == [(3, "DigestMismatchError")], rec["errors"]
    assert "device patch's count or indices do not fit the piece" in rec["errors"][0][2]
    assert rec["untouched"] and rec["versions"] == [1, 2, 2, 4]
    assert trainer["errors"] == [(3, "RoundAbortedError")]
    assert rec["bad"] == [[], [], []]  # versions 1, 2 and 4 bit-exact


@pytest.mark.gpu
def test_device_patches_on_cuda_bit_exact() -> None:
    """The same rounds on a GPU: CUDA bucket, device bases, device staging."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU on this machine)")
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_patch_trainer, (port, "cuda:0")), (_patch_receiver, (port, False, "cuda:0"))],
            timeout=120,
            fast_exit=True,
        )
    )
    assert trainer["errors"] == [] and rec["errors"] == []
    assert 0 < trainer["payload"][1] < 32 * 32 * 4 // 4
    assert rec["patched"] == [0, 1, 1, 1]
    assert rec["bad"] == [[], [], [], []] and rec["versions"] == [1, 2, 3, 4]
