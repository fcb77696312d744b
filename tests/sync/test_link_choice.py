"""``SyncGroup(links="auto")`` (deltackpt/sync/link_choice.py): ipc links where every rank maps
rank 0's shared memory and ``/dev/shm`` has room, gloo otherwise, the same choice on every rank.

* real processes on this host: the default takes ipc links, says why, and a full and a delta
  round arrive bit-exact; a ``reconnect`` chooses again;
* the choice itself, its ranks as threads over a dict standing in for the store: a rank that
  cannot map the probe (another host or container), a ``/dev/shm`` without room, a rank 0 that
  cannot make shared memory, all give gloo with a reason that names the cause, and the probe's
  file is gone once chosen;
* the probe's handle comes from the store and is checked as a bucket's: a name that is not
  PyTorch's, a file or a manager socket that is not there (another ``/dev/shm`` or ``/tmp``), a
  wrong size or token are a no, never an error; a choice that is not one is a typed error.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading
from typing import Any

import pytest

from deltackpt.sync import SyncError
from deltackpt.sync.link_choice import (
    LinkChoice,
    _decide,
    _make_probe,
    choose_links,
    read_probe,
    shm_need,
)
from tests._dist import free_port, spawn
from tests.sync._common import make_state, mismatches, wants_for

pytestmark = pytest.mark.multiproc

BUCKET = 8 << 10


# ---- real processes -----------------------------------------------------------------------


def _trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", ports[0], 0, 2, [0], timeout=60)  # links="auto"
    out: dict[str, Any] = {"links": [(group.links, group.links_reason)]}
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    out["ipc"] = group._ipc is not None
    out["full"] = sender.push(make_state(1), version=1).full
    out["delta"] = sender.push(make_state(2), version=2).full
    group.reconnect(ports[1])
    out["links"].append((group.links, group.links_reason))
    out["after"] = sender.push(make_state(3), version=3).full
    group.close()
    return out


def _receiver(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", ports[0], 1, 2, [0], timeout=60)
    out: dict[str, Any] = {"links": [group.links]}
    wants = wants_for(("full",))
    loaded: dict[str, Any] = {}
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    bad = []
    for v in (1, 2):
        receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
        bad += mismatches(wants, loaded, ("full",), v)
    group.reconnect(ports[1])
    out["links"].append(group.links)
    receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
    out["bad"] = bad + mismatches(wants, loaded, ("full",), 3)
    group.close()
    return out


def test_the_default_takes_ipc_links_between_processes_of_one_host() -> None:
    ports = [free_port(), free_port()]
    res = spawn([(_trainer, (ports,)), (_receiver, (ports,))], timeout=120, fast_exit=True)
    trainer, receiver = (o.unwrap() for o in res)
    for links, reason in trainer["links"]:  # chosen at the connection and at the reconnect
        assert links == "ipc"
        assert reason.startswith("links='auto': every rank shares /dev/shm"), reason
        assert "MB free" in reason
    assert trainer["ipc"] and receiver["links"] == ["ipc", "ipc"]
    assert (trainer["full"], trainer["delta"], trainer["after"]) == (True, False, True)
    assert receiver["bad"] == []


# ---- the choice, over a stand-in store ----------------------------------------------------


class DictStore:
    """The three store calls choose_links makes, for ranks that are threads of this process."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.data[key] = value.encode()
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            return self.data[key]

    def wait(self, keys: list[str], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout=10):
                raise TimeoutError(what)


def _choose(
    need: int = 0, blind: tuple[int, ...] = (), world: int = 3, shm_dir: str = "/dev/shm"
) -> list[LinkChoice | BaseException]:
    """Every rank's choice, the ranks in ``blind`` unable to map rank 0's shared memory."""
    store = DictStore()
    out: list[LinkChoice | BaseException] = [RuntimeError("did not return")] * world

    def rank(r: int) -> None:
        can_map = (lambda posted: False) if r in blind else read_probe
        try:
            out[r] = choose_links(
                store.set, store.get, store.wait, r, world, need, can_map=can_map, shm_dir=shm_dir
            )
        except BaseException as e:  # returned to the test, which asserts on it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def _mine() -> set[str]:
    """This process's PyTorch shared-memory files."""
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


