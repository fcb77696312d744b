"""The inference pause of a vLLM worker's commit on a GPU (issue 36), without vLLM: what
``deltackpt/integrations/vllm/inplace.py`` does inside the pause, on stand-ins of vLLM's modules
(the class names and attributes its rules read: fused ``qkv_proj`` and ``gate_up_proj``,
``down_proj``, norms) sized like a small Qwen, bf16 parameters on the device, the worker's
held copies on the host, as a GPU worker keeps them. vLLM's GPU build cannot be installed on
the device machine; its CPU build is measured by ``bench_vllm.py``.

An RL-like step (``--share`` of every weight's elements changed) is committed, best of
``--repeats``, each timed from an idle device until the writes landed:

* in place, element writes moved at the commit (a one-call round): the changed elements'
  indices and values gathered from the held copies and moved to the device in one pass through
  two reused pinned buffers, then scattered into the parameters;
* in place, element writes prepared ahead (a staged round: ``inplace.prepare`` ran while the
  engine served, its time beside): the pause only scatters them;
* the same elements the way before 2026-11-28: a pageable, blocking copy of each tensor's
  indices and values;
* in place, whole tensors (``elements`` unknown): through the pinned buffers;
* a reload (the path of a commit that cannot go in place: quantized weights, a first round):
  every tensor of the changed layers handed to a stand-in of ``load_weights`` that copies each
  into its parameter region as vLLM's weight loaders do (``param.data[...].copy_(w)``; vLLM's
  own processing after loading is not in it): host tensors as the worker held them (a blocking
  copy from pageable memory each, as before 2026-11-28), moved through the pinned buffers in
  windows first (``feed.feed``), and moved before the pause (a staged round: ``feed.ahead``,
  its time beside);
* floors in the same run: the changed elements' bytes (an int64 index and a value each) in one
  pinned host-to-device copy, and a device-to-device copy of the changed tensors (the pause if
  the new weights were already on the GPU, as vLLM's own ipc backend loads them: unverified,
  not transactional).

    python benchmarks/bench_gpu_pause.py --out $OUT       # on one GPU, ~1 GB, ~20 s
    python benchmarks/bench_gpu_pause.py                  # here: the CPU dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import _common as C
import torch
from _harness.limits import device_best

from deltackpt.integrations.vllm import feed, inplace

CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
HID, HEADS, KV, HD, FF = 2048, 16, 4, 128, 5632  # a small Qwen's layer
LAYER_BYTES = 2 * ((HEADS + 2 * KV) * HD * HID + 3 * FF * HID + HID)


def _param(*shape: int, dev: torch.device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=BF16, device=dev), requires_grad=False)


class QKVParallelLinear(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = 1, 0
        self.num_heads, self.num_kv_heads = HEADS, KV
        self.total_num_heads, self.total_num_kv_heads = HEADS, KV
        self.num_kv_head_replicas = 1
        self.head_size = self.v_head_size = HD
        self.weight = _param((HEADS + 2 * KV) * HD, HID, dev=dev)


class MergedColumnParallelLinear(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.output_sizes = 1, 0, [FF, FF]
        self.weight = _param(2 * FF, HID, dev=dev)


class RowParallelLinear(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.input_size_per_partition = 1, 0, FF
        self.weight = _param(HID, FF, dev=dev)


class RMSNorm(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.weight = _param(HID, dev=dev)


class Layer(torch.nn.Module):
    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(dev)
        self.gate_up_proj = MergedColumnParallelLinear(dev)
        self.down_proj = RowParallelLinear(dev)
        self.input_layernorm = RMSNorm(dev)


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}  # fmt: skip

    def __init__(self, layers: int, dev: torch.device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(dev) for _ in range(layers)])


def checkpoint(layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (host), as the worker holds them."""
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (HEADS * HD, HID), "k_proj": (KV * HD, HID), "v_proj": (KV * HD, HID),
              "gate_proj": (FF, HID), "up_proj": (FF, HID), "down_proj": (HID, FF)}  # fmt: skip
    out = {}
    for i in range(layers):
        for m, shape in shapes.items():
            out[f"layers.{i}.{m}.weight"] = torch.randn(*shape, generator=g).to(BF16)
        out[f"layers.{i}.input_layernorm.weight"] = torch.randn(HID, generator=g).to(BF16)
    return out


