"""Hugging Face export and import, side by side in one run: deltackpt vs plain safetensors.

The state is the Qwen2-0.5B shapes in bf16 (random weights, lm_head tied to embed_tokens,
~0.99 GB at scale 1; ``--scale`` shrinks layers and vocabulary). Every measurement runs in a
fresh child process, so its peak RSS (``VmHWM``) is its own; ``rss before`` is the child's RSS
when the timed region starts (the baselines hold the state in memory already, as a model does).

Rows:

* ``export``: ``deltackpt.export_hf`` of a snapshot (store -> HF directory; reads, verifies and
  writes tensor by tensor, fsyncs) vs ``safetensors.torch.save_file`` of the in-memory state,
  tied copy dropped and sharded like ``save_pretrained`` (``split_torch_state_dict_into_shards``
  at ``--max-shard-size``), plus fsync of each file (``save_pretrained`` does not fsync: the
  no-fsync time is also given).
* ``import``: ``deltackpt.import_checkpoint`` of that HF directory into a new store (validated
  header, memory-mapped, hashed, written, fsynced) vs ``safetensors.torch.load_file`` of every
  shard, each tensor cloned (``load_file`` only maps the file; ``from_pretrained`` copies the
  bytes into the model), files warm in the page cache for both.
* ``import again``: the same import into a store that already holds it: dedupe writes only a
  manifest.

GB/s is tensor bytes per second. Results: ``bench-out/hf-*.json`` and a markdown table.

    python benchmarks/bench_hf.py --scale 0.1          # quick (~90 MB)
    python benchmarks/bench_hf.py                      # the 0.99 GB state
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C


def _state(scale: float) -> dict[str, Any]:
    import torch

    return C.qwen2_weights(torch.bfloat16, scale)


def _hf_split(sd: dict[str, Any], max_shard_size: str) -> dict[str, dict[str, Any]]:
    """file name -> tensors, as save_pretrained cuts them (the tied lm_head left out)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    return {f: {k: sd[k] for k in ks} for f, ks in split.filename_to_tensors.items()}


# ---- children: one measurement each, result as JSON on stdout ---------------------------------


def child_setup(a: argparse.Namespace) -> dict[str, Any]:
    """Save the state as a deltackpt snapshot (the export source)."""
    import deltackpt

    sd = _state(a.scale)
    info = deltackpt.save({"model": sd}, a.work / "store", "base")
    return {"logical_bytes": info.logical_bytes, "tensors": info.tensors}


