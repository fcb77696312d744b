"""``deltackpt demo``: fine-tune a tiny GPT on CPU, checkpoint every step, resume bit-exactly.

What it shows, honestly:

* The embedding (tied to the LM head) and the first transformer block are frozen and only the
  top is fine-tuned, so part of every checkpoint is unchanged; deltackpt writes only the chunks
  that changed (the trained block, its optimizer state), and reuses the rest. A model where every
  weight changes every step would need full writes (minus what compression saves).
* The demo store uses 256 KiB chunks instead of the default 4 MiB because the model is tiny;
  with 4 MiB chunks most of its tensors would share a few grouped chunks.
* Resuming from the latest snapshot into a freshly built model and optimizer reproduces every
  parameter and optimizer-state bit, and the next training step gives the identical loss.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import deltackpt
from deltackpt.cli.format import Console, default_console, new_table
from deltackpt.cli.format import human_bytes as _human
from deltackpt.cli.snapshots import pack_files
from deltackpt.errors import StoreError

VOCAB = 2048
DOMAIN = 256  # the fine-tuning data uses only the first DOMAIN token ids
D_MODEL = 256
HEADS = 4
LAYERS = 2
CTX = 32
BATCH = 8
EMB_STD = 0.02
LR = 3e-3
SEED = 0
CHUNK_BYTES = 256 << 10
SMALL_BYTES = 64 << 10


class TinyGPT(nn.Module):
    """Token + position embedding, pre-norm transformer blocks with a causal mask, tied LM head."""

    mask: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(CTX, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, GPT-2 style
        mask = nn.Transformer.generate_square_subsequent_mask(CTX)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x)) / (EMB_STD * D_MODEL**0.5)  # tied head: O(1) logits


def build() -> tuple[TinyGPT, torch.optim.Optimizer]:
    """The model with its embedding and first block frozen, and AdamW over the rest."""
    model = TinyGPT()
    for emb in (model.tok, model.pos):
        nn.init.normal_(emb.weight, std=EMB_STD)
    for module in (model.tok, model.pos, model.blocks[0]):
        module.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=LR, weight_decay=0.01)


def batch(step: int) -> torch.Tensor:
    """Deterministic synthetic sequences: arithmetic progressions mod DOMAIN (a narrow domain)."""
    g = torch.Generator().manual_seed(SEED * 100_003 + step)
    start = torch.randint(0, DOMAIN, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(CTX)) % DOMAIN


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    idx = batch(step)
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state, which AdamW otherwise creates at its first step,
    so that ``load(into=...)`` has tensors to fill in place. Runs one step with zero gradients and
    lr=0, which leaves every parameter bit-identical; the loaded snapshot then overwrites the state.
    """
    saved = [g["lr"] for g in opt.param_groups]
    params = [p for g in opt.param_groups for p in g["params"]]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, saved, strict=True):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def compare(
    model_a: nn.Module,
    opt_a: torch.optim.Optimizer,
    model_b: nn.Module,
    opt_b: torch.optim.Optimizer,
) -> list[str]:
    """Keys whose bits differ between two (model, optimizer) pairs; empty when bit-exact."""
    bad = []
    sa, sb = model_a.state_dict(), model_b.state_dict()
    if sa.keys() != sb.keys():
        bad.append(f"model keys {sorted(set(sa) ^ set(sb))}")
    bad += [f"model/{k}" for k in sa.keys() & sb.keys() if not _same_bits(sa[k], sb[k])]
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    if oa["param_groups"] != ob["param_groups"]:
        bad.append("optim/param_groups")
    if oa["state"].keys() != ob["state"].keys():
        bad.append("optim/state keys")
    for i in oa["state"].keys() & ob["state"].keys():
        a, b = oa["state"][i], ob["state"][i]
        if a.keys() != b.keys():
            bad.append(f"optim/state/{i} keys")
        bad += [f"optim/state/{i}/{k}" for k in a.keys() & b.keys() if not _same_bits(a[k], b[k])]
    return bad


