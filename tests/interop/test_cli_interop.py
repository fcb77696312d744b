"""``deltackpt export`` and ``deltackpt import`` end to end through ``cli.main.main``."""

from __future__ import annotations

import json

import pytest
import torch

import deltackpt
from deltackpt.cli.main import main

safetensors_torch = pytest.importorskip("safetensors.torch")


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed.weight": torch.randn(40, 16, generator=g),
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": torch.randn(40, 16, generator=g),
    }


def test_export_then_import_round_trips(tmp_path, capsys):
    sd = _sd()
    store = str(tmp_path / "s")
    deltackpt.save({"model": sd, "optim": {"lr": 0.1}}, store, "step-1")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    out = tmp_path / "hf"
    rc = main(["export", store, str(out), "--dtype", "bf16", "--max-shard-size", "1KB",
               "--config", str(cfg), "--json"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["snapshot"] == "step-1" and doc["tensors"] == 3
    assert "model.safetensors.index.json" in doc["files"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # a second export into the same directory needs --overwrite: usage error, nothing replaced
    assert main(["export", store, "step-1", str(out)]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["export", store, "step-1", str(out), "--overwrite"]) == 0
    assert "exported" in capsys.readouterr().out

    rc = main(["import", str(out), store, "imported", "--key", "weights", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["snapshot"] == "imported" and doc["tensors"] == 3
    got = deltackpt.load(store, "imported")["weights"]
    for k, t in sd.items():
        assert torch.equal(got[k], t), k  # the --overwrite export was fp32
    assert main(["import", str(out), store, "again"]) == 0
    assert "already in the store" in capsys.readouterr().out


def test_export_errors_exit_with_their_codes(tmp_path, capsys):
    store = str(tmp_path / "s")
    deltackpt.save({"model": _sd()}, store, "a")
    assert main(["export", store, "a", str(tmp_path / "o"), "--key", "nope"]) == 3
    err = capsys.readouterr().err
    assert "nope" in err and "model" in err
    assert main(["export", store, "missing", str(tmp_path / "o")]) == 3
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    assert main(["import", str(bad), store, "b"]) == 3
    assert "not a valid safetensors file" in capsys.readouterr().err


def test_export_fp8_writes_what_an_fp8_engine_starts_from(tmp_path, capsys):
    g = torch.Generator().manual_seed(4)
    sd = {**_sd(), "model.layers.0.mlp.up_proj.weight": torch.randn(48, 16, generator=g)}
    store = str(tmp_path / "ckpts")
    deltackpt.save({"model": sd}, store, "step-1")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "fp8"
    rc = main(["export", store, str(out), "--fp8", "--config", str(tmp_path / "config.json"),
               "--json"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == 5  # the up projection's scales beside it
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert got["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (1, 1)
    assert got["lm_head.weight"].dtype == torch.float32  # not a decoder layer's projection
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
