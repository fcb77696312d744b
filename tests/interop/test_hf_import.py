"""import_checkpoint: every source kind round-trips bit-exact, imports dedupe against the store,
and hostile safetensors headers / index files fail with typed errors before any allocation."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import deltackpt
from deltackpt.errors import ImportFormatError, StateKeyError

safetensors_torch = pytest.importorskip("safetensors.torch")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(32, 32, generator=g),
        "layer.0.b": torch.randn(32, generator=g).half(),
        "count": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
    }


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _sharded_dir(tmp_path, sd):
    """A directory laid out as save_pretrained shards it: two files and an index."""
    d = tmp_path / "hf"
    d.mkdir()
    keys = list(sd)
    parts = {
        "model-00001-of-00002.safetensors": keys[:3],
        "model-00002-of-00002.safetensors": keys[3:],
    }
    for f, ks in parts.items():
        safetensors_torch.save_file({k: sd[k] for k in ks}, d / f, metadata={"format": "pt"})
    wm = {k: f for f, ks in parts.items() for k in ks}
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": wm})
    )
    return d


def test_safetensors_file_and_hf_dirs_round_trip(tmp_path):
    sd = _state()
    safetensors_torch.save_file(sd, tmp_path / "m.safetensors")
    store = tmp_path / "s"
    info = deltackpt.import_checkpoint(tmp_path / "m.safetensors", store, "file")
    assert info.tensors == len(sd)
    loaded = deltackpt.load(store, "file")
    _same(loaded["model"], sd)
    assert deltackpt.open_store(store).manifest("file").metadata["import_format"] == "safetensors"
    deltackpt.import_checkpoint(_sharded_dir(tmp_path, sd), store, "sharded", key=None)
    _same(deltackpt.load(store, "sharded"), sd)
    one = tmp_path / "one"
    one.mkdir()
    safetensors_torch.save_file(sd, one / "model.safetensors")
    deltackpt.import_checkpoint(one, store, "dir", key="a/b")
    _same(deltackpt.load(store, "dir")["a"]["b"], sd)


def test_torch_save_file_round_trips_and_src_key_selects(tmp_path):
    sd = _state()
    opt_state = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    torch.save({"model": sd, "optim": opt_state}, tmp_path / "ckpt.pt")
    store = tmp_path / "s"
    deltackpt.import_checkpoint(tmp_path / "ckpt.pt", store, "m", src_key="model")
    _same(deltackpt.load(store, "m")["model"], sd)
    deltackpt.import_checkpoint(tmp_path / "ckpt.pt", store, "all", key=None)
    whole = deltackpt.load(store, "all")
    _same(whole["model"], sd)
    assert whole["optim"]["param_groups"] == [{"lr": 0.1}]
    with pytest.raises(StateKeyError, match="'optim'"):
        deltackpt.import_checkpoint(tmp_path / "ckpt.pt", store, "x", src_key="modell")


def test_torch_save_with_pickled_objects_is_refused(tmp_path):
    torch.save({"model": _state(), "obj": _Obj()}, tmp_path / "bad.pt")
    with pytest.raises(ImportFormatError, match="weights_only"):
        deltackpt.import_checkpoint(tmp_path / "bad.pt", tmp_path / "s", "x")
    assert deltackpt.open_store(tmp_path / "s").names() == []


class _Obj:
    pass


def test_dcp_checkpoint_round_trips_nested(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {k: v for k, v in _state().items() if k != "empty"}
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": sd, "extra": {"step": 3}}, checkpoint_id=tmp_path / "dcp")
    store = tmp_path / "s"
    deltackpt.import_checkpoint(tmp_path / "dcp", store, "d", src_key="model")
    _same(deltackpt.load(store, "d")["model"], sd)


def test_hostile_dcp_metadata_is_not_unpickled(tmp_path):
    import pickle

    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(_Obj()))
    with pytest.raises(ImportFormatError, match="not allowed"):
        deltackpt.import_checkpoint(d, tmp_path / "s", "x")


def test_importing_the_same_base_twice_writes_only_a_manifest(tmp_path):
    sd = {
        f"w{i}": torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) for i in range(8)
    }
    safetensors_torch.save_file(sd, tmp_path / "base.safetensors")
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10, small_bytes=4096)
    first = deltackpt.import_checkpoint(tmp_path / "base.safetensors", store, "base")
    assert first.bytes_written >= 8 * 64 << 10
    again = deltackpt.import_checkpoint(tmp_path / "base.safetensors", store, "base-again")
    assert again.chunks_new == 0 and again.bytes_written < 16 << 10
    # a fine-tune whose frozen tensors equal the base: only the two changed tensors are new
    tuned = dict(sd)
    tuned["w2"] = sd["w2"] + 1
    tuned["w5"] = sd["w5"] * 2
    safetensors_torch.save_file(tuned, tmp_path / "tuned.safetensors")
    ft = deltackpt.import_checkpoint(tmp_path / "tuned.safetensors", store, "ft")
    assert ft.chunks_new == 2 and ft.chunks_reused == 6
    assert 2 * 64 << 10 <= ft.bytes_written < 3 * 64 << 10
    _same(deltackpt.load(store, "ft")["model"], tuned)


def _header_file(path, header: dict, data: bytes = b"\0" * 16, n: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)


@pytest.mark.parametrize(
    ("header", "n", "match"),
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}, None, "outside"),
        ({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, None, "needs"),
        ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, None, "unknown dtype"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, None, "shape"),
        ({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, None, "2\\*\\*62"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, True]}}, None, "data_offsets"),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            None,
            "overlap",
        ),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 2**60, "header claims"),
        ([1, 2], None, "JSON list"),
    ],
)
def test_hostile_safetensors_headers_give_typed_errors(tmp_path, header, n, match):
    p = tmp_path / "bad.safetensors"
    _header_file(p, header, n=n)
    with pytest.raises(ImportFormatError, match=match):
        deltackpt.import_checkpoint(p, tmp_path / "s", "x")
    assert deltackpt.open_store(tmp_path / "s").names() == []


def test_truncated_file_and_index_escaping_the_directory(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\1\0")
    with pytest.raises(ImportFormatError, match="shorter"):
        deltackpt.import_checkpoint(tmp_path / "short.safetensors", tmp_path / "s", "x")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../short.safetensors"}})
    )
    with pytest.raises(ImportFormatError, match="not a file in"):
        deltackpt.import_checkpoint(d, tmp_path / "s", "x")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "gone.safetensors"}})
    )
    with pytest.raises(ImportFormatError, match="incomplete"):
        deltackpt.import_checkpoint(d, tmp_path / "s", "x")
