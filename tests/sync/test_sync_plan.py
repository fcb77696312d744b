"""The bucket planner: a pure function, so plain unit tests."""

from __future__ import annotations

import math

import pytest

from deltackpt.sync.errors import PlanError
from deltackpt.sync.plan import Plan, SenderManifest, ShardEntry, build_plan, segments


def full(name: str, shape: tuple[int, ...], dtype: str = "float32") -> ShardEntry:
    return ShardEntry(name, dtype, shape, (0,) * len(shape), shape)


def box(
    name: str,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    local: tuple[int, ...],
    dtype: str = "float32",
) -> ShardEntry:
    return ShardEntry(name, dtype, shape, offset, local)


def manifest(
    entries: list[ShardEntry], rank: int = 0, bucket_bytes: int = 4096, align: int = 256
) -> SenderManifest:
    return SenderManifest(rank, bucket_bytes, align, tuple(entries))


def check_layout(plan: Plan) -> None:
    """Invariants every plan must hold."""
    covered: dict[int, int] = {}
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes
        end = 0
        for p in b.pieces:
            assert p.bucket_offset % plan.align == 0 and p.bucket_offset >= end
            assert p.owner == b.owner
            end = p.bucket_offset + p.nbytes
            covered[p.tensor] = covered.get(p.tensor, 0) + p.count
        assert end == b.nbytes
    for t in plan.tensors:
        assert covered.get(t.index, 0) == math.prod(t.shape), t.name
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    offsets = plan.arena_offsets(plan.buckets)
    assert offsets[-1] + plan.buckets[-1].nbytes <= plan.arena_bytes


def test_plan_is_deterministic_aligned_and_covers_everything() -> None:
    m = manifest(
        [
            full("a", (10, 10)),
            full("b", (3,), "float16"),
            full("c", (700,)),
            full("d", (10, 10), "int64"),
        ]
    )
    p1, p2 = build_plan([m]), build_plan([m])
    assert p1 == p2 and p1.plan_id == p2.plan_id
    check_layout(p1)
    assert [t.name for t in p1.tensors] == ["a", "b", "c", "d"]
    # a (400 B) + b (6 B at 512) fit; c (2800 B at 768) too; d (800 B at 3584) does not
    assert [[p.tensor for p in b.pieces] for b in p1.buckets] == [[0, 1, 2], [3]]
    assert [p.bucket_offset for p in p1.buckets[0].pieces] == [0, 512, 768]
    assert p1.total_bytes == 768 + 2800 + 800 and p1.capacity == 768 + 2800


def test_plan_changes_id_when_the_manifest_changes() -> None:
    a = build_plan([manifest([full("a", (10,))])])
    b = build_plan([manifest([full("a", (11,))])])
    assert a.plan_id != b.plan_id


def test_tensor_larger_than_a_bucket_is_split_into_rows_of_its_own() -> None:
    plan = build_plan(
        [
            manifest(
                [full("small", (4,)), full("big", (3500,)), full("after", (4,))], bucket_bytes=4096
            )
        ]
    )
    check_layout(plan)
    big = [p for b in plan.buckets for p in b.pieces if plan.tensors[p.tensor].name == "big"]
    assert [(p.start, p.count) for p in big] == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 428)]
    assert not any(p.whole for p in big)
    assert [[plan.tensors[p.tensor].name for p in b.pieces] for b in plan.buckets] == [
        ["small"],
        ["big"],
        ["big"],
        ["big"],
        ["big"],
        ["after"],
    ]


def test_subset_layout_packs_only_the_selected_tensors() -> None:
    entries = [full(f"base{i}", (200,)) for i in range(20)]
    entries[3::5] = [full(f"lora{i}", (8,)) for i in range(4)]  # small, interleaved
    plan = build_plan([manifest(entries, bucket_bytes=4096)])
    lora = [t.index for t in plan.tensors if t.name.startswith("lora")]
    delta = plan.layout(lora)
    assert len(delta) == 1 < len(plan.buckets)  # the four adapters share one bucket
    assert [plan.tensors[p.tensor].name for p in delta[0].pieces] == [
        "lora0",
        "lora1",
        "lora2",
        "lora3",
    ]
    assert all(p.whole for p in delta[0].pieces)
    assert plan.layout(None) == plan.buckets == plan.layout(range(len(plan.tensors)))
    assert plan.layout([]) == ()
    offsets = plan.arena_offsets(delta)
    assert offsets == [0] and delta[0].nbytes <= plan.arena_bytes