def run(
    directory: str | Path | None = None,
    steps: int = 30,
    console: Console | None = None,
    *,
    keep: bool = False,
) -> dict[str, Any]:
    """Train, checkpoint every step, resume, verify; print tables and return the numbers.

    ``directory`` is the store (new or empty); default: a temporary directory, removed at the end
    unless ``keep=True``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    console = console or default_console()
    t_start = time.perf_counter()
    temp = directory is None
    root = Path(tempfile.mkdtemp(prefix="deltackpt-demo-") if directory is None else directory)
    if not temp and root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise StoreError(
            f"demo needs a new or empty directory, and {str(root)!r} is not one; pass another "
            "--dir or remove it"
        )
    # A model this small trains as fast on one intra-op thread, and one thread does not slow
    # down by 10x when other processes compete for the cores (OpenMP spin-waits).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _run(root, steps, console)
    finally:
        torch.set_num_threads(threads)
        if temp and not keep:
            shutil.rmtree(root, ignore_errors=True)
    result["kept"] = not temp or keep
    result["seconds"] = time.perf_counter() - t_start
    if result["kept"]:
        console.print(f"store kept at {root}  (try: deltackpt ls {root})")
    console.print(f"demo took {result['seconds']:.1f} s")
    return result


def _run(root: Path, steps: int, console: Console) -> dict[str, Any]:
    torch.manual_seed(SEED)
    store = deltackpt.open_store(root, chunk_bytes=CHUNK_BYTES, small_bytes=SMALL_BYTES)
    model, opt = build()
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    console.print(
        f"[bold]deltackpt demo[/]: tiny GPT ({n_params / 1e6:.2f}M params: vocab {VOCAB}, "
        f"d_model {D_MODEL}, {LAYERS} blocks, tied LM head), AdamW, {steps} steps on CPU"
    )
    console.print(
        f"Frozen: token/position embeddings (tied to the LM head) and block 0; fine-tuning "
        f"block 1 + final norm ({n_train / 1e6:.2f}M params). Unchanged chunks are reused, so "
        "each save writes only what training changed."
    )
    console.print(f"Store: {root} (chunk size {_human(CHUNK_BYTES)} for this small model)")

    table = new_table("one checkpoint per step")
    for col in ("step", "loss", "save s", "written", "% of full", "chunks new/reused"):
        table.add_column(col, justify="right")
    saves: list[dict[str, Any]] = []
    last_rng = torch.get_rng_state()
    for step in range(1, steps + 1):
        loss = train_step(model, opt, step)
        last_rng = torch.get_rng_state()
        state = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "step": step,
            "rng": last_rng,
        }
        info = deltackpt.save(
            state, store, f"step-{step:04d}", metadata={"step": step, "loss": float(loss)}
        )
        frac = info.bytes_written / info.logical_bytes
        saves.append(
            {
                "step": step,
                "loss": float(loss),
                "seconds": info.seconds,
                "bytes_written": info.bytes_written,
                "logical_bytes": info.logical_bytes,
                "fraction": frac,
                "chunks_new": info.chunks_new,
                "chunks_reused": info.chunks_reused,
            }
        )
        table.add_row(
            str(step),
            f"{float(loss):.4f}",
            f"{info.seconds:.3f}",
            _human(info.bytes_written),
            f"{100 * frac:.1f}%",
            f"{info.chunks_new}/{info.chunks_reused}",
        )
    console.print(table)
    full = saves[0]["logical_bytes"]
    later = saves[1:]
    mean_frac = sum(s["fraction"] for s in later) / len(later) if later else saves[0]["fraction"]
    console.print(
        f"full state: {_human(full)}; first save wrote {_human(saves[0]['bytes_written'])}"
        + (
            f", later saves {_human(sum(s['bytes_written'] for s in later) / len(later))} "
            f"on average ({100 * mean_frac:.1f}% of a full save)"
            if later
            else ""
        )
    )

    # Resume into a freshly built model and optimizer (different random init on purpose).
    torch.manual_seed(SEED + 1)
    model2, opt2 = build()
    materialize_optimizer_state(opt2)
    target: dict[str, Any] = {
        "model": model2.state_dict(),
        "optim": opt2.state_dict(),
        "step": 0,
        "rng": torch.empty_like(last_rng),
    }
    t0 = time.perf_counter()
    deltackpt.load(store, into=target)  # in place; every chunk re-hashed on the way
    load_s = time.perf_counter() - t0
    opt2.load_state_dict(target["optim"])  # hyperparameters; the state tensors are already filled
    mismatches = compare(model, opt, model2, opt2)
    step_ok = target["step"] == steps
    rng_ok = torch.equal(target["rng"], last_rng)
    bit_exact = not mismatches and step_ok and rng_ok
    n_keys = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    console.print(f"resume: loaded 'latest' into a fresh model + optimizer in {load_s:.3f} s")
    console.print(
        f"resume: bit-exact ✓ ({n_keys} parameter and optimizer-state tensors, step {target['step']}, RNG state)"
        if bit_exact
        else f"[red]resume: NOT bit-exact ✗[/] differs: {mismatches[:5]} step_ok={step_ok} rng_ok={rng_ok}"
    )

    # One more step with both: same batch, so the losses and the new weights must be identical.
    torch.set_rng_state(last_rng)
    loss_a = train_step(model, opt, steps + 1)
    torch.set_rng_state(target["rng"] if rng_ok else last_rng)
    loss_b = train_step(model2, opt2, steps + 1)
    after = compare(model, opt, model2, opt2)
    next_ok = _same_bits(loss_a, loss_b) and not after
    console.print(
        f"resume: next step identical ✓ (loss {float(loss_a):.6f} == {float(loss_b):.6f}, weights equal)"
        if next_ok
        else f"[red]resume: next step differs ✗[/] loss {float(loss_a)!r} vs {float(loss_b)!r}; {after[:5]}"
    )

    report = deltackpt.verify(store)
    gbps = report.bytes_checked / report.seconds / 1e9 if report.seconds > 0 else 0.0
    console.print(
        f"verify: {'OK ✓' if report.ok else '[red]FAILED ✗[/]'} {len(report.snapshots)} snapshots, "
        f"{report.chunks_checked} chunks, {_human(report.bytes_checked)} re-hashed in "
        f"{report.seconds:.2f} s ({gbps:.2f} GB/s)"
    )
    infos = deltackpt.snapshots(store)
    logical_total = sum(s.logical_bytes for s in infos)
    physical = sum(p.size for p in pack_files(store))
    ratio = logical_total / physical if physical else 0.0
    console.print(
        f"dedupe: {len(infos)} snapshots hold {_human(logical_total)} of tensors; packs on disk "
        f"{_human(physical)} → ratio {ratio:.2f}x"
    )
    return {
        "store": str(root),
        "steps": steps,
        "params": n_params,
        "trainable_params": n_train,
        "logical_bytes": full,
        "first_save_bytes": saves[0]["bytes_written"],
        "mean_incremental_fraction": mean_frac,
        "saves": saves,
        "load_seconds": load_s,
        "bit_exact": bit_exact,
        "mismatches": mismatches,
        "next_step_identical": next_ok,
        "loss_live": float(loss_a),
        "loss_resumed": float(loss_b),
        "verify_ok": report.ok,
        "total_logical_bytes": logical_total,
        "physical_bytes": physical,
        "dedupe_ratio": ratio,
    }