def load(model: Model, held: dict[str, torch.Tensor]) -> None:
    """What vLLM's loaders do at tp 1: q/k/v and gate/up fused along the rows."""
    with torch.no_grad():
        for i, L in enumerate(model.layers):
            p = f"layers.{i}."
            L.qkv_proj.weight.copy_(torch.cat([held[p + f"{x}_proj.weight"] for x in "qkv"]))
            L.gate_up_proj.weight.copy_(
                torch.cat([held[p + "gate_proj.weight"], held[p + "up_proj.weight"]])
            )
            L.down_proj.weight.copy_(held[p + "down_proj.weight"])
            L.input_layernorm.weight.copy_(held[p + "input_layernorm.weight"])


def rl_step(
    held: dict[str, torch.Tensor], share: float
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor | None]]:
    """``share`` of every tensor's elements moved by one bf16 step; their sorted flat indices
    (what ``WeightReceiver.changed_elements`` gives)."""
    g = torch.Generator().manual_seed(1)
    changed, elements = [], {}
    for n, t in held.items():
        new = t.clone()
        idx = torch.nonzero(torch.rand(t.numel(), generator=g) < share).flatten()
        flat = new.view(-1)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(BF16)
        changed.append((n, new))
        elements[n] = idx
    return changed, elements


def pageable_elements(
    slots: dict[str, inplace.Slot],
    changed: list[tuple[str, torch.Tensor]],
    elements: dict[str, torch.Tensor | None],
) -> None:
    """The element writes as they were before 2026-11-28: per tensor a gather on the host,
    then a pageable copy of its int64 indices and its values to the device."""
    with torch.no_grad():
        for name, t in changed:
            s, idx = slots[name], elements[name]
            assert idx is not None
            p = s.param.data
            vals = t.reshape(-1)[idx].to(p.device, non_blocking=True)
            flat = idx.to(p.device, non_blocking=True)
            rem, at = flat, torch.zeros_like(flat)
            dims = zip(reversed(t.shape), reversed(s.dst), reversed(p.stride()), strict=True)
            for size, b, stride in dims:
                at += (rem % size + (b.start or 0)) * stride
                rem = rem // size
            p.view(-1).index_copy_(0, at, vals)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda" if CUDA else "cpu")
    if not CUDA:  # the CPU stand-in: the device paths on host parameters
        inplace.SPARSE_ON_HOST = inplace.BOUNCE_ON_HOST = feed.ON_HOST = True
    layers = max(1, round(args.gb * 1e9 / LAYER_BYTES))
    held = checkpoint(layers)
    model = Model(layers, dev)
    load(model, held)
    slots: dict[str, inplace.Slot] = {}
    inplace.learn(model, held, list(held), {}, {}, slots)
    changed, elements = rl_step(held, args.share)
    writes = [n for n, t in changed if n in slots]
    assert len(writes) == len(changed), f"slots for {len(writes)} of {len(changed)} tensors"
    nbytes = sum(t.numel() * t.element_size() for t in held.values())
    n_el = sum(int(i.numel()) for i in elements.values() if i is not None)
    el_bytes = n_el * (8 + 2)
    r = args.repeats
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(held), "elements": n_el}

    def commit(prepared: inplace.Prepared | None = None, el: Any = elements) -> None:
        inplace.write(slots, dict(held), changed, elements=el, prepared=prepared)

    out["elements_s"] = device_best(lambda: commit(), dev, r)
    prep_s, pause_s = float("inf"), float("inf")
    for _ in range(r):  # prepare off the pause, then the pause
        t0 = time.perf_counter()
        prepared = inplace.prepare(slots, changed, elements)
        if CUDA:
            torch.cuda.synchronize(dev)
        prep_s = min(prep_s, time.perf_counter() - t0)
        out["prepared_bytes"] = prepared.device_bytes  # (the commit uses its writes up)
        pause_s = min(pause_s, device_best(lambda p=prepared: commit(p), dev, 1))
    out["prepare_s"], out["prepared_s"] = prep_s, pause_s
    out["pageable_s"] = device_best(lambda: pageable_elements(slots, changed, elements), dev, r)
    out["whole_s"] = device_best(lambda: commit(el=None), dev, r)
    # a reload: every tensor of the changed layers through a loader's copies
    batch = feed.reload_batch(held, changed)

    def loader(weights: Any) -> None:  # vLLM's weight_loader, at tp 1: a copy into the region
        with torch.no_grad():
            for name, w in weights:
                s = slots[name]
                s.param.data[s.dst].copy_(w)

    out["reload_host_s"] = device_best(lambda: loader(batch), dev, r)
    out["reload_feed_s"] = device_best(lambda: loader(feed.feed(batch, dev)), dev, r)
    ahead_s, reload_s = float("inf"), float("inf")
    for _ in range(r):
        t0 = time.perf_counter()
        early = feed.ahead(batch, dev)
        ahead_s = min(ahead_s, time.perf_counter() - t0)
        out["ahead_bytes"] = early.device_bytes
        reload_s = min(
            reload_s, device_best(lambda e=early: loader(feed.feed(batch, dev, prepared=e)), dev, 1)
        )
    out["ahead_s"], out["reload_ahead_s"] = ahead_s, reload_s
    # exact: the parameters hold the new bytes
    fresh = Model(layers, dev)
    load(fresh, dict(held, **dict(changed)))
    out["exact"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    # floors: the elements' bytes in one pinned copy; the changed tensors device to device
    host = torch.empty(el_bytes, dtype=torch.uint8, pin_memory=CUDA)
    dst = torch.empty(el_bytes, dtype=torch.uint8, device=dev)
    out["pinned_elements_s"] = device_best(lambda: dst.copy_(host, non_blocking=True), dev, r)
    on_dev = [(slots[n].param.data[slots[n].dst], t.to(dev)) for n, t in changed]
    out["d2d_s"] = device_best(lambda: [d.copy_(s) for d, s in on_dev], dev, r)
    return out


def report(s: dict[str, Any], device: str) -> str:
    d2d = s["d2d_s"]
    rows = []
    for key, label in (
        ("elements_s", "in place, element writes moved at the commit (one-call round)"),
        ("prepared_s", "in place, element writes prepared ahead (staged round): the pause"),
        ("prepare_s", "  ... their preparation, off the pause (while the engine serves)"),
        ("pageable_s", "element writes, a pageable copy per tensor (before 2026-11-28)"),
        ("whole_s", "in place, whole tensors through the pinned buffers"),
        ("reload_host_s", "reload, host tensors: the loader copies each (before 2026-11-28)"),
        ("reload_feed_s", "reload, tensors through the pinned buffers in windows (feed)"),
        ("reload_ahead_s", "reload, staged: tensors moved ahead (feed.ahead): the pause"),
        ("ahead_s", "  ... moving them ahead, off the pause (while the engine serves)"),
        ("pinned_elements_s", "floor: the elements' bytes in one pinned H2D copy"),
        ("d2d_s", "floor: the changed tensors device to device (new weights on the GPU)"),
    ):
        rows.append([label, f"{s[key]:.4f} s", f"{s[key] / d2d:.1f}x"])
    head = (
        f"device {device}, {s['bytes'] / 1e9:.2f} GB bf16 in {s['tensors']} tensors, "
        f"{s['elements']} elements changed ({s['elements'] / (s['bytes'] / 2):.1%}); "
        f"prepared on the device: {C.fmt_bytes(s['prepared_bytes'])} (elements), "
        f"{C.fmt_bytes(s['ahead_bytes'])} (a reload's tensors); parameters exact: "
        f"{s['exact']}; best of the repeats\n\n"
    )
    return head + C.md_table(["commit", "time", "vs D2D of the tensors"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gb", type=float, default=1.0 if CUDA else 0.1)
    ap.add_argument("--share", type=float, default=0.03, help="elements an RL step changes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(C.OUT_DIR), help="directory for the JSON and table")
    args = ap.parse_args()
    t0 = time.perf_counter()
    s = measure(args)
    device = torch.cuda.get_device_name() if CUDA else "cpu (dry run: host parameters)"
    doc = {"config": vars(args), "device": device, "summary": s, "machine": C.machine_info()}
    doc["seconds"] = time.perf_counter() - t0
    text = report(s, device)
    path = C.write_results(args.out, "bench_gpu_pause", doc, text)
    print(text)
    print(f"done in {doc['seconds']:.1f} s; {path}")
    if not s["exact"]:
        raise SystemExit("the parameters differ from a load of the new weights")


if __name__ == "__main__":
    main()
