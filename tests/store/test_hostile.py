"""A store on disk is untrusted input: hostile manifests (with valid digests), traversal and
symlinks, damage that stays local, and untyped errors that must not escape.

Every test that touches a hostile store runs under an audit hook (``tests/_audit.py``) that
fails on any file opened or removed outside the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt.cli.main import main as cli
from deltackpt.errors import (
    CorruptChunkError,
    DamagedSnapshotWarning,
    DeltackptError,
    InsufficientMemoryError,
    ManifestError,
    SnapshotNotFoundError,
    StateMismatchError,
    StoreFormatError,
    UnsafePathError,
)
from deltackpt.format.manifest import document_digest
from deltackpt.loading import assemble as loading
from deltackpt.loading.reshard import sub_slices
from tests._audit import confined


def base_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(8, 16, generator=g)
    return {
        "model": {
            "w": torch.randn(64, 64, generator=g),
            "rows": torch.arange(1024, dtype=torch.int32).reshape(4, 256),
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "big": torch.randn(6000, generator=g).to(torch.bfloat16),
        },
        "tied": [emb, emb],
        "step": 7,
        "lr": 0.5,
        "name": "run",
        "none": None,
        "blob": b"\x00\x01",
        "size": torch.Size([2, 3]),
    }


def make_store(root: Path) -> Path:
    """A small store with grouped and split chunks, a shared storage, an xor delta and a
    sharded tensor (rows split in two pieces, written by hand as a 2-rank save would)."""
    st_ = deltackpt.open_store(root, chunk_bytes=8192, small_bytes=4096)
    state = base_state()
    deltackpt.save(state, st_, "s0")
    state["model"]["big"][:100] += 1
    deltackpt.save(state, st_, "s1")
    doc = read_doc(root, "s1")
    for t in doc["tensors"]:
        if t["path"] == "model/rows":
            data = [tuple(x) for x in t.pop("data")]
            t["shards"] = [
                {"offsets": [0, 0], "shape": [2, 256], "data": [list(x) for x in sub_slices(tuple(data), 0, 2048)]},
                {"offsets": [2, 0], "shape": [2, 256], "data": [list(x) for x in sub_slices(tuple(data), 2048, 4096)]},
            ]  # fmt: skip
    write_doc(root, "s1", doc)
    return root


def read_doc(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / "snapshots" / name / "MANIFEST.json").read_bytes())


def write_doc(root: Path, name: str, doc: Any, digest: bool = True) -> None:
    """Write ``doc`` as the manifest of ``name`` with a *valid* digest (a forger's manifest)."""
    if digest and isinstance(doc, dict):
        doc = dict(doc)
        doc["digest"] = document_digest(doc)
    d = root / "snapshots" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "MANIFEST.json").write_bytes(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    )


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("template") / "store")


@pytest.fixture
def sandbox(tmp_path, template):
    """(store, sandbox): a fresh copy of the template store, and bait outside it."""
    store = tmp_path / "store"
    shutil.copytree(template, store)
    bait = tmp_path / "elsewhere"
    bait.mkdir()
    (bait / "evil.pack").write_bytes((store / "packs").iterdir().__next__().read_bytes())
    (bait / "MANIFEST.json").write_bytes((store / "snapshots/s0/MANIFEST.json").read_bytes())
    (bait / "precious.txt").write_text("not yours")
    return store, tmp_path


def test_the_template_store_is_valid(sandbox):
    store, _ = sandbox
    out = deltackpt.load(store, "s1")
    state = base_state()
    state["model"]["big"][:100] += 1
    assert torch.equal(out["model"]["rows"], state["model"]["rows"])
    assert torch.equal(out["model"]["big"], state["model"]["big"])
    assert out["tied"][0].data_ptr() == out["tied"][1].data_ptr()
    assert deltackpt.verify(store).ok


# ------------------------------------------------------------------------------ containment


def _set_pack(doc: dict[str, Any], pack: str) -> None:
    for rec in doc["chunks"].values():
        rec["pack"] = pack


@pytest.mark.parametrize("pack", ["../../elsewhere/evil", "/tmp/evil", "a/b", "..", "x" * 65, ""])
def test_pack_ids_that_leave_the_store_are_refused(sandbox, pack):
    store, box = sandbox
    doc = read_doc(store, "s0")
    _set_pack(doc, pack)
    write_doc(store, "s0", doc)
    with confined(store, box) as violations:
        with pytest.raises(ManifestError, match="pack"):
            deltackpt.load(store, "s0")
        report = deltackpt.verify(store)
        assert report.damaged == ["s0"] and report.problems[0].keys == ("<manifest>",)
        deltackpt.gc(store, keep_last=None)
    assert violations == []
    assert (box / "elsewhere/evil.pack").exists()


