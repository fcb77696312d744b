"""Importing deltackpt does nothing that depends on the moment of the import: no module reads
one of deltackpt's environment variables then (each knob is read when it is used:
deltackpt/options.py), so a knob set after ``import deltackpt`` takes effect, and a process
forked after the import (the tests' fork server preloads deltackpt: tests/_dist.py) behaves as
one that imported it itself."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.test_layout import ROOT

# in a fresh interpreter: os.environ replaced by a subclass that notes every key looked up
# (os.getenv and os.environ.get go through __getitem__), then every deltackpt module imported
SCRIPT = r"""
import importlib, json, os, pkgutil

import torch  # torch's own reads at its import are not ours

reads = []


class Spy(type(os.environ)):
    def __getitem__(self, key):
        reads.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        reads.append(key)
        return super().__contains__(key)


e = os.environ
os.environ = Spy(e._data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)

import deltackpt

imported, absent = [], []
for m in pkgutil.walk_packages(deltackpt.__path__, "deltackpt."):
    if m.name.endswith("__main__"):
        continue  # runs the CLI
    try:
        importlib.import_module(m.name)
        imported.append(m.name)
    except ImportError:  # an optional dependency (vLLM, Lightning, s3fs) absent here
        absent.append(m.name)
at_import = [k for k in reads if k.startswith("DELTACKPT")]
from deltackpt.options import default_threads

default_threads()  # a read when used: the spy must see it
print(json.dumps({"at_import": at_import, "imported": imported, "absent": absent,
                  "when_used": [k for k in reads if k.startswith("DELTACKPT")]}))
"""


def test_importing_every_module_reads_no_deltackpt_environment_variable() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["at_import"] == [], (
        f"read at import: {got['at_import']}; read knobs when they are used (deltackpt/options.py)"
    )
    assert "DELTACKPT_THREADS" in got["when_used"]  # the spy sees a read
    assert len(got["imported"]) > 60, got  # the walk reached the package, not just its root
    for mod in ("deltackpt.sync.sender", "deltackpt.tiers.checkpointer", "deltackpt.dcp"):
        assert mod in got["imported"]