def child_export_safetensors(a: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import save_file

    sd = _state(a.scale)
    out = a.work / "st-out"
    out.mkdir()
    parts = _hf_split(sd, a.max_shard_size)
    rss0 = C.rss()
    t0 = time.perf_counter()
    for f, tensors in parts.items():
        save_file(tensors, out / f, metadata={"format": "pt"})
    t_nofsync = time.perf_counter() - t0
    for f in parts:
        C.fsync_file(out / f)
    C.fsync_dir(out)
    secs = time.perf_counter() - t0
    nbytes = sum(t.nbytes for p in parts.values() for t in p.values())
    return {"seconds": secs, "seconds_nofsync": t_nofsync, "bytes": nbytes, "rss0": rss0}


def child_export_deltackpt(a: argparse.Namespace) -> dict[str, Any]:
    import deltackpt

    rss0 = C.rss()
    t0 = time.perf_counter()
    r = deltackpt.export_hf(
        a.work / "store", "base", a.work / "dk-out", max_shard_size=a.max_shard_size
    )
    secs = time.perf_counter() - t0
    return {"seconds": secs, "bytes": r.total_bytes, "rss0": rss0, "files": r.files}


def child_import_safetensors(a: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted((a.work / "st-out").glob("*.safetensors"))
    C.warm_files(files)
    rss0 = C.rss()
    t0 = time.perf_counter()
    sd: dict[str, Any] = {}
    for f in files:  # load_file maps the file lazily: clone materialises, as from_pretrained does
        sd.update((k, v.clone()) for k, v in load_file(f).items())
    secs = time.perf_counter() - t0
    return {"seconds": secs, "bytes": sum(t.nbytes for t in sd.values()), "rss0": rss0}


def child_import_deltackpt(a: argparse.Namespace) -> dict[str, Any]:
    import deltackpt

    src = a.work / "st-out"
    C.warm_files(sorted(src.glob("*.safetensors")))
    rss0 = C.rss()
    t0 = time.perf_counter()
    info = deltackpt.import_checkpoint(src, a.work / a.store_name, "imported", overwrite=True)
    secs = time.perf_counter() - t0
    return {
        "seconds": secs,
        "bytes": info.logical_bytes,
        "rss0": rss0,
        "bytes_written": info.bytes_written,
        "chunks_new": info.chunks_new,
    }


CHILDREN = {
    "setup": child_setup,
    "export-safetensors": child_export_safetensors,
    "export-deltackpt": child_export_deltackpt,
    "import-safetensors": child_import_safetensors,
    "import-deltackpt": child_import_deltackpt,
}


def run_child(role: str, a: argparse.Namespace, **extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        role,
        "--work",
        str(a.work),
        "--scale",
        str(a.scale),
    ]
    cmd += ["--max-shard-size", a.max_shard_size]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"child {role} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _verify(a: argparse.Namespace) -> bool:
    """The deltackpt export equals the reference export, tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    def read(d: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    mine, ref = read(a.work / "dk-out"), read(a.work / "st-out")
    return set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--reps", type=int, default=3, help="runs per row (median)")
    p.add_argument("--dir", help="working directory (default: a temporary one)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--store-name", default="import-store", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        result = CHILDREN[a.child](a)
        result["vmhwm"] = C.vmhwm()
        print(json.dumps(result))
        return
    log = C.make_log()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        a.work = Path(tmp)
        setup = run_child("setup", a)
        log(f"state: {C.fmt_bytes(setup['logical_bytes'])}, {setup['tensors']} tensors")
        runs: dict[str, list[dict[str, Any]]] = {}

        def rep(label: str, role: str, clean: list[str], **extra: str) -> None:
            for _ in range(a.reps):
                for c in clean:
                    C.rmtree(a.work / c)
                r = run_child(role, a, **extra)
                runs.setdefault(label, []).append(r)
                log(f"{label}: {r['seconds']:.3f} s, peak rss {C.fmt_bytes(r['vmhwm'])}")

        rep("export / safetensors save_file", "export-safetensors", ["st-out"])
        rep("export / deltackpt export_hf", "export-deltackpt", ["dk-out"])
        exact = _verify(a)
        log(f"deltackpt export equals the save_file export: {exact}")
        rep("import / safetensors load_file", "import-safetensors", [])
        rep("import / deltackpt import_checkpoint", "import-deltackpt", ["import-store"])
        rep("import again / deltackpt (dedupe)", "import-deltackpt", [])
    rows, table = {}, []
    for label, rs in runs.items():
        med = sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]
        rows[label] = med
        extra = ""
        if "seconds_nofsync" in med:
            extra = f"no fsync: {med['seconds_nofsync']:.3f} s"
        if "bytes_written" in med:
            extra = f"wrote {C.fmt_bytes(med['bytes_written'])}"
        table.append(
            [
                label,
                f"{med['seconds']:.3f}",
                f"{med['bytes'] / med['seconds'] / 1e9:.2f}",
                C.fmt_bytes(med["rss0"]),
                C.fmt_bytes(med["vmhwm"]),
                extra,
            ]
        )
    print(C.md_table(["row", "seconds", "GB/s", "rss before", "peak rss", "note"], table))
    base = {"export": "export / safetensors save_file", "import": "import / safetensors load_file"}
    for what, ref in base.items():
        mine = rows[
            f"{what} / deltackpt " + ("export_hf" if what == "export" else "import_checkpoint")
        ]
        print(
            f"{what}: deltackpt / safetensors time ratio {mine['seconds'] / rows[ref]['seconds']:.2f}"
        )
    out = C.OUT_DIR / f"hf-{time.strftime('%Y%m%d-%H%M%S')}.json"
    C.write_json(
        out,
        {
            "scale": a.scale,
            "max_shard_size": a.max_shard_size,
            "state_bytes": setup["logical_bytes"],
            "bit_exact_export": exact,
            "rows": rows,
            "runs": runs,
            "machine": C.machine_info(),
        },
    )
    print(f"results: {out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