def test_a_pack_that_is_a_symlink_is_refused(sandbox):
    store, box = sandbox
    doc = read_doc(store, "s0")
    os.symlink(box / "elsewhere/evil.pack", store / "packs/evil.pack")
    _set_pack(doc, "evil")
    write_doc(store, "s0", doc)
    with confined(store, box) as violations:
        with pytest.raises(CorruptChunkError, match="symlink"):
            deltackpt.load(store, "s0")
        report = deltackpt.verify(store)
        assert not report.ok and all("symlink" in p.reason for p in report.problems)
        r = deltackpt.gc(store)
        assert "packs/evil.pack" in r.refused
    assert violations == []
    assert (store / "packs/evil.pack").is_symlink()  # not ours: left alone


def test_a_snapshot_dir_that_is_a_symlink_is_never_followed(sandbox):
    store, box = sandbox
    os.symlink(box / "elsewhere", store / "snapshots/evil")
    with confined(store, box) as violations:
        with pytest.warns(DamagedSnapshotWarning, match="evil"):
            names = [s.name for s in deltackpt.snapshots(store)]
        assert names == ["s0", "s1"]
        with pytest.raises(UnsafePathError):
            deltackpt.load(store, "evil")
        with pytest.raises(UnsafePathError):
            deltackpt.delete(store, "evil")
        r = deltackpt.gc(store, keep_last=1)
        assert "snapshots/evil" in r.refused and r.damaged == ["evil"]
        assert r.packs_removed == 0  # a damaged manifest may need any pack
        report = deltackpt.verify(store)
        assert report.damaged == ["evil"]
    assert violations == []
    assert (box / "elsewhere/MANIFEST.json").exists()
    assert (box / "elsewhere/precious.txt").read_text() == "not yours"


def test_manifest_file_symlink_and_store_subdir_symlinks(sandbox):
    store, box = sandbox
    (store / "snapshots/s2").mkdir()
    os.symlink(box / "elsewhere/MANIFEST.json", store / "snapshots/s2/MANIFEST.json")
    with confined(store, box) as violations:
        with pytest.raises(UnsafePathError):
            deltackpt.load(store, "s2")
        with pytest.warns(DamagedSnapshotWarning):
            assert deltackpt.load(store)["step"] == 7  # latest readable
    assert violations == []
    # tmp/ replaced by a link: saves and gc refuse to write or sweep through it
    shutil.rmtree(store / "tmp")
    os.symlink(box / "elsewhere", store / "tmp")
    with confined(store, box) as violations:
        with pytest.raises(UnsafePathError):
            deltackpt.save({"x": torch.ones(2)}, store, "s3")
        r = deltackpt.gc(store)
        assert "tmp" in r.refused
    assert violations == []
    assert sorted(p.name for p in (box / "elsewhere").iterdir()) == [
        "MANIFEST.json",
        "evil.pack",
        "precious.txt",
    ]


# ------------------------------------------------------------------------- silent garbage


def _tensor(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["path"] == path)


