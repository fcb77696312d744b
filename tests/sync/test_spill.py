"""``deltackpt.sync.spill``: the old bytes of whole pieces kept in an unlinked file."""

from __future__ import annotations

import pytest
import torch

from deltackpt.sync.errors import SyncError
from deltackpt.sync.spill import UndoSpill, ram_filesystem


def test_kept_bytes_come_back_bit_exact_into_strided_boxes(tmp_path):
    spill = UndoSpill(tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked: nothing to clean up, even after a crash
    t = torch.randn(64, 48).to(torch.bfloat16)
    col = t[:, 16:32]  # a tensor-parallel column box: not contiguous
    row = t[8:24]
    was_col, was_row = col.clone(), row.clone()
    kept = [spill.keep(col), spill.keep(row)]
    assert spill.nbytes == (col.numel() + row.numel()) * 2
    t.fill_(0)
    for s, dst in zip(reversed(kept), (row, col), strict=True):
        s.restore(dst)
    assert torch.equal(col, was_col) and torch.equal(row, was_row)
    spill.clear()
    assert spill.nbytes == 0
    with pytest.raises(SyncError, match="already cleared"):
        kept[0].restore(col)  # a cleared file never hands back other bytes
    spill.close()


def test_ram_filesystems_are_told_apart():
    mounts = (
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "tmpfs /data/tmp tmpfs rw 0 0\n"
        "/dev/vdb /data ext4 rw 0 0\n"
    )
    assert ram_filesystem("/dev/shm/x", mounts)
    assert ram_filesystem("/data/tmp", mounts)
    assert not ram_filesystem("/data/tmpx", mounts)  # a longer name, not inside /data/tmp
    assert not ram_filesystem("/data/spill", mounts)
    assert not ram_filesystem("/var/tmp", mounts)