def test_many_tiny_tensors_share_buckets() -> None:
    plan = build_plan([manifest([full(f"t{i}", (1,)) for i in range(1000)], bucket_bytes=4096)])
    check_layout(plan)
    assert len(plan.buckets) == math.ceil(1000 / (4096 // 256))
    assert all(p.whole for b in plan.buckets for p in b.pieces)


def test_shards_of_two_senders_form_rows_and_replicas_are_sent_once() -> None:
    m0 = manifest(
        [box("w", (8, 6), (0, 0), (4, 6)), full("bias", (6,)), box("col", (4, 8), (0, 0), (4, 4))],
        rank=0,
    )
    m1 = manifest(
        [box("w", (8, 6), (4, 0), (4, 6)), full("bias", (6,)), box("col", (4, 8), (0, 4), (4, 4))],
        rank=1,
    )
    plan = build_plan([m1, m0])  # order of arrival does not matter
    assert plan == build_plan([m0, m1])
    check_layout(plan)
    assert len(plan.buckets) == 2 and {b.owner for b in plan.buckets} == {0, 1}
    assert plan.buckets[0].row == plan.buckets[1].row == 0
    bias = [p for b in plan.buckets for p in b.pieces if plan.tensors[p.tensor].name == "bias"]
    assert len(bias) == 1 and bias[0].owner == 0 and bias[0].whole
    w = plan.tensors[0]
    assert w.name == "w" and w.num_parts == 2


def test_uneven_and_empty_shards() -> None:
    m0 = manifest([box("odd", (5, 3), (0, 0), (3, 3)), box("z", (1, 4), (0, 0), (1, 4))], 0)
    m1 = manifest([box("odd", (5, 3), (3, 0), (2, 3)), box("z", (1, 4), (1, 0), (0, 4))], 1)
    plan = build_plan([m0, m1])
    check_layout(plan)
    z = plan.tensors[1]
    assert z.num_parts == 1  # rank 1's shard of z is empty


def test_empty_and_scalar_tensors() -> None:
    plan = build_plan([manifest([full("e", (0, 4)), full("s", ())])])
    check_layout(plan)
    pieces = plan.buckets[0].pieces
    assert [(p.nbytes, p.whole) for p in pieces] == [(0, True), (4, True)]


@pytest.mark.parametrize(
    ("manifests", "match"),
    [
        ([manifest([box("w", (8,), (0,), (4,))])], r"'w' \[8\]: the senders' shards cover 4 of 8"),
        (
            [manifest([box("w", (8,), (0,), (6,))], 0), manifest([box("w", (8,), (4,), (4,))], 1)],
            "overlaps",
        ),
        (
            [manifest([full("w", (8,))], 0), manifest([full("w", (8,), "float16")], 1)],
            "sender rank 0 has float32",
        ),
        (
            [manifest([full("w", (8,))], 0), manifest([full("w", (8,))], 1, bucket_bytes=8192)],
            "bucket_bytes",
        ),
        ([manifest([full("w", (8,)), full("w", (8,))])], "twice"),
        ([manifest([box("w", (8,), (6,), (4,))])], "does not fit"),
        ([manifest([full("w", (8,), "float99")])], "unknown dtype"),
        ([manifest([full("w", (8,))], align=100)], "power of two"),
    ],
)
def test_plan_errors_name_the_tensor_and_the_fix(
    manifests: list[SenderManifest], match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        build_plan(manifests)


def test_manifest_json_is_canonical() -> None:
    m = manifest([box("w", (8, 2), (4, 0), (4, 2)), full("b", (), "bfloat16")], rank=1)
    golden = (
        b'{"align":256,"bucket_bytes":4096,"format":1,"rank":1,"tensors":'
        b'[["w","float32",[8,2],[4,0],[4,2]],["b","bfloat16",[],[],[]]]}'
    )
    assert m.to_json() == golden
    assert SenderManifest.from_json(golden) == m
    with pytest.raises(PlanError, match="format"):
        SenderManifest.from_json(golden.replace(b'"format":1', b'"format":9'))
    with pytest.raises(PlanError, match="malformed"):
        SenderManifest.from_json(b"{not json")


def test_segments_send_large_pieces_alone_and_runs_of_small_ones_together() -> None:
    plan = build_plan(
        [
            manifest(
                [
                    full("a", (4,)),
                    full("b", (8,)),
                    full("big", (600,)),
                    full("c", (2,)),
                    full("e", (0,)),
                ],
                bucket_bytes=4096,
            )
        ]
    )
    assert plan.direct_bytes == 256  # min(1 MiB, bucket_bytes / 16), at least align
    (bucket,) = plan.buckets
    segs = segments(bucket, plan.direct_bytes)
    assert [(lo, hi, p and plan.tensors[p.tensor].name) for lo, hi, p in segs] == [
        (0, 256 + 32, None),
        (512, 512 + 2400, "big"),
        (3072, 3072 + 8, None),
    ]
