"""deltackpt.Follower(boxes=): a follower that holds and hands over only the box of each tensor
its caller loads (a tensor-parallel rank's rows or columns), kept up to date from a store of
xor deltas; against the state each version saved."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError
from deltackpt.loading import boxed
from tests.loading._history import bits, new_store, publish, state_at

# rank 1 of 2: w0 and w5 by rows (w5's edge inside a chunk), w1 and w3 by columns, the rest
# whole
BOXES = {
    "w0": ((128, 0), (128, 256)),
    "w1": ((0, 128), (256, 128)),
    "w3": ((0, 0), (256, 100)),
    "w5": ((200, 0), (200, 128)),
}


def box_of(name: str, shape: tuple[int, ...]) -> Any:
    return BOXES.get(name)


def cut(t: torch.Tensor, box: Any) -> torch.Tensor:
    if box is None:
        return t
    return t[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]


def follower(st: Any, got: list[dict[str, torch.Tensor]], **kw: Any) -> deltackpt.Follower:
    return deltackpt.Follower(
        st, load_weights=lambda w: got.append({n: t.clone() for n, t in w}), keys=["model"],
        rename=lambda k: k.removeprefix("model/"), boxes=box_of, lease_ttl=None, **kw,
    )  # fmt: skip


def holds(f: deltackpt.Follower, k: int) -> bool:
    want = state_at(k)["model"]
    held = f.state
    return set(held) == {f"model/{n}" for n in want} and all(
        torch.equal(bits(held[f"model/{n}"]), bits(cut(t, BOXES.get(n)).contiguous()))
        for n, t in want.items()
    )


@pytest.mark.parametrize("window", [None, 1])
def test_holds_and_hands_over_only_its_boxes_through_a_delta_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    if window is not None:  # column boxes read one tensor at a time through the scratch buffer
        monkeypatch.setattr(boxed, "WINDOW", window)
    st = new_store(tmp_path / "s")
    publish(st, 0)
    got: list[dict[str, torch.Tensor]] = []
    f = follower(st, got)
    s0 = f.poll()
    assert s0 is not None and s0.mode == "full" and holds(f, 0)
    assert f.held_boxes["model/w1"] == ((0, 128), (256, 128))
    assert f.held_boxes["model/w2"] is None
    assert {n: tuple(t.shape) for n, t in got[0].items() if n in BOXES} == {
        n: b[1] for n, b in BOXES.items()
    }
    whole = sum(t.nbytes for t in state_at(0)["model"].values())
    assert sum(t.nbytes for t in f.state.values()) < 0.8 * whole
    for k in range(1, 5):  # xor deltas: w0, w1, w5, bias change every step
        publish(st, k)
        s = f.poll()
        assert s is not None and (s.mode, s.version) == ("incremental", f"s{k}"), s
        assert holds(f, k), k
        want = state_at(k)["model"]
        # what changed is handed over, in boxes, bit-exact
        assert set(got[-1]) >= {"w0", "w1", "w5", "bias"} and "w3" not in got[-1]
        for n, t in got[-1].items():
            assert torch.equal(bits(t), bits(cut(want[n], BOXES.get(n)).contiguous())), (k, n)
        assert s.load.bytes_read < s0.load.bytes_read


def test_a_damaged_box_fails_the_poll_and_the_next_one_loads_whole(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    got: list[dict[str, torch.Tensor]] = []
    f = follower(st, got)
    f.poll()
    publish(st, 1)
    m = st.manifest("s1")
    e = next(e for e in m.tensors if e.path == "model/w1")  # boxed, changed in s1
    flipped = []
    for d, _, _ in e.all_slices():  # a byte of each of its chunks (xor deltas or whole)
        rec = m.chunks[d]
        p = st.pack_path(rec.pack)
        p.chmod(0o644)
        flipped.append((p, rec.offset + 5))
    for p, at in set(flipped):
        flip(p, at)
    with pytest.raises(deltackpt.errors.CorruptChunkError):
        f.poll()
    # the engine got nothing; the copy was read into, so the follower holds no version, and
    # once the store is whole again its next poll loads whole
    assert f.version is None and len(got) == 1
    for p, at in set(flipped):  # repaired
        flip(p, at)
    s = f.poll()
    assert s is not None and s.mode == "full" and holds(f, 1) and len(got) == 2


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_new_boxes_or_tensors_load_whole_and_bad_boxes_are_refused(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    f = follower(st, [])
    f.poll()
    BOXES["w2"] = ((0, 0), (100, 256))  # the caller's boxes changed (a new engine layout)
    try:
        publish(st, 1)
        s = f.poll()
        assert s is not None and s.mode == "full" and "boxes" in s.reason
        assert tuple(f.state["model/w2"].shape) == (100, 256)
    finally:
        del BOXES["w2"]
    bad = deltackpt.Follower(st, load_weights=lambda w: None, boxes=lambda n, s: ((0,), (9,)),
                             lease_ttl=None)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"model/w0.*shape"):
        bad.poll()
    with pytest.raises(InvalidArgumentError, match="load_weights"):
        deltackpt.Follower(st, into=state_at(0), boxes=box_of)


def test_adopts_a_boxed_copy_and_refuses_a_whole_one(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    s0 = {f"model/{n}": cut(t, BOXES.get(n)).clone() for n, t in state_at(0)["model"].items()}
    f = follower(st, [])
    f.adopt("s0", s0)
    publish(st, 1)
    s = f.poll()
    assert s is not None and s.mode == "incremental" and holds(f, 1)
    whole = {f"model/{n}": t for n, t in state_at(0)["model"].items()}
    with pytest.raises(InvalidArgumentError, match="model/w0"):
        follower(st, []).adopt("s0", whole)


def test_tied_tensors_saved_as_one_storage_are_held_in_boxes(tmp_path: Path) -> None:
    # an LM head tied to the embedding: one storage in the snapshot, two keys, each boxed
    st = new_store(tmp_path / "s")
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(512, 64, generator=g).to(torch.bfloat16)
    rows = ((256, 0), (256, 64))
    got: list[dict[str, torch.Tensor]] = []
    f = deltackpt.Follower(st, load_weights=lambda w: got.append({n: t.clone() for n, t in w}),
                           boxes=lambda n, s: rows, lease_ttl=None)  # fmt: skip
    for k in range(3):
        emb[300 + k] += 1
        deltackpt.save({"emb": emb, "head": emb}, st, f"t{k}", encoding="smallest")
        s = f.poll()
        assert s is not None and s.mode == ("full" if k == 0 else "incremental")
        want = emb[256:].contiguous()
        assert all(torch.equal(bits(f.state[n]), bits(want)) for n in ("emb", "head")), k
        assert {n: torch.equal(bits(t), bits(want)) for n, t in got[-1].items()} == {
            "emb": True, "head": True,
        }  # fmt: skip


def test_a_tensor_boxed_as_none_of_it_is_never_held_read_or_handed_over(tmp_path: Path) -> None:
    # boxes(name, shape) -> False: another rank's expert, say; w0 changes every step
    st = new_store(tmp_path / "s")
    publish(st, 0)
    got: list[dict[str, torch.Tensor]] = []
    f = deltackpt.Follower(st, load_weights=lambda w: got.append({n: t.clone() for n, t in w}),
                           keys=["model"], rename=lambda k: k.removeprefix("model/"),
                           boxes=lambda n, s: False if n == "w0" else None, lease_ttl=None)  # fmt: skip
    s0 = f.poll()
    assert s0 is not None and "model/w0" not in f.state and "w0" not in got[0]
    assert f.held_boxes["model/w0"] is False and f.held_boxes["model/w1"] is None
    publish(st, 1)
    s1 = f.poll()
    assert s1 is not None and s1.mode == "incremental" and "w0" not in got[-1]
    want = state_at(1)["model"]
    assert all(
        torch.equal(bits(f.state[f"model/{n}"]), bits(t)) for n, t in want.items() if n != "w0"
    )


@pytest.mark.parametrize("window", [None, 1])
def test_boxes_of_a_distributed_save_read_from_its_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    # the golden two-rank store: "rows" (6, 4) saved as Shard(0), "cols" (3, 10) as Shard(1)
    # blocks; boxes across both saved blocks, also one tensor per window (the scratch buffer,
    # which plans for tensors saved whole, hands saved blocks new memory)
    if window is not None:
        monkeypatch.setattr(boxed, "WINDOW", window)
    store = tmp_path / "g"
    shutil.copytree(Path(__file__).parent.parent / "golden" / "v2-dist", store)
    full = deltackpt.load(store, "d1")
    want = {"rows": ((2, 0), (3, 4)), "cols": ((0, 3), (3, 4))}  # across both saved blocks
    f = deltackpt.Follower(store, load_weights=lambda w: None, keys=["rows", "cols"],
                           boxes=lambda n, s: want.get(n), lease_ttl=None)  # fmt: skip
    s = f.poll()
    assert s is not None and s.version == "d1"
    for n, box in want.items():
        assert torch.equal(bits(f.state[n]), bits(cut(full[n], box).contiguous())), n
