"""Checkpoints of CUDA state, side by side with torch.save and DCP, with the limits of the
machine measured in the same run (issue 35's table).

State: ``{"model": fp32 params, "optim": AdamW.state_dict()}`` of a stack of Linear layers on
the device (``--gb`` of state in all, 3x the parameters). A "step" is one real AdamW step with
fresh gradients (every element changes); a "sparse step" changes one tensor.

Rows (every save fsyncs; torch.save is followed by an fsync):

* limits: pinned device-to-host copy, pageable ``.cpu()``, pinned host-to-device copy,
  write+fsync of the state's bytes, device fingerprints (format/fingerprint.py);
* ``torch.save`` of the state, ``dcp.save`` (one-rank gloo group);
* ``deltackpt.save``: first (cold), nothing changed, after a step, after a sparse step;
* ``deltackpt.async_save``: blocking of the first and of a warm one (after a step);
* ``load(into=)`` the state's own CUDA tensors, warm and cold (page cache dropped: on CUDA
  only, as root; skipped otherwise), vs ``dcp.load``; ``Checkpointer.restore_latest`` warm;
  ``load(since=)`` of the sparse step into a device copy of the state before it;
* the DCP plug-in (``StoreWriter`` / ``StoreReader``): ``dcp.save`` unchanged and after a step,
  ``dcp.load`` warm, vs DCP's own files.

Without CUDA it runs the same rows on CPU tensors with the device path forced
(``DELTACKPT_DEVICE_SCAN=always``), as a check that the script works, not as figures.

    python benchmarks/bench_gpu.py --gb 2.4 --out $OUT       # on one GPU, ~3 min
    python benchmarks/bench_gpu.py --gb 0.05                 # here, a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
import torch
from _harness.files import drop_caches

import deltackpt
from deltackpt.options import overrides

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def clock(fn: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def build(gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096 if gb >= 1 else 512
    layers = max(1, int(gb * 1e9 / 3 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step(model, opt)  # the optimizer state exists from here on
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def limits(tensors: list[torch.Tensor], work: Path) -> dict[str, float]:
    n = sum(t.numel() * t.element_size() for t in tensors)
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    pinned = [torch.empty_like(f, device="cpu", pin_memory=DEV.type == "cuda") for f in flat]
    out: dict[str, float] = {"state_gb": n / 1e9}

    def d2h() -> None:
        for dst, src in zip(pinned, flat, strict=True):
            dst.copy_(src, non_blocking=True)

    def h2d() -> None:
        for dst, src in zip(flat, pinned, strict=True):
            dst.copy_(src, non_blocking=True)

    d2h()
    out["pinned_d2h_s"] = min(clock(d2h) for _ in range(3))
    out["pageable_cpu_s"] = clock(lambda: [f.cpu() for f in flat])
    out["pinned_h2d_s"] = min(clock(h2d) for _ in range(3))
    path = work / "limit.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for p in pinned:
            f.write(p.numpy().data)
        f.flush()
        os.fsync(f.fileno())
    out["write_fsync_s"] = time.perf_counter() - t0
    path.unlink()
    from deltackpt.format.fingerprint import source_fingerprints

    out["fingerprint_s"] = min(
        clock(lambda: [source_fingerprints(f, 4 << 20) for f in flat]) for _ in range(2)
    )
    out.update(delta_rows(flat))
    out["gb"] = n / 1e9
    return out


def delta_rows(flat: list[torch.Tensor]) -> dict[str, float]:
    """Issue 36's core: the changed elements of bf16 weights after an RL-like step (3% of the
    elements), found on the device (format/device_changes.py) vs pulled to the host and diffed
    there (format/changes.py), on up to 1 GB of the state as bf16."""
    from deltackpt.format.changes import changed_elements
    from deltackpt.format.device_changes import changed_elements_on

    # the fp32 tensors on the device (AdamW's "step" counts stay on the host)
    on_dev = [f for f in flat if f.device.type == DEV.type and f.numel() % 4 == 0]
    src = torch.cat([f.view(torch.float32).reshape(-1) for f in on_dev])[: 1 << 29]
    base = src.to(torch.bfloat16)
    new = base.clone()
    g = torch.Generator(device=new.device).manual_seed(0)
    mask = torch.rand(new.shape, generator=g, device=new.device) < 0.03
    new[mask] += 0.01
    nb, bb = new.view(torch.uint8), base.view(torch.uint8)
    cap = new.numel()
    dev = min(clock(lambda: changed_elements_on(nb, bb, 2, cap)) for _ in range(3))

    def host() -> None:
        changed_elements(nb.cpu().numpy(), bb.cpu().numpy(), 2, cap)

    return {"delta_gb": nb.numel() / 1e9, "delta_on_device_s": dev, "delta_via_host_s": clock(host)}


def run(gb: float, work: Path) -> dict[str, Any]:
    model, opt = build(gb)
    state = state_of(model, opt)
    tensors = [t for t in C.flat_tensors(state).values() if t.is_floating_point()]
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"}
    res["limits"] = lim = limits(tensors, work)
    C_log(f"limits {lim}")

    def torch_save() -> None:
        p = work / "torch.pt"
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    res["torch_save_s"] = clock(torch_save)
    res["dcp_save_s"], res["dcp_load_s"] = dcp_rows(state, work)
    res["plugin"] = plugin_rows(model, opt, work)
    C_log(f"DCP plug-in {res['plugin']}")
    state = state_of(model, opt)
    store = deltackpt.open_store(work / "dk")
    rows: dict[str, float] = {}
    rows["first"] = clock(lambda: deltackpt.save(state, store, "s0"))
    rows["unchanged"] = min(
        clock(lambda n=n: deltackpt.save(state, store, f"u{n}")) for n in range(2)
    )
    step(model, opt)
    rows["after_step"] = clock(lambda: deltackpt.save(state, store, "s1"))
    held = C.map_tensors(state, torch.clone)  # a follower's copy of s1, on the device
    with torch.no_grad():
        next(iter(model.parameters())).add_(1e-3)
    rows["sparse_step"] = clock(lambda: deltackpt.save(state, store, "s2"))
    # host buffers the sync saves keep for the next one (a ring is transient; group chunks' small
    # sources stay): was a pinned copy of the state
    from deltackpt.saving.engine import saver_for

    rows["kept_mb"] = saver_for(store)._arenas[0].nbytes() / 1e6
    res["save"] = rows
    # catch-up s1 -> s2 into the device copy: only the changed tensor's chunks are read
    res["since_s"] = clock(lambda: deltackpt.load(store, "s2", into=held, since="s1"))
    held.clear()  # the device copy is freed before the async rows
    res["async"] = async_rows(model, opt, work)
    res["load_into_warm_s"] = min(
        clock(lambda: deltackpt.load(store, "s2", into=state)) for _ in range(2)
    )
    res["restore_warm_s"] = restore_rows(model, opt, work)
    # cold rows on the device machine only: dropping the page cache of a shared box here would
    # slow everyone else's work
    res["cold"] = cold_rows(state, store, work) if DEV.type == "cuda" else None
    return res


def read_all(root: Path) -> int:
    """Read every file under ``root`` in 64 MiB reads, 4 files at a time (the cold read limit
    of the disk the store lies on); returns the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    def one(f: str) -> int:
        buf, n = bytearray(64 << 20), 0
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
        return n

    files = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]
    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, files))


