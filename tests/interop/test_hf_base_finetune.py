"""A run that starts from a Hugging Face base model: the base imported from what
``save_pretrained`` wrote, a fine-tune saved into the same store shares its frozen bytes."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from tests.interop._hf import batch, tiny

pytest.importorskip("transformers")


def test_fine_tune_writes_only_what_it_trained(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny("llama").save_pretrained(tmp_path / "base")  # the HF layout, as downloaded
    # no small-tensor grouping: each tensor's chunks stand alone, whatever the key order
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=4096, small_bytes=0)
    base = deltackpt.import_checkpoint(tmp_path / "base", store, "base")
    loaded = deltackpt.load(store, "base")["model"]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    for k, t in model.state_dict().items():
        assert torch.equal(loaded[k], t), k
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")  # train the head only
    opt = torch.optim.SGD([model.lm_head.weight], lr=0.1)
    x = batch()
    model(x, labels=x).loss.backward()
    opt.step()

    ft = deltackpt.save({"model": model.state_dict()}, store, "ft")
    head = model.lm_head.weight.nbytes
    assert ft.chunks_reused > 0 and ft.chunks_new == head // 4096
    assert ft.bytes_written < head + (32 << 10) < base.bytes_written
    assert ft.logical_bytes == base.logical_bytes
