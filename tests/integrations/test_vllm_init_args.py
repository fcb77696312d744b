"""The vLLM trainer's init info checked before anything is sent to the engine
(``deltackpt/integrations/vllm/init_args.py``; no vLLM needed: the real ``trainer_init`` runs it
first, ``tests/integrations/test_vllm.py`` checks that with a client that must never be called)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.integrations.vllm.init_args import check_trainer_init
from deltackpt.sync import PlanError

# DeltackptTrainerInitInfo's defaults (trainer.py; that module imports vLLM)
DEFAULTS: dict[str, Any] = dict(
    rank=0, master_port=29500, master_addr="127.0.0.1", num_trainers=1, num_workers=1,
    links="auto", timeout=60.0, bucket_bytes=64 << 20, dtype=None, full_every=None,
    end_stale_update=True, tp_boxes=None, inplace=None, staging=None, undo_dir=None, quantize="auto",
)  # fmt: skip


def info(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**DEFAULTS, **kw})


def test_the_defaults_and_good_values_pass() -> None:
    assert check_trainer_init(info()) is None
    assert check_trainer_init(info(dtype="bfloat16")) is torch.bfloat16
    assert check_trainer_init(info(dtype=torch.bfloat16)) is torch.bfloat16  # on the trainer only
    ok = info(rank=1, num_trainers=2, num_workers=4, links="gloo", staging="round",
              undo_dir="memory", tp_boxes=True, inplace=False, full_every=10, dtype="float16",
              quantize="none")  # fmt: skip
    assert check_trainer_init(ok) is torch.float16


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"master_port": 0}, r"master_port=0\): expected the free TCP port"),
        ({"num_workers": 0}, r"num_workers=0\): expected an int >= 1"),
        ({"rank": 1}, r"rank=1\): expected this trainer's rank, an int in 0..0"),
        ({"links": "nccl"}, r"links='nccl'\): expected one of"),
        ({"timeout": 0}, r"SyncGroup\(timeout=0\)"),
        ({"bucket_bytes": 32}, r"\(bucket_bytes=32\): expected None .* >= align=64"),
        ({"full_every": 0}, r"full_every=0\): expected None or a number of rounds"),
        ({"staging": "arena"}, r"staging='arena'\): expected None or one of \('ring', 'round'\)"),
        ({"undo_dir": ""}, r"undo_dir=''\): expected None, a directory or 'memory'"),
        ({"tp_boxes": "yes"}, r"tp_boxes='yes'\): expected None \(the workers' variable\)"),
        ({"quantize": "fp8"}, r"quantize='fp8'\): expected one of \('auto', 'none'\)"),
        ({"dtype": "bf16x"}, r"DeltackptTrainerInitInfo\(dtype='bf16x'\): expected None, a float"),
    ],
)
def test_a_field_it_cannot_take_is_named_before_anything_is_sent(
    kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(PlanError, match=match) as e:
        check_trainer_init(info(**kw))
    assert isinstance(e.value, InvalidArgumentError)