def read_all_deep(root: Path, threads: int = 16, block: int = 8 << 20) -> int:
    """Read every file under ``root`` in ``block``-byte preads at every offset, ``threads`` at a
    time, within files as well as across them (a deeper queue than :func:`read_all`'s one
    stream per file: whether the disk gives more to more readers); returns the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    files = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]
    jobs = [(f, o) for f in files for o in range(0, os.path.getsize(f), block)]

    def one(job: tuple[str, int]) -> int:
        fd = os.open(job[0], os.O_RDONLY)
        try:
            return os.preadv(fd, [bytearray(block)], job[1])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, jobs))


def cold_rows(state: dict[str, Any], store: Any, work: Path) -> dict[str, float] | None:
    """``load(into=)`` and ``dcp.load`` (of the checkpoint dcp_rows wrote) from a cold page
    cache, each after dropping it."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, fn in (
        ("load_into_cold_s", lambda: deltackpt.load(store, "s2", into=state)),
        ("dcp_load_cold_s", lambda: dcp.load(state, checkpoint_id=str(work / "dcp"))),
        ("raw_read_cold_s", lambda: out.__setitem__("raw_read_bytes", read_all(work / "dk"))),
        # is there more to read with more readers? (for the goal: the rows above run at ~0.9
        # of the read limit with 4 threads, default_threads' cap)
        ("raw_read_deep_cold_s", lambda: read_all_deep(work / "dk")),
        ("load_into_cold_t16_s", lambda: deltackpt.load(store, "s2", into=state, threads=16)),
    ):
        if not drop_caches():
            C_log("cold rows skipped: cannot drop the page cache here (needs root)")
            return None
        out[name] = clock(fn)
    return out


