"""What a vLLM worker's reload hands ``load_weights`` (``deltackpt/integrations/vllm/feed.py``):
the held tensors moved to the parameters' device in windows through the pinned buffers, or
before the pause for a staged round. No vLLM needed: the CPU cases move host tensors to the
host (``feed.ON_HOST``: a copy each, the same code a GPU worker runs); the ``gpu`` cases move
them to a GPU."""

from __future__ import annotations

import pytest
import torch

from deltackpt import cuda
from deltackpt.integrations.vllm import feed

CUDA = torch.cuda.is_available()


def _held(n: int = 6, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        out[f"model.layers.{i // 2}.w{i % 2}"] = torch.randn(rows, 32, generator=g).bfloat16()
    out["model.norm.weight"] = torch.randn(32, generator=g).bfloat16()
    return out


@pytest.fixture
def on_host(monkeypatch):
    monkeypatch.setattr(feed, "ON_HOST", True)


def test_reload_batch_is_every_tensor_of_each_touched_layer_in_order():
    held = _held()
    new = torch.zeros(64, 32, dtype=torch.bfloat16)
    batch = feed.reload_batch(held, [("model.layers.1.w0", new), ("model.extra.0.x", new)])
    assert [n for n, _ in batch] == ["model.layers.1.w0", "model.layers.1.w1", "model.extra.0.x"]
    assert batch[0][1] is new and batch[1][1] is held["model.layers.1.w1"]
    assert held["model.layers.1.w0"] is not new  # held itself is not updated here
    outside = feed.reload_batch(held, [("model.norm.weight", held["model.norm.weight"])])
    assert [n for n, _ in outside] == ["model.norm.weight"]
    assert feed.layer_key("model.layers.12.mlp.up_proj.weight") == "model.layers.12"


def test_host_parameters_get_the_held_tensors_themselves():
    held = _held()
    cpu = torch.device("cpu")
    for device in (cpu, None):
        out = list(feed.feed(list(held.items()), device))
        assert [n for n, _ in out] == list(held)
        assert all(t is held[n] for n, t in out)


def test_tensors_cross_in_windows_in_order_and_bit_exact(on_host, monkeypatch):
    held = _held(n=8)
    one = next(iter(held.values())).numel() * 2  # bytes of each layer tensor
    events: list[tuple[str, object]] = []
    moved = feed._moved

    def spy(items, device, nbytes):
        events.append(("move", len(items)))
        return moved(items, device, nbytes)

    monkeypatch.setattr(feed, "_moved", spy)
    out = []
    for name, t in feed.feed(list(held.items()), torch.device("cpu"), window=3 * one):
        events.append(("yield", name))
        out.append((name, t))
    assert [n for n, _ in out] == list(held)
    for name, t in out:
        assert t is not held[name] and torch.equal(
            t.view(torch.int16), held[name].view(torch.int16)
        )
    moves = [e[1] for e in events if e[0] == "move"]
    assert moves == [3, 3, 3]  # 9 tensors (8 + the norm) in windows of 3 tensors' bytes
    # a window crosses only once the one before it was handed out (memory: a window at a time)
    first = [i for i, e in enumerate(events) if e[0] == "move"]
    assert [sum(1 for e in events[:i] if e[0] == "yield") for i in first] == [0, 3, 6]


def test_boxed_tensors_stay_on_the_host_and_no_room_moves_nothing(on_host, monkeypatch):
    held = _held(n=4)
    boxed = "model.layers.0.w1"

    def expand(name, t):
        return t.repeat(2, 1) if name == boxed else t

    out = dict(feed.feed(list(held.items()), torch.device("cpu"), expand))
    assert out[boxed].shape == (128, 32)  # the loader's full-shape view, not moved
    assert all(out[n] is not held[n] for n in held if n != boxed)
    monkeypatch.setattr(cuda, "spare_room", lambda device, nbytes: False)
    out = dict(feed.feed(list(held.items()), torch.device("cpu")))
    assert all(out[n] is held[n] for n in held)  # the loader copies them, as before


def test_a_staged_reload_moved_ahead_is_used_once_and_only_for_its_own_tensor(on_host):
    held = _held(n=4)
    batch = list(held.items())
    early = feed.ahead(batch, torch.device("cpu"))
    assert set(early.moved) == set(held)
    assert early.device_bytes == sum(t.numel() * 2 for t in held.values())
    copies = {n: d for n, (_, d) in early.moved.items()}
    # a rollback hands another tensor under the same name: moved anew, never the early copy
    other = held["model.layers.0.w0"].clone()
    out = dict(feed.feed([("model.layers.0.w0", other), *batch[1:]], torch.device("cpu"),
                         prepared=early))  # fmt: skip
    assert out["model.layers.0.w0"] is not copies["model.layers.0.w0"]
    assert torch.equal(out["model.layers.0.w0"], other)
    assert all(out[n] is copies[n] for n in list(held)[1:])
    assert list(early.moved) == ["model.layers.0.w0"]  # the others were used up
    again = dict(feed.feed(batch, torch.device("cpu"), prepared=early))
    assert again["model.layers.0.w0"] is copies["model.layers.0.w0"]
    assert all(again[n] is not copies[n] for n in list(held)[1:])


def test_ahead_moves_all_or_nothing(on_host, monkeypatch):
    held = _held(n=4)
    batch = list(held.items())
    monkeypatch.setattr(feed, "AHEAD_MAX", sum(t.numel() * 2 for t in held.values()) - 1)
    assert feed.ahead(batch, torch.device("cpu")).moved == {}  # over the cap
    monkeypatch.setattr(feed, "AHEAD_MAX", 1 << 40)
    monkeypatch.setattr(cuda, "serving_room", lambda device, nbytes: False)
    assert feed.ahead(batch, torch.device("cpu")).moved == {}  # no room beside the engine
    monkeypatch.undo()
    assert feed.ahead(batch, torch.device("cpu")).moved == {}  # host parameters: nothing


def test_an_allocation_that_fails_despite_room_moves_nothing(on_host, monkeypatch):
    """The device said it had room (``cuda.spare_room`` counts what torch's allocator holds
    unused, some of which a new block cannot take: a CUDA graph's pool), but the allocation
    fails: the reload hands the host tensors as before, and a staged round moves nothing ahead,
    instead of failing the commit."""
    held = _held(n=4)
    batch = list(held.items())
    empty = torch.empty

    def no_memory(*args, **kwargs):
        if "device" in kwargs:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(cuda, "spare_room", lambda device, nbytes: True)
    monkeypatch.setattr(cuda, "serving_room", lambda device, nbytes: True)
    monkeypatch.setattr(torch, "empty", no_memory)
    assert feed.ahead(batch, torch.device("cpu")).moved == {}
    out = dict(feed.feed(batch, torch.device("cpu")))
    assert all(out[n] is held[n] for n in held)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_reload_onto_the_gpu_gets_device_tensors_a_window_at_a_time():
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    held = {
        f"model.layers.{i}.w": torch.randn(1024, 1024, generator=g).bfloat16() for i in range(12)
    }
    one = 1024 * 1024 * 2
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    params = {n: torch.empty_like(t, device=dev) for n, t in held.items()}
    for name, t in feed.feed(list(held.items()), dev, window=3 * one):
        assert t.device == dev
        params[name].copy_(t)  # what vLLM's weight loader does with it, then drops it
        del t
    torch.cuda.synchronize(dev)
    for name, t in held.items():
        assert torch.equal(params[name].cpu().view(torch.int16), t.view(torch.int16))
    extra = torch.cuda.max_memory_allocated(dev) - base - 12 * one
    assert extra <= 4 * one, f"{extra} bytes beside the parameters: more than a window"
    early = feed.ahead(list(held.items()), dev)
    assert all(d.device == dev for _, d in early.moved.values())
    assert early.device_bytes == 12 * one
    out = dict(feed.feed(list(held.items()), dev, prepared=early))
    assert all(torch.equal(out[n].cpu(), held[n]) for n in held)
    pinned = held["model.layers.0.w"].pin_memory()  # copied at the link's speed as it is
    assert dict(feed.feed([("p", pinned)], dev))["p"] is pinned