def test_every_rank_takes_the_same_choice() -> None:
    before = _mine()
    got = _choose(need=1000)
    assert all(c == got[0] for c in got), got
    assert isinstance(got[0], LinkChoice) and got[0].links == "ipc"
    assert _mine() <= before  # the probe's file went with its last mapping


def test_a_rank_that_cannot_map_the_probe_gets_everyone_gloo() -> None:
    """Rank 2 cannot map rank 0's tensor (another host, or a container of its own)."""
    got = _choose(blind=(2,))
    assert all(isinstance(c, LinkChoice) and c.links == "gloo" for c in got), got
    assert isinstance(got[0], LinkChoice)
    assert "rank(s) 2 cannot map rank 0's shared memory" in got[0].reason


def test_a_shm_without_room_for_the_buckets_gets_gloo() -> None:
    free = shutil.disk_usage("/dev/shm").free
    got = _choose(need=free, world=2)  # ipc wants twice the need free
    assert isinstance(got[1], LinkChoice) and got[1].links == "gloo"
    assert "MB free" in got[1].reason and "docker run --shm-size" in got[1].reason
    # what the need counts: a ring per trainer-receiver pair, no host bytes for CUDA buckets
    assert shm_need(2, 3, 2, 1 << 20, on_cuda=False) == 6 * ((1 << 20) + 2 * (1 << 20))
    assert shm_need(2, 3, None, 1 << 20, on_cuda=False) == shm_need(2, 3, 2, 1 << 20, False)
    assert shm_need(1, 1, 2, 1 << 30, on_cuda=True) == 1 << 20


def test_what_the_probe_maps_is_checked_like_a_bucket() -> None:
    """The handle comes from the store: a name that is not PyTorch's, a file that is not there
    (another /dev/shm), a manager socket that is not there (another /tmp), a wrong size or a
    token that does not match are a no, never an error or a path followed."""
    probe, posted = _make_probe()
    assert probe is not None and read_probe(posted)
    doc = json.loads(posted["handle"])

    def with_(**change: Any) -> dict[str, str]:
        return {**posted, "handle": json.dumps({**doc, **change})}

    assert not read_probe(with_(name="/../../etc/passwd"))
    assert not read_probe(with_(name="/torch_1_1_999999"))  # no such file here
    assert not read_probe(with_(manager="/tmp/no-such-dir/manager.sock"))
    assert not read_probe(with_(numel=4096, storage=4096))
    assert not read_probe({**posted, "token": "0" * 32})
    assert not read_probe({**posted, "token": "../x"})
    assert not read_probe(["not", "a", "probe"])
    assert not read_probe({"handle": "{not json", "token": posted["token"]})


def test_a_rank_0_without_shared_memory_gets_gloo() -> None:
    choice = _decide(False, [], 0, 0, "/dev/shm")
    assert choice.links == "gloo" and "rank 0 cannot make shared memory" in choice.reason


def test_a_choice_that_is_not_one_is_a_typed_error() -> None:
    """A store whose links/chosen was written by something else (another version)."""
    store = DictStore()
    store.set("links/probe", json.dumps({}))
    store.set("links/chosen", json.dumps(["nccl", "?"]))
    with pytest.raises(SyncError, match=r"holds \['nccl', '\?'\] as rank 0's choice"):
        choose_links(store.set, store.get, store.wait, 1, 2, 0)


def test_groups_that_ask_for_links_by_name_do_not_probe() -> None:
    from deltackpt import sync

    port = free_port()
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        out[r] = sync.SyncGroup("127.0.0.1", port, r, 2, [0], timeout=10, links="gloo")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        for g in out:
            assert g.links == "gloo" and g.links_reason == "links='gloo' was asked for"
            assert not g.guard("check", lambda g=g: g.store.check(["links/probe"]))
    finally:
        for g in out:
            if g is not None:
                g.close()
