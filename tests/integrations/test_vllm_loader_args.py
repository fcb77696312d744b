"""``load_format="deltackpt"``'s ``model_loader_extra_config`` checked and resolved
(``deltackpt/integrations/vllm/loader_args.py``; no vLLM needed). A real engine started from a
store: ``tests/integrations/test_vllm.py`` (the full run's engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import DeltackptError, InvalidArgumentError, SnapshotNotFoundError
from deltackpt.integrations.vllm.loader_args import FIELDS, StartFrom, resolve, start_from


def test_defaults_and_every_field() -> None:
    assert start_from({"store": "/ckpts/run"}) == StartFrom("/ckpts/run")
    full = {"store": "s3://b/run", "snapshot": "step-200", "key": None,
            "storage_options": {"anon": True}, "follow": True, "tp_boxes": True}  # fmt: skip
    want = StartFrom("s3://b/run", "step-200", None, {"anon": True}, True, True)
    assert start_from(full) == want
    assert start_from({"store": "x"}).tp_boxes is None  # the workers' DELTACKPT_VLLM_TP_BOXES
    assert set(FIELDS) == {"store", "snapshot", "key", "storage_options", "follow", "tp_boxes"}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (None, r"needs model_loader_extra_config, a mapping .* got NoneType"),
        ({}, r"has no 'store'; give the store to start from"),
        ({"store": "x", "folow": True}, r"unknown .* field\(s\) \['folow'\]; the fields are"),
        ({"store": ""}, r"\['store'\]='' is invalid; expected a store's directory or URL"),
        ({"store": 3}, r"\['store'\]=3 is invalid"),
        ({"store": "x", "snapshot": ""}, r"\['snapshot'\]='' is invalid; expected a snapshot"),
        ({"store": "x", "key": 0}, r"\['key'\]=0 is invalid; expected where the state dict"),
        ({"store": "x", "storage_options": "anon"}, r"\['storage_options'\]='anon' is invalid"),
        ({"store": "x", "follow": "yes"}, r"\['follow'\]='yes' is invalid; expected true"),
        ({"store": "x", "tp_boxes": 1}, r"\['tp_boxes'\]=1 is invalid; expected with follow"),
    ],
)
def test_bad_fields_are_refused_by_name(extra: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        start_from(extra)


def _saved(tmp_path: Path, *names: str) -> str:
    st = deltackpt.open_store(tmp_path / "store")
    for i, name in enumerate(names):
        deltackpt.save({"model": {"w": torch.full((4,), float(i))}}, st, name)
    return str(tmp_path / "store")


def test_latest_is_the_newest_committed_snapshot_and_a_name_is_itself(tmp_path: Path) -> None:
    # commit order, not name order: "b" was committed before "a"
    url = _saved(tmp_path, "b", "a")
    assert resolve(start_from({"store": url}))[1] == "a"
    assert resolve(start_from({"store": url, "snapshot": "b"}))[1] == "b"


def test_a_missing_snapshot_names_the_newest_ones(tmp_path: Path) -> None:
    url = _saved(tmp_path, "s0", "s1")
    with pytest.raises(SnapshotNotFoundError, match=r"no snapshot 's9' \(its newest: 's0', 's1'\)"):
        resolve(start_from({"store": url, "snapshot": "s9"}))


def test_an_empty_or_missing_store_is_refused(tmp_path: Path) -> None:
    deltackpt.open_store(tmp_path / "empty")
    with pytest.raises(SnapshotNotFoundError, match="has no committed snapshot to start from"):
        resolve(start_from({"store": str(tmp_path / "empty")}))
    with pytest.raises(DeltackptError):
        resolve(start_from({"store": str(tmp_path / "nothing-here")}))
    assert not (tmp_path / "nothing-here").exists()  # never created by a look


def test_an_object_store_is_resolved_with_its_storage_options(
    opts: dict[str, Any], bucket: str
) -> None:
    # the fields as vLLM hands them over (JSON: the options a mapping), against a real S3 API
    url = f"s3://{bucket}/run"
    st = deltackpt.open_store(url, storage_options=opts)
    deltackpt.save({"model": {"w": torch.ones(4)}}, st, "step-1", metadata={"step": 1})
    store, name = resolve(start_from({"store": url, "storage_options": dict(opts)}))
    assert name == "step-1" and store.manifest(name).metadata["step"] == 1
    with deltackpt.open_snapshot(store, name) as snap:  # what the loader reads it with
        assert torch.equal(snap.get_tensor("model/w"), torch.ones(4))
