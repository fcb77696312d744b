"""An S3 store behind a fault-injecting proxy (tests/store/_proxy.py, in front of moto's server
on 127.0.0.1): a lost answer to a create-only put or an upload's completion is not a failed save;
a dead or silent store (resets, a peer that stops reading, a stalled answer) gives StoreIOError
naming the URL within the deadlines, for save, load, verify and gc; corruption is called so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, SnapshotExistsError, StoreIOError
from deltackpt.store import StoreTimeouts
from deltackpt.store.objstore import FsspecStorage
from deltackpt.store.storage import manifest_key
from tests.store._proxy import FaultProxy, once
from tests.store._s3 import uploads

pytest.importorskip("s3fs")  # a guard only: the test extra installs s3fs and moto
pytest.importorskip("moto.server")

CHUNK = 1 << 20
# Short deadlines, so each silent-store case takes seconds; BOUND is what the test allows.
SHORT = {"connect_timeout": 1, "read_timeout": 2, "request_timeout": 2, "operation_timeout": 4}
BOUND = 20.0


@pytest.fixture
def proxy(endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(endpoint) as p:
        yield p


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 << 20, generator=g), "ids": torch.arange(100)}  # 12 MiB


def _via(proxy: FaultProxy, url: str, **kw: Any) -> FsspecStorage:
    opts = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    return FsspecStorage(url, {**opts, **kw.pop("options", {})}, block_size=5 << 20, **kw)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _within(seconds: float, fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``fn`` on a thread; fail if it still runs after ``seconds``; (its error, the time)."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            out[0] = e

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a silent store hangs it"
    return out[0], time.monotonic() - t0


@pytest.mark.parametrize(
    ("method", "path_part"),
    [("PUT", "MANIFEST.json"), ("PUT", "STORE.json"), ("POST", "uploadId=")],
    ids=["manifest-create", "store-create", "upload-complete"],
)
def test_lost_answer_to_a_write_that_landed_is_a_won_save(
    proxy: FaultProxy, opts: dict, bucket: str, method: str, path_part: str
) -> None:
    url = f"s3://{bucket}/run"
    proxy.rule = once("lose", method, path_part)
    st = deltackpt.open_store(url, storage=_via(proxy, url), chunk_bytes=CHUNK)
    sd = _state()
    info = deltackpt.save(sd, st, "a")
    assert info.name == "a"
    lost = [i for i, (m, p, a) in enumerate(proxy.seen) if a == "lose"]
    assert len(lost) == 1  # the fault fired, and the same request went out again
    m, p, _ = proxy.seen[lost[0]]
    assert any(s[:2] == (m, p) for s in proxy.seen[lost[0] + 1 :])
    direct = deltackpt.open_store(url, storage=FsspecStorage(url, opts))  # not via the proxy
    assert [i.name for i in deltackpt.snapshots(direct)] == ["a"]
    _equal(deltackpt.load(direct, "a"), sd)


def test_create_race_lost_to_other_bytes_still_raises(opts: dict, bucket: str) -> None:
    storage = FsspecStorage(f"s3://{bucket}/run", opts)
    key = manifest_key("x")
    storage.publish(key, b'{"mine": 1}')
    storage.publish(key, b'{"mine": 1}')  # read back: the very bytes, so this writer won
    with pytest.raises(SnapshotExistsError, match="another save") as e:
        storage.publish(key, b'{"mine": 2}')
    assert f"s3://{bucket}/run/snapshots/x/MANIFEST.json" in str(e.value)


def _committed(opts: dict, url: str) -> dict[str, torch.Tensor]:
    st = deltackpt.open_store(url, storage=FsspecStorage(url, opts), chunk_bytes=CHUNK)
    sd = _state(1)
    deltackpt.save(sd, st, "base")
    return sd


def test_a_stalled_part_is_retried_within_request_timeout(
    proxy: FaultProxy, opts: dict, bucket: str
) -> None:
    url = f"s3://{bucket}/run"
    st = deltackpt.open_store(url, storage=_via(proxy, url, options=SHORT), chunk_bytes=CHUNK)
    proxy.rule = once("blackhole", "PUT", "partNumber=")  # one try never read: cut, retried
    sd = _state(2)
    err, took = _within(BOUND, lambda: deltackpt.save(sd, st, "a"))
    assert err is None, err
    assert took >= SHORT["request_timeout"] - 0.5
    _equal(deltackpt.load(st, "a"), sd)


def _save(st: Any) -> None:
    deltackpt.save(_state(3), st, "new")


def _load(st: Any) -> None:
    deltackpt.load(st, "base")


def _verify(st: Any) -> None:
    deltackpt.verify(st)  # an unreachable store is no damage to report: it raises


def _gc(st: Any) -> None:
    deltackpt.gc(st, keep_last=1)


@pytest.mark.parametrize(
    ("what", "fault", "run"),
    [
        ("save", "parts never read", _save),
        ("load", "answers stall", _load),
        ("verify", "peer stops reading", _verify),
        ("gc", "connections reset", _gc),
    ],
)
def test_silent_or_dead_store_fails_within_the_deadline(
    proxy: FaultProxy,
    endpoint: str,
    opts: dict,
    bucket: str,
    what: str,
    fault: str,
    run: Callable[[Any], None],
) -> None:
    url = f"s3://{bucket}/run"
    _committed(opts, url)
    storage = _via(proxy, url, options=SHORT, no_concurrent_saves=True)
    st = deltackpt.open_store(url, storage=storage)
    if fault == "parts never read":
        proxy.rule = lambda m, p: "blackhole" if "partNumber=" in p else "pass"
    elif fault == "answers stall":
        proxy.rule = lambda m, p: "stall" if "/packs/" in p else "pass"
    elif fault == "peer stops reading":
        proxy.mode = "blackhole"
    else:
        proxy.mode = "reset"
    err, took = _within(BOUND, lambda: run(st))
    assert isinstance(err, StoreIOError), f"{what}: {err!r}"
    assert url in str(err), str(err)
    # the deadline plus cleanup (a busy machine adds seconds); without the deadline s3fs retries
    # for minutes, and _within fails at BOUND
    assert took < BOUND, took
    if what == "save":  # cleanup ran too: the upload was aborted, nothing committed
        assert not uploads(endpoint, bucket)
        proxy.mode, proxy.rule = "pass", lambda m, p: "pass"
        assert [i.name for i in deltackpt.snapshots(st)] == ["base"]


def test_deadline_defaults_and_options(opts: dict, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    t = StoreTimeouts()
    assert (t.connect_timeout, t.read_timeout, t.request_timeout, t.operation_timeout) == (
        5,
        15,
        60,
        90,
    )
    readme = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for key, default in [("connect", 5), ("read", 15), ("request", 60), ("operation", 90)]:
        assert f"| `{key}_timeout` | {default} |" in readme, key  # what the docs promise
    s = FsspecStorage(url, opts)
    assert s.timeouts == t
    assert (s.fs.config_kwargs["connect_timeout"], s.fs.config_kwargs["read_timeout"]) == (5, 15)
    s = FsspecStorage(url, {**opts, "operation_timeout": 7, "read_timeout": 3})
    assert (s.timeouts.operation_timeout, s.fs.config_kwargs["read_timeout"]) == (7, 3)
    s = FsspecStorage(url, {**opts, "config_kwargs": {"read_timeout": 4}})
    assert s.timeouts.read_timeout == 4  # botocore's own setting is the deadline
    with pytest.raises(InvalidArgumentError, match="read_timeout given twice"):
        FsspecStorage(url, {**opts, "read_timeout": 3, "config_kwargs": {"read_timeout": 4}})
    with pytest.raises(InvalidArgumentError, match="request_timeout=0"):
        FsspecStorage(url, {**opts, "request_timeout": 0})
    with pytest.raises(InvalidArgumentError, match="given twice"):
        FsspecStorage(url, {**opts, "operation_timeout": 7}, timeouts=StoreTimeouts())


def test_checksum_mismatch_on_a_manifest_is_called_corruption(
    proxy: FaultProxy, opts: dict, bucket: str
) -> None:
    url = f"s3://{bucket}/run"
    _committed(opts, url)
    st = deltackpt.open_store(url, storage=_via(proxy, url))
    proxy.rule = once("flip", "GET", "MANIFEST.json")
    with pytest.raises(StoreIOError) as e:
        deltackpt.load(st, "base")
    msg = str(e.value)
    assert f"{url}/snapshots/base/MANIFEST.json" in msg
    assert "checksum" in msg and "corrupt" in msg
    assert "credentials" not in msg  # not the URL's, the credentials' or the network's fault
    assert [a for _, _, a in proxy.seen].count("flip") == 1


def test_verify_names_the_snapshot_of_a_corrupt_chunk(tmp_path: Path) -> None:
    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK)
    deltackpt.save({"w": torch.randn(1 << 20)}, st, "step-7", encoding="fast-restore")
    pack = max((tmp_path / "s" / "packs").glob("*.pack"), key=lambda p: p.stat().st_size)
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    report = deltackpt.verify(st)
    assert len(report.problems) == 1
    reason = report.problems[0].reason
    assert "snapshot 'step-7' key 'w'" in reason, reason
    assert "of verify" not in reason
