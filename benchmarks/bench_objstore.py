"""Object stores, side by side in one run against a local S3 API server: deltackpt vs one
safetensors file through s3fs vs DCP's FsspecWriter / FsspecReader.

The server is moto's (``moto.server.ThreadedMotoServer``) on 127.0.0.1, started here in its own
process (``_objstore/server.py``), which counts the bytes it receives and sends: "bytes moved" is
measured at the server, per operation. The state is ``--mb`` MB of random bf16 weights (8 MiB
tensors). Scenarios, each system the same state:

1. ``full``: first save into an empty prefix.
2. ``unchanged``: save again, nothing changed.
3. ``step``: one dense step first, ``w.add_(sign(randn), alpha=-1e-5)`` in bf16 (what AdamW's
   first steps do at lr 1e-5): most elements keep their bits, every chunk changes.
4. ``load``: read the last save back into memory.

deltackpt runs once per ``--encodings`` policy (default ``auto,smallest``: the default, and xor
deltas + zstd). safetensors and DCP rewrite everything on every save. GB/s is the state's size over the time; a
loopback moto server is CPU-bound Python, so compare the systems, not the absolute numbers.

Run: ``python benchmarks/bench_objstore.py --mb 64 --out bench-out/objstore.json``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _harness.env import OUT_DIR, free_port, machine_info, make_log
from _harness.report import fmt_bytes, md_table, write_json

import deltackpt
from deltackpt.store.objstore import FsspecStorage

warnings.filterwarnings("ignore")
log = make_log()
BUCKET = "bench"
SERVER = Path(__file__).resolve().parent / "_objstore" / "server.py"


def make_state(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, (mb << 20) // (8 << 20))
    return {
        f"layers.{i}.w": torch.randn(1024, 4096, generator=g).to(torch.bfloat16) for i in range(n)
    }


def dense_step(sd: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for w in sd.values():
        w.add_(torch.randn(w.shape, generator=g).sign().to(w.dtype), alpha=-1e-5)


class Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/__bytes__", timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def measure(server: Server, fn: Any) -> tuple[float, int, int]:
    """Seconds, bytes uploaded and bytes downloaded (at the server) of ``fn()``."""
    c0 = server.counts()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    c1 = server.counts()
    return dt, c1["up"] - c0["up"], c1["down"] - c0["down"]


def check(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "load mismatch"


def bench_deltackpt(
    server: Server, opts: dict, sd: dict, seed: int, encoding: str
) -> dict[str, Any]:
    url = f"s3://{BUCKET}/deltackpt-{encoding}"
    st = deltackpt.open_store(url, storage=FsspecStorage(url, opts))
    sd = {k: v.clone() for k, v in sd.items()}
    out: dict[str, Any] = {}
    out["full"] = measure(server, lambda: deltackpt.save(sd, st, "s0", encoding=encoding))
    out["unchanged"] = measure(server, lambda: deltackpt.save(sd, st, "s1", encoding=encoding))
    dense_step(sd, seed)
    out["step"] = measure(server, lambda: deltackpt.save(sd, st, "s2", encoding=encoding))
    got: dict[str, Any] = {}
    out["load"] = measure(server, lambda: got.update(deltackpt.load(st, "s2")))
    check(sd, got)
    return out


def bench_safetensors(server: Server, fs: Any, sd: dict, seed: int) -> dict[str, Any]:
    from safetensors.torch import load, save

    sd = {k: v.clone() for k, v in sd.items()}
    out: dict[str, Any] = {}
    for i, case in enumerate(("full", "unchanged", "step")):
        if case == "step":
            dense_step(sd, seed)
        path = f"{BUCKET}/safetensors/s{i}.safetensors"
        out[case] = measure(server, lambda p=path: fs.pipe_file(p, save(sd)))
    got: dict[str, Any] = {}
    out["load"] = measure(server, lambda: got.update(load(fs.cat_file(path))))
    check(sd, got)
    return out


def bench_dcp(server: Server, opts: dict, sd: dict, seed: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    sd = {k: v.clone() for k, v in sd.items()}
    out: dict[str, Any] = {}
    for i, case in enumerate(("full", "unchanged", "step")):
        if case == "step":
            dense_step(sd, seed)
        path = f"s3://{BUCKET}/dcp/s{i}"

        def save(p: str = path) -> None:
            w = FsspecWriter(p, thread_count=4, **opts)
            dcp.save(sd, storage_writer=w, no_dist=True)

        out[case] = measure(server, save)
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    out["load"] = measure(
        server, lambda: dcp.load(got, storage_reader=FsspecReader(path, **opts), no_dist=True)
    )
    check(sd, got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="state size in MB (64-256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--encodings", default="auto,smallest", help="deltackpt's, comma-separated")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "objstore.json")
    args = ap.parse_args()
    import s3fs

    server = Server()
    try:
        opts = {"endpoint_url": server.url, "key": "bench", "secret": "bench"}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir(BUCKET)
        sd = make_state(args.mb, args.seed)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        log(f"state: {len(sd)} bf16 tensors, {fmt_bytes(nbytes)}; server {server.url}")
        results: dict[str, Any] = {}
        systems: list[tuple[str, Any]] = [
            (f"deltackpt {e}", lambda e=e: bench_deltackpt(server, opts, sd, args.seed + 1, e))
            for e in args.encodings.split(",")
        ]
        for name, fn in (
            *systems,
            ("safetensors+s3fs", lambda: bench_safetensors(server, fs, sd, args.seed + 1)),
            ("DCP FsspecWriter", lambda: bench_dcp(server, opts, sd, args.seed + 1)),
        ):
            log(f"{name} ...")
            try:
                results[name] = fn()
            except ImportError as e:
                log(f"{name}: skipped ({e})")
    finally:
        server.close()
    rows, data = [], []
    for name, cases in results.items():
        for case, (dt, up, down) in cases.items():
            moved = down if case == "load" else up
            rows.append(
                [
                    name,
                    case,
                    f"{dt:.2f}",
                    f"{nbytes / dt / 1e9:.3f}",
                    fmt_bytes(moved),
                    f"{moved / nbytes:.3f}",
                ]
            )
            data.append(
                {
                    "system": name,
                    "case": case,
                    "seconds": dt,
                    "gb_s": nbytes / dt / 1e9,
                    "bytes_up": up,
                    "bytes_down": down,
                    "bytes_moved": moved,
                }
            )
    header = ["system", "case", "seconds", "GB/s", "bytes moved", "moved / state"]
    print(f"state: {fmt_bytes(nbytes)} bf16 ({args.mb} MB requested), moto S3 on 127.0.0.1\n")
    print(md_table(header, rows))
    write_json(args.out, {"mb": args.mb, "state_bytes": nbytes, "rows": data, **machine_info()})
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
