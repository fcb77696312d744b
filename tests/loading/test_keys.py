"""``load(keys=...)`` and ``StoreReader(keys=...)``: unselected keys are never planned or read."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import CorruptChunkError, InvalidArgumentError, StateMismatchError
from deltackpt.format.codecs import RAW, EncodePolicy
from deltackpt.loading.select import key_filter
from deltackpt.store.packs import PackReaders

RAW_ONLY = EncodePolicy(codecs=(RAW,))


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "layers.0.w": torch.randn(128, 64, generator=g),
            "layers.1.w": torch.randn(128, 64, generator=g),
            "experts.3.w": torch.randn(64, 64, generator=g),
            "experts.13.w": torch.randn(64, 64, generator=g),
        },
        "optim": {"m": [torch.randn(256, generator=g), 7], "lr": 0.5},
        "step": 10,
    }


@contextmanager
def count_reads() -> Iterator[list[int]]:
    """Bytes every pack read delivers in this process (the one read path of loads)."""
    seen = [0]
    orig_one, orig_v = PackReaders.read_into, PackReaders.readv_into

    def one(self, pack, offset, out):  # type: ignore[no-untyped-def]
        n = orig_one(self, pack, offset, out)
        seen[0] += n
        return n

    def vec(self, pack, offset, bufs):  # type: ignore[no-untyped-def]
        n = orig_v(self, pack, offset, bufs)
        seen[0] += n
        return n

    PackReaders.read_into, PackReaders.readv_into = one, vec  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        PackReaders.read_into, PackReaders.readv_into = orig_one, orig_v  # type: ignore[method-assign]


def _new_store(store: Path) -> None:
    """Chunks of 16 KiB, no grouping of small tensors: each test tensor has its own chunks."""
    deltackpt.open_store(store, chunk_bytes=16 << 10, small_bytes=1024)


def _corrupt_entry(store: Path, name: str, path: str) -> None:
    """Flip bytes of every chunk only entry ``path`` uses, in its pack file."""
    st = deltackpt.open_store(store)
    m = st.manifest(name)
    mine = {d for e in m.tensors if e.path == path for d, _, _ in e.all_slices()}
    others = {d for e in m.tensors if e.path != path for d, _, _ in e.all_slices()}
    assert mine - others
    for d in mine - others:
        rec = m.chunks[d]
        p = st.pack_path(rec.pack)
        p.chmod(0o644)
        with open(p, "r+b") as f:
            f.seek(rec.offset + 5)
            b = f.read(1)
            f.seek(rec.offset + 5)
            f.write(bytes([b[0] ^ 0xFF]))


def test_key_filter_matches_paths_prefixes_and_dotted_forms() -> None:
    sel = key_filter(["model/layers.0", "optim.m"])
    assert sel is not None
    assert sel("model/layers.0.w") and sel("model/layers.0")
    assert not sel("model/layers.01.w") and not sel("model/layers.1.w")
    assert sel("optim/m/0") and not sel("optim/lr")
    assert key_filter(None) is None
    pred = key_filter(lambda p: p.endswith(".w"))
    assert pred is not None and pred("a/b.w") and not pred("a/b")
    for bad in ("model", 3, [""], [1]):
        with pytest.raises(InvalidArgumentError, match="keys="):
            key_filter(bad)  # type: ignore[arg-type]


def test_unselected_corrupt_chunks_are_never_read(store_dir: Path) -> None:
    _new_store(store_dir)
    _new_store(store_dir)
    state = _state()
    deltackpt.save(state, store_dir, "s", encoding=RAW_ONLY)
    _corrupt_entry(store_dir, "s", "model/experts.13.w")
    with pytest.raises(CorruptChunkError, match=r"experts\.13"):
        deltackpt.load(store_dir, "s")
    got = deltackpt.load(store_dir, "s", keys=["model/layers", "model/experts.3", "step"])
    assert set(got) == {"model", "step"} and got["step"] == 10
    assert set(got["model"]) == {"layers.0.w", "layers.1.w", "experts.3.w"}
    for k, v in got["model"].items():
        assert torch.equal(v, state["model"][k]), k
    # a predicate on the key path; a list keeps its length, unselected elements become None
    got = deltackpt.load(store_dir, "s", keys=lambda p: p.startswith("optim/m/0"))
    assert list(got) == ["optim"] and got["optim"]["m"][1] is None
    assert torch.equal(got["optim"]["m"][0], state["optim"]["m"][0])
    assert deltackpt.load(store_dir, "s", keys=["nothing"]) == {}


def test_bytes_read_are_those_of_the_selected_keys(store_dir: Path) -> None:
    _new_store(store_dir)
    state = _state(1)
    deltackpt.save(state, store_dir, "s", encoding=RAW_ONLY)
    with count_reads() as full:
        deltackpt.load(store_dir, "s")
    with count_reads() as part:
        got = deltackpt.load(store_dir, "s", keys=["model/experts.3.w"])
    assert torch.equal(got["model"]["experts.3.w"], state["model"]["experts.3.w"])
    want = 64 * 64 * 4
    assert want <= part[0] <= want + 4096  # the entry's chunk, at most alignment slack
    assert full[0] >= 6 * part[0]  # 97 KiB of tensors in all


def test_into_with_keys_checks_and_fills_only_selected(store_dir: Path) -> None:
    _new_store(store_dir)
    state = _state(2)
    deltackpt.save(state, store_dir, "s")
    _corrupt_entry(store_dir, "s", "model/layers.1.w")
    # strict: only the selected keys must match; the target lacks every other key
    target = {"model": {"layers.0.w": torch.zeros(128, 64)}, "optim": {"lr": 0.0}, "step": -1}
    deltackpt.load(store_dir, "s", into=target, keys=["model/layers.0", "optim/lr"])
    assert torch.equal(target["model"]["layers.0.w"], state["model"]["layers.0.w"])
    assert target["optim"]["lr"] == 0.5 and target["step"] == -1  # step: not selected
    # a selected key that differs still fails strict checks
    bad = {"model": {"layers.0.w": torch.zeros(3)}}
    with pytest.raises(StateMismatchError, match=r"layers\.0\.w"):
        deltackpt.load(store_dir, "s", into=bad, keys=["model/layers.0"])
    # a selected key the target lacks is reported as missing (strict)
    with pytest.raises(StateMismatchError, match=r"experts\.3\.w"):
        deltackpt.load(store_dir, "s", into={"model": {}}, keys=["model/experts.3"])


def test_dcp_reader_keys_drop_read_items(store_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from deltackpt.dcp import StoreReader

    warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
    _new_store(store_dir)
    state = _state(3)
    deltackpt.save({"model": state["model"]}, store_dir, "s", encoding=RAW_ONLY)
    _corrupt_entry(store_dir, "s", "model/experts.13.w")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with count_reads() as n:
        dcp.load(target, storage_reader=StoreReader(store_dir, "s", keys=["model.layers.0"]))
    assert torch.equal(target["model"]["layers.0.w"], state["model"]["layers.0.w"])
    assert not target["model"]["layers.1.w"].any() and not target["model"]["experts.13.w"].any()
    assert n[0] <= 128 * 64 * 4 + 4096
    sel = StoreReader(store_dir, "s", keys=lambda fqn: fqn.endswith("experts.3.w"))
    dcp.load(target, storage_reader=sel)
    assert torch.equal(target["model"]["experts.3.w"], state["model"]["experts.3.w"])
    assert np.count_nonzero(target["model"]["experts.13.w"].numpy()) == 0