def _mutations() -> list[tuple[str, Any]]:
    def empty_data(d):
        _tensor(d, "model/w")["data"] = []

    def short_data(d):
        t = _tensor(d, "model/w")
        t["data"][-1][2] -= 4

    def slice_past_chunk(d):
        t = _tensor(d, "model/w")
        t["data"][0][1] += 8192

    def negative_index(d):
        d["tree"]["dict"][0][1]["dict"][0][1] = {"tensor": -1}

    def index_too_big(d):
        d["tree"]["dict"][0][1]["dict"][0][1] = {"tensor": 99}

    def index_twice(d):
        d["tree"]["dict"][0][1]["dict"][1][1] = dict(d["tree"]["dict"][0][1]["dict"][0][1])

    def bool_index(d):
        d["tree"]["dict"][0][1]["dict"][0][1] = {"tensor": True}

    def storage_short(d):
        d["storages"][0]["nbytes"] += 64

    def storage_view_past_end(d):
        next(t for t in d["tensors"] if "storage" in t)["storage"]["offset"] = 4096

    def storage_bad_id(d):
        next(t for t in d["tensors"] if "storage" in t)["storage"]["id"] = 5

    def shard_gap(d):
        _tensor(d, "model/rows")["shards"].pop()

    def shard_overlap(d):
        sh = _tensor(d, "model/rows")["shards"]
        sh[1]["offsets"] = [1, 0]
        sh.append({"offsets": [3, 0], "shape": [1, 256], "data": [[*sh[0]["data"][0][:2], 1024]]})

    def shape_overflow(d):
        _tensor(d, "model/w")["shape"] = [1 << 40, 1 << 40]

    def bad_dtype(d):
        _tensor(d, "model/w")["dtype"] = "evil"

    def string_int(d):
        _tensor(d, "model/w")["shape"] = ["64", 64]

    def huge_chunk(d):
        next(iter(d["chunks"].values()))["size"] = 1 << 40

    def unknown_codec(d):
        next(iter(d["chunks"].values()))["codec"] = "lzma"

    def base_missing(d):
        rec = next(iter(d["chunks"].values()))
        rec["codec"], rec["base"] = "xor", "0" * 32

    def deep_tree(d):
        node: Any = 1
        for _ in range(400):
            node = {"list": [node]}
        d["tree"] = node

    def bad_float(d):
        d["tree"]["dict"][3][1] = {"float": "nan-ish"}

    def bad_base64(d):
        d["tree"]["dict"][6][1] = {"bytes": "!!!"}

    def list_key(d):
        d["tree"]["dict"][2][0] = {"list": [1]}

    def bad_device(d):
        d["tree"]["dict"][2][1] = {"device": "cuda:abc"}

    def name_mismatch(d):
        d["name"] = "s0"

    def not_an_object(d):
        d.clear()
        d.update({"format": "deltackpt.manifest", "version": 2, "hash": "xxh3-128", "tree": 1})

    return [(f.__name__, f) for f in (
        empty_data, short_data, slice_past_chunk, negative_index, index_too_big, index_twice,
        bool_index, storage_short, storage_view_past_end, storage_bad_id, shard_gap, shard_overlap,
        shape_overflow, bad_dtype, string_int, huge_chunk, unknown_codec, base_missing, deep_tree,
        bad_float, bad_base64, list_key, bad_device, name_mismatch, not_an_object,
    )]  # fmt: skip


@pytest.mark.parametrize("depth", [900, 100_000])
def test_deeply_nested_manifests_are_a_typed_error(sandbox, depth):
    store, _ = sandbox
    raw = (store / "snapshots/s1/MANIFEST.json").read_bytes()
    deep = b'{"list":[' * depth + b"1" + b"]}" * depth
    (store / "snapshots/s1/MANIFEST.json").write_bytes(
        raw.replace(b'"tree":', b'"tree":' + deep + b',"x":', 1)
    )
    with pytest.raises(ManifestError):
        deltackpt.load(store, "s1")
    assert deltackpt.verify(store).damaged == ["s1"]


@pytest.mark.parametrize(("what", "mutate"), _mutations(), ids=[n for n, _ in _mutations()])
def test_inconsistent_manifests_with_valid_digests_are_refused(sandbox, what, mutate):
    store, box = sandbox
    doc = read_doc(store, "s1")
    mutate(doc)
    write_doc(store, "s1", doc)
    with confined(store, box) as violations:
        with pytest.raises(ManifestError) as ei:
            deltackpt.load(store, "s1")
        assert ei.value.snapshot == "s1" and ei.value.field
        with pytest.raises(ManifestError):
            deltackpt.load(store, "s1", into=base_state(), strict=False)
        report = deltackpt.verify(store)  # never raises; the rest of the store is checked
        assert report.damaged == ["s1"] and report.snapshots == ["s0"]
        with pytest.warns(DamagedSnapshotWarning):
            assert [s.name for s in deltackpt.snapshots(store)] == ["s0"]
        with pytest.warns(DamagedSnapshotWarning, match="'latest' skips"):
            assert deltackpt.load(store)["step"] == 7  # latest = newest readable
    assert violations == []


