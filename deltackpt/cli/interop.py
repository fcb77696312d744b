"""``deltackpt export`` and ``deltackpt import``: thin views of :func:`deltackpt.export_hf` and
:func:`deltackpt.import_checkpoint`.

::

    deltackpt export STORE [NAME] OUT_DIR [--key model] [--dtype bf16] [--max-shard-size 5GB]
                     [--config PATH] [--fp8] [--overwrite]
    deltackpt import SRC STORE NAME [--key model] [--src-key KEY] [--overwrite]

Both print one summary line (or with ``--json`` one JSON document) and draw a progress bar on
stderr when stdout and stderr are terminals (:mod:`deltackpt.cli.progress`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import deltackpt
from deltackpt.cli.format import Console, escape, human_bytes, print_json
from deltackpt.cli.progress import progress, show_progress
from deltackpt.cli.snapshots import open_existing
from deltackpt.interop.hf_export import config_doc, fp8_spec, parse_dtype, plan_export


def _key(s: str) -> str | None:
    return s or None  # --key "" : the whole state


def cmd_export(args: argparse.Namespace, out: Console) -> int:
    if args.out_dir is None:  # `export STORE OUT_DIR`: the latest snapshot
        name, out_dir = "latest", args.name
    else:
        name, out_dir = args.name, args.out_dir
    st = open_existing(args)
    m = st.manifest(name)
    fp8 = fp8_spec(args.fp8)
    doc = config_doc(args.config, parse_dtype(args.dtype), fp8)
    plan = plan_export(
        m,
        key=args.key,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        keep_tied=doc is not None and doc.get("tie_word_embeddings") is False,
        fp8=fp8,
    )
    with progress(plan.total_bytes, f"exporting {m.name}", enabled=show_progress(args)) as adv:
        r = deltackpt.export_hf(
            st,
            m.name,
            out_dir,
            key=args.key,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            config=args.config,
            overwrite=args.overwrite,
            progress=adv,
            fp8=fp8,
        )
    if args.json:
        print_json(
            {
                "snapshot": r.snapshot,
                "out_dir": str(r.out_dir),
                "files": r.files,
                "tensors": r.tensors,
                "total_bytes": r.total_bytes,
                "seconds": round(r.seconds, 6),
                "tied": r.tied,
            }
        )
        return 0
    tied = f", {len(r.tied)} tied copies left out" if r.tied else ""
    out.print(
        f"exported [bold]{escape(r.snapshot)}[/]: {r.tensors} tensors, "
        f"{human_bytes(r.total_bytes)} in {len(r.files)} files to {escape(str(r.out_dir))}"
        f"{tied} ({r.seconds:.2f} s)"
    )
    return 0


def cmd_import(args: argparse.Namespace, out: Console) -> int:
    with progress(None, f"importing {args.src}", enabled=show_progress(args)) as adv:
        info = deltackpt.import_checkpoint(
            args.src,
            deltackpt.open_store(args.store, storage_options=args.storage_options),
            args.name,
            key=args.key,
            src_key=args.src_key,
            overwrite=args.overwrite,
            progress=adv,
        )
    if args.json:
        print_json(
            {
                "snapshot": info.name,
                "tensors": info.tensors,
                "logical_bytes": info.logical_bytes,
                "bytes_written": info.bytes_written,
                "chunks_new": info.chunks_new,
                "chunks_reused": info.chunks_reused,
                "seconds": round(info.seconds, 6),
            }
        )
        return 0
    out.print(
        f"imported [bold]{escape(info.name)}[/]: {info.tensors} tensors, "
        f"{human_bytes(info.logical_bytes)}; wrote {human_bytes(info.bytes_written)} "
        f"({info.chunks_reused} chunks already in the store) in {info.seconds:.2f} s"
    )
    return 0


def add_parsers(
    sub: argparse._SubParsersAction, store_arg: Callable[[argparse.ArgumentParser], None]
) -> None:  # type: ignore[type-arg]
    """Register ``export`` and ``import`` on the subcommand parser ``sub``; ``store_arg`` adds
    the STORE argument and ``--storage-options`` as the other commands have them."""
    s = sub.add_parser("export", help="write a snapshot's model as Hugging Face safetensors")
    store_arg(s)
    s.add_argument("name", metavar="[NAME] OUT_DIR", help="snapshot (default: latest)")
    s.add_argument("out_dir", nargs="?", help=argparse.SUPPRESS)
    s.add_argument(
        "--key",
        type=_key,
        default="model",
        help="key path of the state dict (default: model; '' for the whole state)",
    )
    s.add_argument("--dtype", help="cast floating tensors: bf16, fp16, fp32")
    s.add_argument("--max-shard-size", default="5GB", help="shard size limit (default 5GB)")
    s.add_argument("--config", metavar="PATH", help="config.json to copy in")
    s.add_argument(
        "--fp8",
        action="store_true",
        help="decoder layers' projection weights as block FP8 (128x128, weight_scale_inv), "
        "with the config's quantization_config: what an FP8 engine starts from",
    )
    s.add_argument("--overwrite", action="store_true", help="replace existing files in OUT_DIR")
    _output_flags(s)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "import", help="import safetensors, a HF directory, a torch.save file or a DCP checkpoint"
    )
    s.add_argument("src", metavar="SRC", help="file or checkpoint directory")
    store_arg(s)
    s.add_argument("name", metavar="NAME", help="the new snapshot's name")
    s.add_argument(
        "--key",
        type=_key,
        default="model",
        help="save the import under this key (default: model; '' for none)",
    )
    s.add_argument("--src-key", type=_key, help="import only this key path of the source")
    s.add_argument("--overwrite", action="store_true", help="replace an existing snapshot NAME")
    _output_flags(s)
    s.set_defaults(func=cmd_import)


def _output_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    s.add_argument("--no-progress", action="store_true", help="draw no progress bar")
