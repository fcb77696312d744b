"""Tests for the ``deltackpt`` command line (run in-process) and the demo."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import deltackpt
import deltackpt.cli.demo
from deltackpt.cli.format import human_bytes, make_console
from deltackpt.cli.main import main


def _state(step: int, bias_shift: float = 0.0, extra: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    model = {
        "w": torch.randn(256, 256, generator=g),
        "b": torch.randn(256, generator=g) + bias_shift,
    }
    if extra:
        model["extra"] = torch.ones(3)
    return {"model": model, "step": step}


@pytest.fixture
def store(tmp_path):
    """Two snapshots: 'a', then 'b' with model/b changed, model/extra added, step changed."""
    path = tmp_path / "ckpts"
    deltackpt.save(_state(1), path, "a", metadata={"step": 1, "note": "first"})
    deltackpt.save(_state(2, bias_shift=1.0, extra=True), path, "b", metadata={"step": 2})
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 20) == "3.0 MiB"
    assert human_bytes(5 << 30) == "5.0 GiB"


def test_ls_lists_snapshots(capsys, store):
    code, out, _ = run(capsys, "ls", store)
    assert code == 0
    assert "2 snapshots" in out
    assert re.search(r"\ba\b", out) and re.search(r"\bb\b", out)
    assert "KiB" in out  # human sizes


def test_show_lists_keys_metadata_and_values(capsys, store):
    code, out, _ = run(capsys, "show", store, "a")
    assert code == 0
    assert "model/w" in out and "model/b" in out
    assert "float32" in out and "[256, 256]" in out
    assert '"note": "first"' in out
    assert "non-tensor values 1" in out and "step=1" in out
    code, out, _ = run(capsys, "show", store)  # default: latest
    assert code == 0 and "snapshot b" in out and "model/extra" in out


def test_diff_reports_changed_and_added(capsys, store):
    code, out, _ = run(capsys, "diff", store, "a", "b")
    assert code == 1  # like diff(1): differences found
    tensor_table = out.split("non-tensor values")[0]
    rows = {
        m.group(2): m.group(1)
        for m in re.finditer(r"(changed|added|removed)\s*│\s*(\S+)", tensor_table)
    }
    # model/w shares a grouped chunk with model/b but its bytes did not change
    assert rows == {"model/b": "changed", "model/extra": "added"}
    assert "1 changed (1.0 KiB), 1 added, 0 removed, 1 unchanged" in out
    assert re.search(r"changed\s*│\s*step\s*│\s*1\s*│\s*2", out)  # the non-tensor value


def test_diff_of_identical_snapshots(capsys, tmp_path):
    p = tmp_path / "s"
    deltackpt.save(_state(1), p, "x")
    deltackpt.save(_state(1), p, "y")
    code, out, _ = run(capsys, "diff", p, "x", "y")
    assert code == 0
    assert "0 changed (0 B), 0 added, 0 removed, 2 unchanged" in out


def test_du_dedupe_ratio(capsys, tmp_path):
    p = tmp_path / "s"
    deltackpt.save(_state(1), p, "x")
    deltackpt.save(_state(1), p, "y")
    code, out, _ = run(capsys, "du", p)
    assert code == 0
    ratio = float(re.search(r"dedupe ratio ([0-9.]+)x", out).group(1))
    assert ratio > 1.5
    assert "x" in out and "y" in out


def _flip_byte_of(store_path, name: str, key: str) -> None:
    st = deltackpt.open_store(store_path, create=False)
    m = st.manifest(name)
    entry = next(e for e in m.tensors if e.path == key)
    rec = m.chunks[entry.data[0][0]]
    pack = store_path / "packs" / f"{rec.pack}.pack"
    with open(pack, "r+b") as f:
        pos = rec.offset + rec.length // 2
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_ok_then_corrupt(capsys, store):
    code, out, _ = run(capsys, "verify", store)
    assert code == 0
    assert "OK" in out and "2 snapshots" in out and "GB/s" in out
    _flip_byte_of(store, "b", "model/extra")
    code, out, _ = run(capsys, "verify", store, "b")
    assert code == 1
    assert "model/extra" in out
    assert "FAILED" in out


def test_gc_keep_last(capsys, store):
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert re.search(r"snapshots to delete\s*│ 1: a\s", out)
    assert [s.name for s in deltackpt.snapshots(store)] == ["a", "b"]  # dry run deleted nothing
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1")
    assert code == 0
    assert "1: a" in out
    assert [s.name for s in deltackpt.snapshots(store)] == ["b"]
    assert deltackpt.verify(store).ok
    code, out, _ = run(capsys, "ls", store)
    assert "1 snapshot" in out


def test_gc_keep_named(capsys, store):
    names = [s.name for s in deltackpt.snapshots(store)]
    # a --keep name that matches nothing is most likely a typo: an error, and nothing deleted
    code, _, err = run(capsys, "gc", store, "--keep-last", "0", "--keep", "a", "nope")
    assert code == 3 and "nope" in err and "deleted nothing" in err
    assert [s.name for s in deltackpt.snapshots(store)] == names
    code, _, err = run(capsys, "gc", store, "--keep-last", "0", "--keep", "a")
    assert code == 0
    assert [s.name for s in deltackpt.snapshots(store)] == ["a"]


def test_errors_exit_with_one_line(capsys, store, tmp_path):
    code, _, err = run(capsys, "show", store, "no-such-snapshot")
    assert code == 3
    assert "no-such-snapshot" in err and "error" in err
    assert "Traceback" not in err
    code, _, err = run(capsys, "ls", tmp_path / "not-a-store")
    assert code == 3 and "STORE.json" in err
    assert not (tmp_path / "not-a-store").exists()  # the CLI never creates a store
    code, _, err = run(capsys, "diff", store, "a", "../x")
    assert code == 2 and "not allowed" in err


def test_usage_error_returns_code(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["--version"]) == 0
    assert "deltackpt" in capsys.readouterr().out


def test_python_dash_m(store):
    r = subprocess.run(
        [sys.executable, "-m", "deltackpt", "ls", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "2 snapshots" in r.stdout


def test_demo_is_bit_exact(tmp_path):
    buf = io.StringIO()
    result = deltackpt.cli.demo.run(directory=tmp_path, steps=6, console=make_console(file=buf))
    out = buf.getvalue()
    assert result["bit_exact"], result["mismatches"]
    assert result["next_step_identical"]
    assert result["verify_ok"]
    assert len(result["saves"]) == 6
    assert [s.name for s in deltackpt.snapshots(tmp_path)][-1] == "step-0006"
    # frozen embedding and block 0 are reused: later saves write well under a full save
    assert result["mean_incremental_fraction"] < 0.8
    assert result["dedupe_ratio"] > 1.0
    assert "bit-exact ✓" in out


def test_demo_refuses_non_empty_dir(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "demo", "--dir", tmp_path, "--steps", "1")
    assert code == 3 and "empty" in err  # a StoreError: the directory is not a (new) store


def test_show_and_diff_name_generator_states_not_addresses(capsys, tmp_path):
    path = tmp_path / "g"
    deltackpt.save({"g": torch.Generator().manual_seed(1)}, path, "a")
    deltackpt.save({"g": torch.Generator().manual_seed(2)}, path, "b")
    code, out, _ = run(capsys, "show", path, "a")
    assert code == 0 and "g=<torch.Generator state>" in out and "0x" not in out
    code, out, _ = run(capsys, "diff", path, "a", "b")
    assert code == 1 and "1 non-tensor value(s) differ" in out


# rich is optional (the "cli" extra): the library never imports it, and the CLI prints the same
# information as plain text without it.
_WITHOUT_RICH = textwrap.dedent(
    """
    import io, json, sys
    from contextlib import redirect_stderr, redirect_stdout
    sys.modules["rich"] = None  # any import of rich now fails
    import deltackpt
    assert "rich" not in sys.modules or sys.modules["rich"] is None
    from deltackpt.cli.main import main
    runs = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(argv)
        runs.append([code, out.getvalue(), err.getvalue()])
    print(json.dumps(runs))
    """
)


def _run_without_rich(*argvs: list) -> list:
    argv = json.dumps([[str(a) for a in args] for args in argvs])
    r = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RICH, argv], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_import_deltackpt_does_not_import_rich_or_safetensors():
    code = "import sys, deltackpt, deltackpt.dcp; print(sorted({'rich', 'safetensors'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_cli_without_rich_prints_plain_tables(store, tmp_path):
    _flip_byte_of(store, "b", "model/extra")
    ls, show, diff, du, verify, gc, err = _run_without_rich(
        ["ls", store],
        ["show", store, "a"],
        ["diff", store, "a", "a"],
        ["du", store],
        ["verify", store, "b"],
        ["gc", store, "--keep-last", "1", "--dry-run"],
        ["show", store, "no-such-snapshot"],
    )
    assert ls[0] == 0 and "2 snapshots" in ls[1] and re.search(r"^a\s+│", ls[1], re.M)
    assert show[0] == 0 and re.search(r"model/w\s+│ float32 │ \[256, 256\]", show[1])
    assert '"note": "first"' in show[1] and "step=1" in show[1] and "[bold]" not in show[1]
    assert diff[0] == 0 and "0 changed (0 B), 0 added, 0 removed, 2 unchanged" in diff[1]
    assert du[0] == 0 and re.search(r"dedupe ratio [0-9.]+x", du[1])
    assert verify[0] == 1 and "model/extra" in verify[1] and "FAILED" in verify[1]
    assert gc[0] == 0 and re.search(r"snapshots to delete\s*│ 1: a$", gc[1], re.M)
    assert err[0] == 3 and err[2].startswith("error: ") and "no-such-snapshot" in err[2]
    assert "[/]" not in "".join(x[1] + x[2] for x in (ls, show, diff, du, verify, gc, err))


def test_gc_dry_run_notes_a_save_in_flight(capsys, store):
    code, out, _ = run(capsys, "gc", store, "--dry-run")
    assert code == 0 and "a save is in flight" not in out
    st = deltackpt.open_store(store, create=False)
    with st.lock(exclusive=False, timeout=5, what="a test save"):  # what a save holds
        code, out, _ = run(capsys, "gc", store, "--dry-run")
    assert code == 0 and "a save is in flight" in out
