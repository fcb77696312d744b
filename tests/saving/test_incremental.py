"""Only chunks whose bytes changed are written; a real training loop restores at every step."""

from __future__ import annotations

import torch

import deltackpt
from deltackpt.format.codecs import RAW, EncodePolicy

RAW_ONLY = EncodePolicy(codecs=(RAW,))


def _state(n_tensors: int = 20, numel: int = 256 << 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n_tensors)}


def test_unchanged_save_writes_only_metadata(store_dir):
    state = _state()
    first = deltackpt.save(state, store_dir, "a", encoding=RAW_ONLY)
    assert first.bytes_written >= first.logical_bytes
    second = deltackpt.save(state, store_dir, "b", encoding=RAW_ONLY)
    assert second.chunks_new == 0
    assert second.chunks_reused == first.chunks_new
    manifest_size = deltackpt.open_store(store_dir).manifest_path("b").stat().st_size
    assert second.bytes_written == manifest_size
    assert second.bytes_written < 0.01 * first.bytes_written


def test_changing_ten_percent_of_tensors_writes_about_ten_percent(store_dir):
    state = _state()
    full = deltackpt.save(state, store_dir, "a", encoding=RAW_ONLY)
    for i in range(0, 20, 10):  # 2 of 20 tensors
        state[f"layer{i}.weight"].add_(1.0)
    inc = deltackpt.save(state, store_dir, "b", encoding=RAW_ONLY)
    ratio = inc.bytes_written / full.bytes_written
    assert 0.09 <= ratio <= 0.12, ratio
    out = deltackpt.load(store_dir, "b")
    for k, v in state.items():
        assert torch.equal(out[k], v)


def test_identical_tensors_under_different_names_are_stored_once(store_dir):
    t = torch.randn(1 << 20)
    info = deltackpt.save(
        {"a": t, "b": t.clone(), "c": t.clone()}, store_dir, "a", encoding=RAW_ONLY
    )
    assert info.bytes_written < 1.1 * t.numel() * 4
    out = deltackpt.load(store_dir, "a")
    assert torch.equal(out["c"], t)


def test_a_local_change_rewrites_only_the_chunks_it_touches(tmp_path):
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10)
    t = torch.randn(1 << 20)  # 4 MiB = 64 chunks of 64 KiB
    deltackpt.save({"t": t}, store, "a", encoding=RAW_ONLY)
    t[:10] = 0
    info = deltackpt.save({"t": t}, store, "b", encoding=RAW_ONLY)
    assert info.chunks_new == 1 and info.chunks_reused == 63


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(x)))


def test_training_loop_every_snapshot_restores_bit_exactly(store_dir):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = {}
    for step in range(8):
        x = torch.randint(0, 64, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "step": step,
            "rng": torch.get_rng_state(),
        }
        deltackpt.save(state, store_dir, f"step-{step}")
        expected[step] = (
            {k: v.clone() for k, v in model.state_dict().items()},
            torch.get_rng_state(),
        )

    for step, (weights, rng) in expected.items():
        out = deltackpt.load(store_dir, f"step-{step}")
        assert out["step"] == step
        assert torch.equal(out["rng"], rng)
        for k, v in weights.items():
            assert torch.equal(out["model"][k], v), (step, k)

    # Resume into a fresh model + optimizer and continue identically.
    model2 = TinyLM()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    # A fresh optimizer has no state tensors to copy into, so it goes through load_state_dict.
    deltackpt.load(store_dir, into={"model": model2.state_dict()}, strict=False)
    opt2.load_state_dict(deltackpt.load(store_dir)["optim"])
    x = torch.randint(0, 64, (4, 16))
    for m, o in ((model, opt), (model2, opt2)):
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