def test_huge_sizes_are_refused_before_allocating(sandbox, monkeypatch):
    """Declared sizes must add up; a consistent snapshot larger than the machine's memory is
    refused before anything is allocated."""
    store, _ = sandbox
    doc = read_doc(store, "s0")
    t = _tensor(doc, "model/w")
    t["shape"] = [1 << 40, 64]
    write_doc(store, "s0", doc)
    with pytest.raises(ManifestError, match="holds"):
        deltackpt.load(store, "s0")
    monkeypatch.setattr(loading, "_physical_memory", lambda: 16 << 10)
    with pytest.raises(InsufficientMemoryError, match="more than this machine"):
        deltackpt.load(store, "s1")
    assert isinstance(InsufficientMemoryError("x"), MemoryError)


# ------------------------------------------------------------------ load(into=) never silent


def test_strict_false_never_leaves_a_target_silently_unfilled(sandbox):
    store, _ = sandbox
    target = base_state()
    target["model"]["w"] = torch.empty(64, 64, device="meta")
    with pytest.raises(StateMismatchError, match="meta tensor"):
        deltackpt.load(store, "s0", into=target, strict=False)
    target = base_state()
    target["model"]["w"] = 5  # not a tensor
    with pytest.raises(StateMismatchError, match=r"model/w.*target holds a int"):
        deltackpt.load(store, "s0", into=target, strict=False)
    target = base_state()
    target["none"] = torch.zeros(3)  # the snapshot holds None there
    with pytest.raises(StateMismatchError, match="'none': snapshot holds the value None"):
        deltackpt.load(store, "s0", into=target, strict=False)
    # keys only one side has are still skipped with strict=False
    target = base_state()
    target["model"]["extra"] = torch.zeros(2)
    del target["model"]["b"]
    deltackpt.load(store, "s0", into=target, strict=False)
    assert torch.equal(target["model"]["w"], base_state()["model"]["w"])


# -------------------------------------------------------------------------- damage is local


def test_one_bad_manifest_does_not_take_the_store_down(sandbox, capsys):
    store, _ = sandbox
    (store / "snapshots/s1/MANIFEST.json").write_bytes(b"{not json")
    with pytest.warns(DamagedSnapshotWarning, match="s1"):
        assert [s.name for s in deltackpt.snapshots(store)] == ["s0"]
    with pytest.warns(DamagedSnapshotWarning):
        assert deltackpt.load(store)["step"] == 7
    assert cli(["ls", str(store)]) == 0
    out = capsys.readouterr()
    assert "s0" in out.out and "damaged" in out.err and "s1" in out.err
    assert cli(["verify", str(store)]) == 1
    assert "1 damaged snapshot" in capsys.readouterr().out
    report = deltackpt.verify(store, ["s1"])
    assert report.damaged == ["s1"]
    with pytest.raises(SnapshotNotFoundError):
        deltackpt.verify(store, ["nope"])
    # a damaged snapshot can be deleted; then gc collects again
    deltackpt.delete(store, "s1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [s.name for s in deltackpt.snapshots(store)] == ["s0"]
    assert deltackpt.gc(store).damaged == []
    assert deltackpt.verify(store).ok


@pytest.mark.parametrize("version", [None, "2", 2.0, 3])
def test_a_manifest_version_it_cannot_read_does_not_take_the_store_down(sandbox, version):
    """A version that is no integer is damage (ManifestError); a newer integer is a newer
    writer's format (StoreFormatError, upgrade). Either way one snapshot is unreadable: the
    store lists, verifies and loads the others, and gc removes no pack it may need (found by
    the hostile-manifest fuzzer at 1000 examples: ``version: null`` made gc raise)."""
    store, _ = sandbox
    doc = read_doc(store, "s1")
    doc["version"] = version
    write_doc(store, "s1", doc)
    packs = sorted(p.name for p in (store / "packs").iterdir())
    want = ManifestError if type(version) is not int else StoreFormatError
    with pytest.raises(want, match=r"s1.*manifest version") as e:
        deltackpt.load(store, "s1")
    assert ("damaged" in str(e.value)) == (want is ManifestError)
    assert ("Upgrade" in str(e.value)) == (want is StoreFormatError)
    with pytest.warns(DamagedSnapshotWarning, match="s1"):
        assert [s.name for s in deltackpt.snapshots(store)] == ["s0"]
    with pytest.warns(DamagedSnapshotWarning):
        assert deltackpt.load(store)["step"] == 7
    report = deltackpt.verify(store)
    assert report.damaged == ["s1"] and not report.ok
    assert deltackpt.verify(store, ["s1"]).damaged == ["s1"]
    assert deltackpt.gc(store).damaged == ["s1"]
    assert sorted(p.name for p in (store / "packs").iterdir()) == packs


def test_a_damaged_chunk_shared_by_many_snapshots_is_reported_once(tmp_path):
    store = tmp_path / "s"
    frozen = torch.randn(1 << 18)
    for i in range(12):
        deltackpt.save({"frozen": frozen, "i": torch.tensor(i)}, store, f"s{i:02d}")
    st_ = deltackpt.open_store(store)
    m = st_.manifest("s00")
    d = _tensor_entry(m, "frozen").data[0][0]
    rec = m.chunks[d]
    with open(st_.pack_path(rec.pack), "r+b") as f:
        f.seek(rec.offset + 10)
        f.write(b"\xff\xfe")
    report = deltackpt.verify(store)
    (p,) = report.problems
    assert p.chunk == d and len(p.snapshots) == 12 and p.keys == ("frozen",)


def _tensor_entry(m, path):
    return next(e for e in m.tensors if e.path == path)


# ------------------------------------------------------------------ fuzzing (valid digests)

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from(
        ["", "..", "../../elsewhere/evil", "/etc/passwd", "0" * 32, "float32", "xor", "tensor"]
    ) | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["tensor", "dict", "list", "data", "shape", "pack", "base", "x"]), inner, max_size=3
    ),
    max_leaves=8,
)  # fmt: skip


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple, op: str, value: Any) -> Any:
    if not path:
        return value if op == "set" else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "set":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "int" and type(parent[key]) is int:
        parent[key] = parent[key] + (value if type(value) is int else 1)
    elif op == "dup" and isinstance(parent, list):
        parent.append(parent[key])
    return doc


