"""Host time a sync round spends per tensor: one trainer -> one receiver process, the same bytes
as one tensor and as many small ones, so what the round costs per tensor (Python, torch calls)
stands out from what it costs per byte.

On a GPU a round's device work is milliseconds; the H100 run of issue 36 spent most of a round
on the host (trainer 18 ms, receiver 86 ms of host time against 2.9 and 7.4 ms on the device),
and that work is the same Python here: this benchmark measures it on any machine. Rows, per
link, for ``--tensors`` tensors (default 240, the issue's 8 GB model has 240) and for one tensor
of the same bytes, in the same processes:

* ``unchanged``: nothing changed since the last round (the change is looked for, nothing sent);
* ``one changed``: one element of one tensor;
* ``full``: ``push(full=True)``, every tensor sent.

Links: ``shm`` (host rounds: the trainer's tensors packed from the host) and ``ipc`` with device
rounds forced (``DELTACKPT_DEVICE_ROUNDS=always``: the path a CUDA trainer takes on an ipc link,
fingerprints, device digests and packing by torch operations, here on CPU tensors). A round is
timed on the trainer, from the start of ``push`` to its return after the commit vote (the
receiver's pull inside it), best of ``--repeats`` (what a round costs without the machine's
noise: this is host work, which noise only adds to); beside it the CPU time each process spent
in a round (all its threads, best of the repeats). Beside them, in the same run, the floor of
any round: one round trip of the group's TCP store (a vote is at least one).

    python benchmarks/bench_sync_overhead.py                    # ~30 s, CPU tensors
    python benchmarks/bench_sync_overhead.py --device cuda:0    # on a GPU (the device check)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import _common as C

KINDS = ("unchanged", "one changed", "full")


def _state(n: int, kb: int, total: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    if n == 1:
        return {"t0": torch.randn(total * 256, generator=g).to(device)}
    return {f"t{i}": torch.randn(kb * 256, generator=g).to(device) for i in range(n)}


def _group(cfg: dict[str, Any], port: int, rank: int) -> Any:
    from deltackpt import sync

    os.environ["DELTACKPT_DEVICE_ROUNDS"] = "always" if cfg["links"] == "ipc" else "off"
    kw = {"ipc_device": cfg["device"]} if cfg["links"] == "ipc" and cfg["device"] != "cpu" else {}
    return sync.SyncGroup("127.0.0.1", port, rank, 2, [0], timeout=60, links=cfg["links"], **kw)


def _plan(repeats: int) -> list[str]:
    return ["full"] + [k for _ in range(repeats) for k in KINDS]  # the first: untimed


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def _trainer(cfg: dict[str, Any], port: int, q: Any) -> None:
    group = _group(cfg, port, 0)
    from deltackpt import sync

    sender = sync.WeightSender(group)
    state = _state(cfg["n"], cfg["kb"], cfg["total_kb"], cfg["device"])
    first = next(iter(state.values()))
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    store_rtt = []
    prof = _Profile(cfg, "trainer")
    for i, kind in enumerate(_plan(cfg["repeats"])):
        if kind == "one changed":
            first[0] += 1.0
        _sync(cfg["device"])
        if i:
            prof.on(kind)
        t, c = time.perf_counter(), time.process_time()
        sender.push(state, version=i + 1, full=kind == "full")
        prof.off()
        if i:
            times[kind].append(time.perf_counter() - t)
            cpu[kind].append(time.process_time() - c)
    for _ in range(50):
        t = time.perf_counter()
        group.store.check(["rtt"])
        store_rtt.append(time.perf_counter() - t)
    q.put({"rounds": {k: min(v) for k, v in times.items()},
           "cpu": {k: min(v) for k, v in cpu.items()},
           "store_rtt": statistics.median(store_rtt), "device_rounds": sender._device})  # fmt: skip
    prof.write()
    group.close()


def _receiver(cfg: dict[str, Any], port: int, q: Any) -> None:
    group = _group(cfg, port, 1)
    from deltackpt import sync

    # device rounds land in the receiver's GPU; host rounds in its host memory
    receiver = sync.WeightReceiver(group, device=cfg["device"] if cfg["links"] == "ipc" else "cpu")
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    prof = _Profile(cfg, "receiver")
    for i, kind in enumerate(_plan(cfg["repeats"])):
        if i:
            prof.on(kind)
        c = time.process_time()
        receiver.pull()
        _sync(cfg["device"])
        prof.off()
        if i:
            cpu[kind].append(time.process_time() - c)
    q.put({"receiver_cpu": {k: min(v) for k, v in cpu.items()}})
    prof.write()
    group.close()


class _Profile:
    """cProfile around every other round of one kind (``--profile``), its top functions written
    to ``<out>/bench_sync_overhead.<links>-<n>.<side>.prof.txt``: where a round's host time
    goes. The rounds between are not profiled, so the best of the repeats (what the table
    reports) is a round without the profiler's cost."""

    def __init__(self, cfg: dict[str, Any], side: str) -> None:
        import cProfile

        self.kind, self.side, self.out = cfg.get("profile"), side, cfg.get("out")
        self.prof = cProfile.Profile() if self.kind else None
        self.tag = f"{cfg['links']}/{cfg['n']}"
        self.seen = 0

    def on(self, kind: str) -> None:
        if self.prof is not None and kind == self.kind:
            self.seen += 1
            if self.seen % 2:
                self.prof.enable()

    def off(self) -> None:
        if self.prof is not None:
            self.prof.disable()

    def write(self) -> None:
        if self.prof is None or self.out is None:
            return
        import io
        import pstats

        buf = io.StringIO()
        st = pstats.Stats(self.prof, stream=buf)
        buf.write(f"# {self.side}, {self.tag}, rounds of kind {self.kind!r}\n")
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        name = f"bench_sync_overhead.{self.tag.replace('/', '-')}.{self.side}.prof.txt"
        Path(self.out).mkdir(parents=True, exist_ok=True)
        (Path(self.out) / name).write_text(buf.getvalue())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=f, args=(cfg, port, q)) for f in (_trainer, _receiver)]
    for p in procs:
        p.start()
    try:
        got: dict[str, Any] = {}
        for _ in procs:
            got.update(q.get(timeout=cfg["timeout"]))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tensors", type=int, default=240)
    ap.add_argument("--kb", type=int, default=1, help="KiB of each small tensor (fp32)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--links", default="shm,ipc")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where both sides' tensors live: cpu (the stand-in) or cuda:N (ipc: CUDA buckets)",
    )
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--profile",
        choices=KINDS,
        help="cProfile both processes over every other round of this kind (the best of the "
        "repeats stays an unprofiled round); top functions into "
        "<out>/bench_sync_overhead.*.prof.txt",
    )
    ap.add_argument("--out", default=str(C.OUT_DIR), help="directory for the JSON and table")
    args = ap.parse_args()
    total = args.tensors * args.kb
    res: dict[str, Any] = {}
    for links in args.links.split(","):
        for n in (1, args.tensors):
            cfg = {"links": links, "n": n, "kb": args.kb, "total_kb": total,
                   "repeats": args.repeats, "timeout": args.timeout,
                   "device": args.device, "profile": args.profile, "out": args.out}  # fmt: skip
            res[f"{links}/{n}"] = run(cfg)
    lines = [
        f"{args.tensors} tensors of {args.kb} KiB against one of {total} KiB on {args.device}, one "
        f"trainer -> one receiver, best of {args.repeats}; store round trip "
        f"{1e3 * statistics.median(r['store_rtt'] for r in res.values()):.2f} ms",
        "",
        f"| link | round | 1 tensor | {args.tensors} tensors | per extra tensor | x 1 tensor "
        f"| host CPU a round, {args.tensors} tensors: trainer / receiver (1 tensor) |",
        "|---|---|---|---|---|---|---|",
    ]
    for links in args.links.split(","):
        one, many = res[f"{links}/1"], res[f"{links}/{args.tensors}"]
        how = "device rounds" if many["device_rounds"] else "host rounds"
        for k in KINDS:
            a, b = one["rounds"][k], many["rounds"][k]
            per = (b - a) / (args.tensors - 1)
            tc, rc = many["cpu"][k], many["receiver_cpu"][k]
            tc1, rc1 = one["cpu"][k], one["receiver_cpu"][k]
            lines.append(
                f"| {links} ({how}) | {k} | {1e3 * a:.2f} ms | {1e3 * b:.2f} ms | "
                f"{1e6 * per:.0f} us | {b / a:.1f}x | {1e3 * tc:.1f} / {1e3 * rc:.1f} ms "
                f"({1e3 * tc1:.1f} / {1e3 * rc1:.1f}) |"
            )
    text = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sync_overhead.json").write_text(
        json.dumps({"args": vars(args), "results": res, "machine": C.machine_info()}, indent=1)
    )
    (out / "bench_sync_overhead.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
