"""LoRA adapters from the store into vLLM (``deltackpt/integrations/vllm/lora.py``).

The driver side (``add_lora``'s checks before the engine is asked, the rollback when a worker
fails, the adapter path) runs here with a stand-in engine: no vLLM needed. The real CPU engine
runs ``_vllm_lora.py`` in the vLLM environment."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, SnapshotNotFoundError, StateKeyError
from deltackpt.integrations.vllm.lora import AdapterSource, add_lora, remove_lora
from deltackpt.sync.errors import AdapterStageError, SyncError
from tests.integrations._vllm_env import real, run_script

CFG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.default.weight"


def _state() -> dict[str, torch.Tensor]:
    return {KEY.format("A"): torch.randn(4, 8), KEY.format("B"): torch.randn(8, 4)}


def _store(tmp_path: Path) -> str:
    store = str(tmp_path / "store")
    deltackpt.save({"model": _state()}, store, "v1", metadata={"peft_config": CFG})
    deltackpt.save({"model": _state()}, store, "bare")  # no LoRA config
    return store


class Engine:
    """Records the collective RPCs; answers from ``answers`` (one dict per worker)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers, self.calls = answers, []

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append((method, kwargs))
        if method == "deltackpt_lora_remove":
            return [{"removed": a.get("added", False)} for a in self.answers]
        return self.answers


def test_the_adapter_path_names_one_version_and_parses_back() -> None:
    src = AdapterSource("s3://bucket/run", "step-100", "default", "model")
    assert AdapterSource.parse(src.path) == src
    assert src.path.startswith("deltackpt-lora:")
    assert src.default_id == AdapterSource.parse(src.path).default_id  # type: ignore[union-attr]
    assert 1 << 30 <= src.default_id < 1 << 31
    assert src.default_id != AdapterSource("s3://bucket/run", "step-200").default_id
    assert AdapterSource.parse("/adapters/step-100") is None  # a directory: vLLM's own loader
    for bad in ("deltackpt-lora:{", 'deltackpt-lora:{"store": 1, "snapshot": "a"}'):
        with pytest.raises(InvalidArgumentError, match="lora_path="):
            AdapterSource.parse(bad)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"snapshot": "bare"}, InvalidArgumentError, "no LoRA config"),
        ({"snapshot": "nope"}, SnapshotNotFoundError, "nope"),
        ({"adapter_name": "other"}, StateKeyError, "adapter 'other'"),
        ({"adapter_name": "a.b"}, InvalidArgumentError, "adapter_name="),
        ({"key": "optim"}, StateKeyError, "key 'optim'"),
        ({"lora_int_id": 0}, InvalidArgumentError, "lora_int_id=0"),
        ({"lora_int_id": True}, InvalidArgumentError, "lora_int_id=True"),
        ({"lora_name": ""}, InvalidArgumentError, "lora_name="),
    ],
)
def test_bad_arguments_are_refused_before_the_engine_is_asked(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    store, eng = _store(tmp_path), Engine([{"added": True}])
    with pytest.raises(error, match=match):
        add_lora(eng, store, **{"snapshot": "v1", **kw})
    assert eng.calls == []


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("LORA", "config="),  # not a dict at all
        ({**CFG, "r": 0}, "r=0"),
        ({**CFG, "r": True}, "r=True"),
        ({**CFG, "r": "4"}, "r='4'"),
        ({k: v for k, v in CFG.items() if k != "lora_alpha"}, "lora_alpha=None"),
        ({**CFG, "lora_alpha": "8"}, "lora_alpha='8'"),
        ({**CFG, "target_modules": []}, "target_modules=[]"),
        ({**CFG, "target_modules": [1]}, "target_modules=[1]"),
        ({**CFG, "peft_type": "IA3"}, "peft_type='IA3'"),
    ],
)
def test_a_hostile_stored_lora_config_is_refused_before_the_engine_is_asked(
    tmp_path: Path, config: Any, match: str
) -> None:
    """The LoRA config is read from the snapshot's metadata: untrusted, checked field by field
    on the driver, named, before any worker reads a byte for it."""
    store = str(tmp_path / "store")
    deltackpt.save({"model": _state()}, store, "bad", metadata={"peft_config": config})
    eng = Engine([{"added": True}])
    with pytest.raises(InvalidArgumentError, match=re.escape(match)):
        add_lora(eng, store, "bad")
    assert eng.calls == []


def test_a_store_that_is_not_there_is_refused_and_not_made(tmp_path: Path) -> None:
    eng = Engine([{"added": True}])
    with pytest.raises(deltackpt.errors.StoreError):
        add_lora(eng, str(tmp_path / "missing"), "v1")
    assert not (tmp_path / "missing").exists() and eng.calls == []
    with pytest.raises(InvalidArgumentError, match="store="):
        add_lora(eng, 5, "v1")  # type: ignore[arg-type]