_TEMPLATE_DOCS: dict[str, Any] = {}


# CI runs 150 examples; benchmarks/reliability.py runs more (DELTACKPT_FUZZ_EXAMPLES)
FUZZ_EXAMPLES = int(os.environ.get("DELTACKPT_FUZZ_EXAMPLES", "150"))


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_manifests_with_valid_digests_never_escape(sandbox, data):
    """Random edits of a real manifest, re-digested: every outcome is a loaded state whose
    chunks verified, or a deltackpt error; never another exception, a file outside the store,
    or a hang."""
    store, box = sandbox
    if "s1" not in _TEMPLATE_DOCS:
        _TEMPLATE_DOCS["s1"] = read_doc(store, "s1")
    doc = json.loads(json.dumps(_TEMPLATE_DOCS["s1"]))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(["set", "set", "int", "delete", "dup"]))
        value = data.draw(_JSON)
        with contextlib.suppress(KeyError, IndexError, TypeError):
            doc = _mutate(doc, path, op, value)
    write_doc(store, "s1", doc)
    with confined(store, box) as violations:
        for call in (
            lambda: deltackpt.load(store, "s1"),
            lambda: deltackpt.load(store, "s1", into=base_state(), strict=False),
            lambda: deltackpt.verify(store),
            lambda: deltackpt.snapshots(store),
        ):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    call()
            except DeltackptError:
                pass
        deltackpt.gc(store)
    assert violations == []
    assert deltackpt.load(store, "s0")["step"] == 7  # the other snapshot is untouched


_RSS_CHILD = r"""
import json, resource, sys, warnings
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import deltackpt
from deltackpt.errors import DeltackptError
from tests.store.test_hostile import make_store, read_doc, write_doc, _tensor
store = make_store(Path(sys.argv[2]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
doc = read_doc(store, "s1")
bad = 0
for i, rows in enumerate([1 << 20, 1 << 30, 1 << 40, 1 << 50]):
    d = json.loads(json.dumps(doc))
    t = _tensor(d, "model/w")
    t["shape"] = [rows, 64]
    write_doc(store, "s1", d)
    d2 = json.loads(json.dumps(doc))
    d2["storages"][0]["nbytes"] = rows
    write_doc(store, "s0", d2 | {"name": "s0"})
    for name in ("s1", "s0"):
        try:
            deltackpt.load(store, name)
        except DeltackptError:
            bad += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deltackpt.verify(store)
print(json.dumps({"base_kib": base, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "refused": bad}))
"""


def test_peak_memory_stays_bounded_on_hostile_sizes(tmp_path):
    """Declared sizes up to 2**50 rows: refused before allocating (peak RSS grows < 64 MiB)."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(root), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["refused"] == 8
    assert r["peak_kib"] - r["base_kib"] < 64 * 1024, r
