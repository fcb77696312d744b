"""The CLI on an S3 object store (a moto server on 127.0.0.1, started here): ls, show, du,
verify, gc --dry-run and gc --no-concurrent-saves with ``--storage-options`` JSON or the AWS_*
environment (``AWS_ENDPOINT_URL``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.cli.main import main

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from tests._s3 import new_bucket, s3_options


@pytest.fixture
def run(endpoint: str) -> tuple[str, dict[str, Any]]:
    """A store with three snapshots (s1 deleted-by-gc material), its URL and options."""
    url, opts = f"s3://{new_bucket(endpoint)}/run", s3_options(endpoint)
    st = deltackpt.open_store(url, storage_options=opts, chunk_bytes=64 << 10)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        deltackpt.save({"w": torch.randn(256, 256, generator=g), "step": i}, st, f"s{i}")
    return url, opts


def _cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_ls_show_du_verify_with_storage_options(run: Any, capsys: Any) -> None:
    url, opts = run
    so = ("--storage-options", json.dumps(opts))
    code, out, _ = _cli(capsys, "ls", url, *so)
    assert code == 0 and all(f"s{i}" in out for i in range(3)), out
    code, out, _ = _cli(capsys, "show", url, "s1", *so)
    assert code == 0 and "w" in out
    code, out, _ = _cli(capsys, "du", url, *so)
    assert code == 0
    code, out, err = _cli(capsys, "verify", url, *so)
    assert code == 0, out + err
    code, _, err = _cli(capsys, "ls", url, "--storage-options", "{not json")
    assert code == 2 and "JSON" in err


def test_gc_dry_run_then_gc_needs_the_promise(run: Any, capsys: Any) -> None:
    url, opts = run
    so = ("--storage-options", json.dumps(opts))
    code, out, err = _cli(capsys, "gc", url, *so, "--keep-last", "1", "--dry-run")
    assert code == 0 and "s0, s1" in out, out + err
    st = deltackpt.open_store(url, storage_options=opts)
    assert [i.name for i in deltackpt.snapshots(st)] == ["s0", "s1", "s2"]  # dry run
    code, _, err = _cli(capsys, "gc", url, *so, "--keep-last", "1")
    assert code == 2 and "--no-concurrent-saves" in err
    assert [i.name for i in deltackpt.snapshots(st)] == ["s0", "s1", "s2"]
    code, out, err = _cli(capsys, "gc", url, *so, "--keep-last", "1", "--no-concurrent-saves")
    assert code == 0, out + err
    assert [i.name for i in deltackpt.snapshots(st)] == ["s2"]
    code, out, err = _cli(capsys, "verify", url, *so)
    assert code == 0, out + err


def test_aws_environment_alone(run: Any, endpoint: str, capsys: Any, monkeypatch: Any) -> None:
    import s3fs

    url, _ = run  # s3_server set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    # as a fresh `deltackpt` process would: no s3fs instance cached by an earlier test (fsspec
    # caches instances by their arguments, and one made without these variables has no keys)
    s3fs.S3FileSystem.clear_instance_cache()
    code, out, err = _cli(capsys, "ls", url)
    assert code == 0 and "s2" in out, out + err
    code, out, err = _cli(capsys, "verify", url)
    assert code == 0, out + err
