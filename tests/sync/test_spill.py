"""``deltackpt.sync.spill``: the old bytes of whole pieces kept in an unlinked file."""

from __future__ import annotations

import pytest
import torch

from deltackpt.errors import UndoSpillWarning
from deltackpt.sync.errors import SyncError
from deltackpt.sync.spill import Spilled, UndoSpill, keep_old, open_spill, ram_filesystem


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


def test_a_spill_that_cannot_be_written_keeps_the_bytes_in_memory(tmp_path):
    spill = UndoSpill(tmp_path)
    t = torch.arange(12, dtype=torch.float32)
    assert isinstance(keep_old(t, spill), Spilled)
    spill.close()  # as a full disk would: the write fails
    with pytest.warns(UndoSpillWarning, match="kept in memory"):
        old = keep_old(t, spill)
    assert isinstance(old, torch.Tensor) and torch.equal(old, t)
    assert old.data_ptr() != t.data_ptr()
    assert isinstance(keep_old(t, None), torch.Tensor)  # no undo_dir: in memory


def test_a_receiver_whose_undo_dir_is_unusable_keeps_undo_in_memory(tmp_path):
    from deltackpt import sync

    class G:
        rank, trainers, links = 1, [0], "gloo"

    missing = tmp_path / "gone"
    with pytest.warns(UndoSpillWarning, match="cannot create the undo file"):
        assert open_spill(str(missing)) is None
    rc = sync.WeightReceiver(G(), staging="ring", undo_dir=missing)  # type: ignore[arg-type]
    with pytest.warns(UndoSpillWarning):
        assert rc._round_spill() is None
    assert rc.undo_dir is None  # told once; in memory from then on
    good = sync.WeightReceiver(G(), staging="ring", undo_dir=tmp_path)  # type: ignore[arg-type]
    first = good._round_spill()
    assert first is not None and good._round_spill() is first  # no live undo: reused
    good._undo_spill = first  # a round's undo lives in it: the next round takes the other
    second = good._round_spill()
    assert second is not None and second is not first and good.spilled_bytes == 0


def test_a_host_target_without_a_file_is_kept_as_a_copy():
    t = torch.randn(10, 6)
    old = keep_old(t[:, 2:4], None)
    assert isinstance(old, torch.Tensor) and torch.equal(old, t[:, 2:4])
    t.zero_()
    assert old.abs().sum() > 0  # a copy, not a view


@pytest.mark.gpu
@pytest.mark.parametrize("room", [True, False])
@pytest.mark.parametrize("with_file", [True, False])
def test_a_device_target_keeps_its_bytes_on_the_device_only_where_it_has_room(
    tmp_path, monkeypatch, room, with_file
):
    import deltackpt.sync.spill as spill_mod

    monkeypatch.setattr(spill_mod, "device_room", lambda device, n: room)
    spill = UndoSpill(tmp_path) if with_file else None
    t = torch.randn(64, 48, device="cuda").to(torch.bfloat16)
    box = t[:, 16:32]  # a tensor-parallel column box
    was = box.clone()
    old = keep_old(box, spill)
    if room:  # a second copy where the target is
        assert isinstance(old, torch.Tensor) and old.device.type == "cuda"
    elif with_file:
        assert isinstance(old, Spilled) and spill is not None and spill.nbytes == box.numel() * 2
    else:  # on the host: the device's memory is left to the engine
        assert isinstance(old, torch.Tensor) and old.device.type == "cpu"
    t.fill_(0)
    if isinstance(old, Spilled):
        old.restore(box)
    else:
        box.copy_(old)
    assert torch.equal(box, was)