def async_rows(model: torch.nn.Module, opt: torch.optim.Optimizer, work: Path) -> dict[str, float]:
    store = deltackpt.open_store(work / "dk-async")
    state = state_of(model, opt)
    out = {}
    for i in range(3):
        t0 = time.perf_counter()
        h = deltackpt.async_save(state, store, f"a{i}")
        h.staged.result()
        out[f"blocking_{i}"] = time.perf_counter() - t0
        h.result()
        step(model, opt)
    return out


def dcp_rows(state: dict[str, Any], work: Path) -> tuple[float, float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{C.free_port()}", rank=0, world_size=1
        )
    path = str(work / "dcp")

    def save() -> None:
        dcp.save(state, checkpoint_id=path)
        fsync_tree(path)

    s = clock(save)
    load = min(clock(lambda: dcp.load(state, checkpoint_id=path)) for _ in range(2))
    return s, load


def plugin_rows(model: torch.nn.Module, opt: torch.optim.Optimizer, work: Path) -> dict[str, float]:
    """The DCP plug-in (``StoreWriter`` / ``StoreReader``) on the same state: ``dcp.save`` the
    first time, unchanged, after a step; ``dcp.load`` warm (the process group of dcp_rows)."""
    import torch.distributed.checkpoint as dcp

    from deltackpt.dcp import StoreReader, StoreWriter

    store = deltackpt.open_store(work / "dk-dcp")
    state = state_of(model, opt)

    def save(name: str) -> float:
        return clock(lambda: dcp.save(state, storage_writer=StoreWriter(store, name)))

    out = {"first": save("p0"), "unchanged": save("p1")}
    step(model, opt)
    state = state_of(model, opt)
    out["after_step"] = save("p2")
    out["load_warm"] = min(
        clock(lambda: dcp.load(state, storage_reader=StoreReader(store, "p2"))) for _ in range(2)
    )
    return out


def restore_rows(model: torch.nn.Module, opt: torch.optim.Optimizer, work: Path) -> float:
    """``Checkpointer.restore_latest`` into the live model and optimizer (warm): the resume
    path, which reads into the live tensors (``load_reusing``)."""
    live = {"model": model, "optim": opt}
    ck = deltackpt.Checkpointer(work / "dk-ckpt", every=1, rng=False)
    ck.save(0, live)
    ck.wait()
    t = min(clock(lambda: ck.restore_latest(live)) for _ in range(2))
    ck.close()
    return t