def test_a_worker_that_fails_undoes_the_others_and_names_each_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    eng = Engine([{"added": True}, {"error": "ValueError: LoRA rank 4 is greater than 2"}])
    with pytest.raises(AdapterStageError, match=r"1 of 2 worker\(s\).*worker 1: ValueError") as e:
        add_lora(eng, store, "v1", lora_int_id=7)
    assert isinstance(e.value, SyncError)
    ((add, akw), (remove, rkw)) = eng.calls
    path = AdapterSource(store, "v1").path
    assert add == "deltackpt_lora_add" and akw["token"]
    assert {k: v for k, v in akw.items() if k != "token"} == {
        "path": path,
        "lora_int_id": 7,
        "lora_name": "default@v1",
    }
    # only what this call added is dropped: a worker that held the version before keeps it
    assert remove == "deltackpt_lora_remove"
    assert rkw == {"lora_int_id": 7, "only_if_token": akw["token"]}


def test_an_engine_without_the_extension_is_named(tmp_path: Path) -> None:
    class Plain:  # vLLM's answer to an RPC of a method its workers do not have
        def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> Any:
            raise AttributeError(f"'Worker' object has no attribute {method!r}")

    with pytest.raises(AdapterStageError, match="worker_extension_cls=EXTENSION"):
        add_lora(Plain(), _store(tmp_path), "v1")
    eng = Engine(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(AdapterStageError, match="unexpected answer 'not a dict'"):
        add_lora(eng, str(tmp_path / "store"), "v1")


@pytest.fixture
def lora_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for ``vllm.lora.request`` where vLLM is not installed (this environment)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    mod = types.ModuleType("vllm.lora.request")

    @dataclasses.dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str = ""

    mod.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", mod)


def test_latest_is_taken_once_and_storage_options_reach_the_workers(
    tmp_path: Path, lora_request: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    deltackpt.save(
        {"model": {KEY.format("A"): torch.zeros(4, 8), KEY.format("B"): torch.zeros(8, 4)}},
        store,
        "v2",
        metadata={"peft_config": CFG},
    )
    eng = Engine([{"added": True}])
    monkeypatch.chdir(tmp_path)  # a relative directory reaches the workers absolute
    req = add_lora(eng, "store", lora_name="mine")
    assert AdapterSource.parse(req.lora_path) == AdapterSource(store, "v2")
    assert (req.lora_name, req.lora_int_id) == ("mine", AdapterSource(store, "v2").default_id)
    assert "storage_options" not in eng.calls[0][1]
    assert remove_lora(eng, req)
    # an object store's options travel with the call (the workers open it themselves)
    url = "memory://lora-test/run"
    deltackpt.save({"model": _state()}, url, "v1", metadata={"peft_config": CFG})
    opts = {"skip_instance_cache": True}
    add_lora(eng, url, storage_options=opts)
    assert eng.calls[-1][1]["storage_options"] == opts
    # a Store (a Checkpointer's .store): its root, and its options when none are given
    add_lora(eng, deltackpt.open_store(url, storage_options=opts), "v1")
    assert eng.calls[-1][1]["storage_options"] == opts
    assert AdapterSource.parse(eng.calls[-1][1]["path"]) == AdapterSource(url, "v1")
    req = add_lora(eng, deltackpt.open_store(store), "v2")
    assert AdapterSource.parse(req.lora_path) == AdapterSource(store, "v2")


def test_served_versions_are_leased_so_retention_keeps_them(
    tmp_path: Path, lora_request: None
) -> None:
    """vLLM reads an evicted adapter again from its snapshot: add_lora leases what it added
    (renewed by each call), remove_lora gives it up, and retention keeps exactly what is
    leased."""
    from deltackpt.store.leases import scan_leases

    store = str(tmp_path / "store")
    for v in ("v1", "v2", "v3"):
        deltackpt.save({"model": _state()}, store, v, metadata={"peft_config": CFG})
    eng = Engine([{"added": True}])
    r1, r2 = add_lora(eng, store, "v1"), add_lora(eng, store, "v2")
    st = deltackpt.open_store(store)
    (lease,) = scan_leases(st.storage).live
    assert lease.snapshots == ("v1", "v2") and lease.holder.startswith("vllm-lora-")
    deltackpt.gc(store, keep_last=1)
    assert [s.name for s in deltackpt.snapshots(store)] == ["v1", "v2", "v3"]
    remove_lora(eng, r1)
    assert scan_leases(st.storage).live[0].snapshots == ("v2",)
    deltackpt.gc(store, keep_last=1)
    assert [s.name for s in deltackpt.snapshots(store)] == ["v2", "v3"]
    remove_lora(eng, r2)
    assert scan_leases(st.storage).live == []
    # lease_ttl=None: nothing leased; a bad one is refused before the engine is asked
    add_lora(eng, store, "v3", lease_ttl=None)
    assert scan_leases(st.storage).live == []
    calls = len(eng.calls)
    with pytest.raises(InvalidArgumentError, match="lease_ttl=0"):
        add_lora(eng, store, "v3", lease_ttl=0)
    assert len(eng.calls) == calls


def test_remove_lora_reports_whether_a_worker_held_it() -> None:
    class Req:
        lora_int_id = 9

    assert remove_lora(Engine([{"added": False}]), Req()) is False
    assert remove_lora(Engine([{"added": True}, {"added": False}]), Req()) is True


def test_when_imported_runs_after_the_import_or_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's hook on vLLM's worker loader, on a stand-in package: the function runs
    once the module's own code ran, once; a module already imported gets it at once."""
    from deltackpt.integrations.vllm import when_imported

    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loader.py").write_text("class WorkerLoRAManager:\n    value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []
    when_imported("fakepkg.loader", lambda m: seen.append(m.WorkerLoRAManager.value))
    assert seen == []
    import fakepkg.loader  # type: ignore[import-not-found]

    assert seen == [1]
    importlib.reload(fakepkg.loader)
    assert seen == [1]  # one shot
    when_imported("fakepkg.loader", lambda m: seen.append(2))
    assert seen == [1, 2]
    monkeypatch.delitem(sys.modules, "fakepkg.loader")
    monkeypatch.delitem(sys.modules, "fakepkg")


# ---- the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = dict(os.environ)
    amx = str(Path(__file__).with_name("_vllm_amx"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [amx, env.get("PYTHONPATH")]))
    return run_script(tmp_path_factory, "_vllm_lora.py", env=env)


@real
def test_store_adapters_match_vllms_own_directory_load_bit_for_bit(lora_run) -> None:
    r = lora_run
    assert r["names"] == ["default@v1", "default@v2"] and r["ids_differ"]
    s1, s2 = r["store_digests"]
    assert s1 and s1 == r["dir_digests"][0] and s2 == r["dir_digests"][1] and s1 != s2
    t1, t2, d1, d2 = r["tokens"]
    assert t1 == d1 and t2 == d2 and t1 != t2  # side by side in one batch, each its version
    assert r["base"] not in (t1, t2)
    assert r["again"] == [{"added": False, "seconds": 0.0}]  # held already: not read twice
    assert r["wrong_token"] == [{"removed": False}]  # another call's undo leaves it


@real
def test_an_evicted_or_removed_adapter_comes_back_as_its_own_version(lora_run) -> None:
    r = lora_run
    t1, t2 = r["tokens"][:2]
    assert not r["r1_held_after_dirs"]  # two cache places, four adapters: evicted
    assert r["r1_again"] == t1 and r["r1_digests_again"] == r["store_digests"][0]
    assert r["removed"] and not r["r2_held_after_remove"] and r["r2_after_remove"] == t2


@real
def test_refused_adapters_leave_the_held_ones_serving(lora_run) -> None:
    r = lora_run
    for case, match in (
        ("big", "LoRA rank 16 is greater than max_lora_rank 8"),
        ("damaged", "CorruptChunkError: chunk"),
        ("reused_id", "already names deltackpt-lora:"),
        ("dir_id", "lora_int_id=11 already names"),
    ):
        assert r[case]["raised"] == "AdapterStageError", (case, r[case])
        assert match in r[case]["message"], (case, r[case]["message"])
        assert "No worker holds it" in r[case]["message"]
    assert r["after_refusals"] == r["tokens"][:2]
    assert r["r2_digests_after"] == r["store_digests"][1]


@real
def test_vllms_own_add_lora_takes_a_store_path_and_load_inplace(lora_run) -> None:
    """What the server's /v1/load_lora_adapter calls (engine add_lora), with a deltackpt path;
    load_inplace replaces what the id holds (vLLM's meaning), a plain reuse is refused."""
    r = lora_run
    t1, t2 = r["tokens"][:2]
    assert r["own_add"] == t1
    assert r["own_inplace"] == t2 and r["own_digests"] == r["store_digests"][1]


@real
def test_the_resolver_names_saved_versions_for_a_server(lora_run) -> None:
    """DELTACKPT_VLLM_LORA_STORE registers the resolver; "v2" and "default@v1" resolve to their
    versions, "latest", a missing snapshot or adapter and a bad adapter name to nothing (the
    server's 404); the engine loads what it resolved, bit for bit v2."""
    r = lora_run
    assert "deltackpt" in r["resolvers"]
    res = r["resolved"]
    assert '"snapshot":"v2"' in res["v2"] and '"snapshot":"v1"' in res["default@v1"]
    assert res["latest"] is None and res["nope"] is None and res["other@v1"] is None
    assert res["a.b@v1"] is None
    assert r["resolved_tokens"] == r["tokens"][1]
    # what it resolved is leased from retention, newest last (a server may load it again)
    assert r["resolver_leases"] == [["v2", "v1"]]


@real
def test_a_lora_engine_starts_its_base_model_from_a_store(lora_run) -> None:
    # load_format="deltackpt" with enable_lora (vLLM wraps the layers for LoRA): the base's
    # tokens equal vLLM's own load of the same weights from a directory
    assert lora_run["started"]["snapshot"] == "b0"
    assert lora_run["base_as_vllm_loads"]