def C_log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def report(res: dict[str, Any]) -> str:
    lim, sv, a, pl = res["limits"], res["save"], res["async"], res["plugin"]
    gb = lim["gb"]
    rows = [
        [
            "unchanged save",
            f"{sv['unchanged']:.3f} s",
            f"{sv['unchanged'] / res['torch_save_s']:.3f}x torch.save",
            "<= 0.05x",
        ],
        [
            "save after a step",
            f"{gb / sv['after_step']:.2f} GB/s",
            f"{(gb / sv['after_step']) / (gb / lim['write_fsync_s']):.2f} of write+fsync",
            ">= 0.8",
        ],
        [
            "host buffers kept after sync saves",
            f"{sv.get('kept_mb', float('nan')):.1f} MB",
            f"{sv.get('kept_mb', float('nan')) / 1e3 / gb:.4f}x the state",
            "tens of MiB",
        ],
        [
            "save after a sparse step",
            f"{sv['sparse_step']:.3f} s",
            f"{sv['sparse_step'] / res['torch_save_s']:.3f}x torch.save",
            "-",
        ],
        [
            "first save",
            f"{sv['first']:.2f} s",
            f"{sv['first'] / res['torch_save_s']:.2f}x torch.save",
            "-",
        ],
        [
            "load(into=) warm",
            f"{res['load_into_warm_s']:.3f} s",
            f"{res['load_into_warm_s'] / res['dcp_load_s']:.2f}x dcp.load",
            "<= 0.2x",
        ],
        [
            "load(since=) after a sparse step, into the device",
            f"{res['since_s']:.3f} s",
            f"{res['since_s'] / res['load_into_warm_s']:.2f}x load(into=) warm",
            "-",
        ],
        [
            "Checkpointer.restore_latest warm",
            f"{res['restore_warm_s']:.3f} s",
            f"{res['restore_warm_s'] / res['dcp_load_s']:.2f}x dcp.load",
            "-",
        ],
        [
            "load(into=) cold",
            "-" if res["cold"] is None else f"{res['cold']['load_into_cold_s']:.3f} s",
            "-"
            if res["cold"] is None
            else f"{res['cold']['load_into_cold_s'] / res['cold']['dcp_load_cold_s']:.2f}x "
            "dcp.load cold",
            "<= 0.6x",
        ],
        [
            "cold read of the store's files (limit)",
            "-"
            if res["cold"] is None
            else f"{res['cold']['raw_read_bytes'] / res['cold']['raw_read_cold_s'] / 1e9:.2f} GB/s",
            "-",
            "-",
        ],
        [
            "  ... 16 readers at 8 MiB offsets (deeper queue) / load(into=) cold, 16 threads",
            "-"
            if res["cold"] is None
            else f"{res['cold']['raw_read_bytes'] / res['cold']['raw_read_deep_cold_s'] / 1e9:.2f}"
            f" GB/s / {res['cold']['load_into_cold_t16_s']:.3f} s",
            "-"
            if res["cold"] is None
            else f"{res['cold']['load_into_cold_t16_s'] / res['cold']['dcp_load_cold_s']:.2f}x "
            "dcp.load cold",
            "-",
        ],
        ["first async_save blocking", f"{a['blocking_0']:.3f} s", "-", "<= 0.1 s"],
        [
            "warm async_save blocking",
            f"{a['blocking_2']:.3f} s",
            f"{a['blocking_2'] / lim['pinned_d2h_s']:.2f}x pinned D2H",
            "keep",
        ],
        [
            "DCP plug-in: dcp.save unchanged",
            f"{pl['unchanged']:.3f} s",
            f"{pl['unchanged'] / res['dcp_save_s']:.3f}x dcp.save",
            "-",
        ],
        [
            "DCP plug-in: dcp.save after a step",
            f"{gb / pl['after_step']:.2f} GB/s",
            f"{(gb / pl['after_step']) / (gb / lim['write_fsync_s']):.2f} of write+fsync, "
            f"{pl['after_step'] / res['dcp_save_s']:.2f}x dcp.save",
            "-",
        ],
        [
            "DCP plug-in: dcp.load warm",
            f"{pl['load_warm']:.3f} s",
            f"{pl['load_warm'] / res['dcp_load_s']:.2f}x dcp.load",
            "-",
        ],
        [
            "find an RL step's change (3%, bf16)",
            f"{lim['delta_on_device_s']:.4f} s for {lim['delta_gb']:.2f} GB",
            f"{lim['delta_on_device_s'] / lim['delta_via_host_s']:.3f}x via the host",
            "issue 36",
        ],
    ]
    head = (
        f"device {res['device']}, state {gb:.2f} GB; limits: pinned D2H {gb / lim['pinned_d2h_s']:.1f} GB/s, "
        f"pageable .cpu() {gb / lim['pageable_cpu_s']:.2f} GB/s, pinned H2D {gb / lim['pinned_h2d_s']:.1f} GB/s, "
        f"write+fsync {gb / lim['write_fsync_s']:.2f} GB/s, fingerprints {gb / lim['fingerprint_s']:.1f} GB/s; "
        f"torch.save {res['torch_save_s']:.2f} s, dcp.save {res['dcp_save_s']:.2f} s, dcp.load {res['dcp_load_s']:.2f} s\n\n"
    )
    return head + C.md_table(["figure", "deltackpt", "ratio", "goal"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gb", type=float, default=2.4 if DEV.type == "cuda" else 0.05)
    ap.add_argument("--out", default=str(C.OUT_DIR))
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    knobs = {} if DEV.type == "cuda" else {"DELTACKPT_DEVICE_SCAN": "always"}
    with overrides(**knobs):
        res = run(args.gb, work)
    res["machine"] = C.machine_info()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    text = report(res)
    (out / "bench_gpu.md").write_text(text + "\n")
    print(text)
    C.rmtree(work)


if __name__ == "__main__":
    main()
