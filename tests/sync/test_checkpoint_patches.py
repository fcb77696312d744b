"""``CheckpointPatcher``: a trainer's updates as checkpoint-coordinate patches (vLLM's sparse
wire format). The engine here is a dict applied the way vLLM's
``load_checkpoint_weight_patches`` applies them (a full tensor of NaNs with the patch's values
written in, then every non-NaN element copied); against a real engine:
tests/integrations/test_vllm.py (``sparse``)."""

from __future__ import annotations

import pytest
import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.sync import CheckpointPatch, CheckpointPatcher, SyncError


def apply(engine: dict[str, torch.Tensor], patches: list[CheckpointPatch]) -> None:
    """vLLM's semantics (checkpoint_weight_patch.py): dense replaces; sparse stages a
    NaN-filled full tensor, index_copy_ of the values, then ``where(isnan(src), dst, src)``."""
    for p in patches:
        if p.indices is None:
            engine[p.name] = p.values.to(p.dtype).view(p.shape).clone()
            continue
        assert p.indices.dtype == torch.int32 and p.values.ndim == 1 and p.full_shape == p.shape
        assert not torch.isnan(p.values).any()
        flat = torch.full((p.values.new_empty(p.shape).numel(),), float("nan"), dtype=p.dtype)
        flat.index_copy_(0, p.indices.long(), p.values)
        src = flat.view(p.shape)
        engine[p.name] = torch.where(torch.isnan(src), engine[p.name], src)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def holds(engine: dict[str, torch.Tensor], state: dict[str, torch.Tensor], dtype: torch.dtype):
    for k, v in state.items():
        want = v.to(dtype) if v.is_floating_point() else v
        assert engine[k].dtype == want.dtype and engine[k].shape == want.shape, k
        assert torch.equal(bits(engine[k]), bits(want)), k


def master(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),
        "layers.0.q.weight": torch.randn(64, 64, generator=g),
        "layers.0.norm.weight": torch.ones(64),
        "layers.0.mlp.weight": torch.randn(128, 64, generator=g),
        "pos_ids": torch.arange(32),
    }


def rl_step(state: dict[str, torch.Tensor], g: torch.Generator, lr: float = 1e-4) -> None:
    """An AdamW-like step on fp32 masters: every float element moves a little; a few percent
    of their bf16 casts change."""
    for v in state.values():
        if v.is_floating_point():
            v.add_(torch.randn(v.shape, generator=g) * lr * v.abs().clamp_min(1e-3))


def test_an_rl_step_goes_as_the_changed_bf16_elements_and_the_engine_ends_bit_exact() -> None:
    state, g = master(), torch.Generator().manual_seed(1)
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    first = patcher.diff(state)
    assert first.version == 1 and first.base is None and not first.sparse
    assert {p.name for p in first.dense} == set(state)  # the seed: every tensor dense
    assert all(p.dtype == (torch.bfloat16 if state[p.name].is_floating_point() else torch.int64)
               for p in first.dense)  # fmt: skip
    engine: dict[str, torch.Tensor] = {}
    apply(engine, first.dense)
    patcher.commit(first)
    assert patcher.version == 1 and patcher.held_bytes == first.full_bytes
    for step in range(2, 5):
        rl_step(state, g)
        rnd = patcher.diff(state)
        assert rnd.version == step and rnd.base == step - 1
        assert rnd.full_bytes == first.full_bytes  # every tensor counted, sent or not
        assert not rnd.dense and "pos_ids" in rnd.unchanged  # unchanged ints are not re-sent
        assert {p.name for p in rnd.sparse} >= {"embed.weight", "layers.0.q.weight"}
        assert 0 < rnd.nbytes < rnd.full_bytes / 4  # a few % of the elements, 6 bytes each
        assert all(p.indices.dtype == torch.int32 for p in rnd.sparse)  # vLLM's wire type
        apply(engine, rnd.dense)
        apply(engine, rnd.sparse)
        patcher.commit(rnd)
        holds(engine, state, torch.bfloat16)


def test_the_changes_are_found_in_the_wire_dtype_not_the_masters() -> None:
    g = torch.Generator().manual_seed(9)
    # fp32 masters that sit on bf16 values: a relative nudge of 2**-20 moves every one of them
    # and leaves every bf16 cast where it was (half a bf16 step away from any rounding change)
    state = {"w": torch.randn(4096, generator=g).to(torch.bfloat16).float()}
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    patcher.commit(patcher.diff(state))
    before = state["w"].clone()
    state["w"] *= 1 + 2**-20
    assert (state["w"] != before).sum() == (before != 0).sum()  # every nonzero fp32 moved
    rnd = patcher.diff(state)
    assert rnd.unchanged == ["w"] and rnd.nbytes == 0
    patcher.commit(rnd)
    own = CheckpointPatcher()  # dtype None: each tensor's own, so fp32 changes everywhere
    own.commit(own.diff(state))
    state["w"] += 1e-3
    assert own.diff(state).why_dense == {"w": "more than 0.125 of its elements changed"}


def test_what_goes_dense_and_why() -> None:
    state = master()
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    engine: dict[str, torch.Tensor] = {}
    rnd = patcher.diff(state)
    apply(engine, rnd.dense)
    patcher.commit(rnd)
    state["layers.0.q.weight"] *= 3  # every element
    state["layers.0.mlp.weight"][0, :5] = float("nan")  # vLLM's marker as a value
    state["pos_ids"][3] = 99  # an int tensor that changed
    state["embed.weight"] = torch.randn(301, 64, generator=torch.Generator().manual_seed(1))
    state["new.bias"] = torch.zeros(64)  # a name the engine never had from us
    rnd = patcher.diff(state)
    assert rnd.why_dense == {
        "layers.0.q.weight": "more than 0.125 of its elements changed",
        "layers.0.mlp.weight": "a changed value is NaN (vLLM's unchanged-element marker)",
        "pos_ids": "torch.int64 cannot be masked with NaN",
        "embed.weight": "its dtype, size or device changed",
    }
    assert {p.name for p in rnd.dense} == set(rnd.why_dense) | {"new.bias"}
    assert rnd.unchanged == ["layers.0.norm.weight"] and not rnd.sparse
    apply(engine, rnd.dense)
    patcher.commit(rnd)
    holds(engine, state, torch.bfloat16)


def test_a_round_that_failed_part_way_is_resent_dense_so_no_element_is_left_behind() -> None:
    """The trap: an engine that applied part of round 2, then a trainer whose next state moved
    some of those elements back. Diffed against the committed base (round 1) they look
    unchanged and would never be re-sent."""
    g = torch.Generator().manual_seed(2)
    state = {"a": torch.randn(2048, generator=g), "b": torch.randn(2048, generator=g)}
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    engine: dict[str, torch.Tensor] = {}
    r1 = patcher.diff(state)
    apply(engine, r1.dense)
    patcher.commit(r1)
    v1 = {k: v.clone() for k, v in state.items()}
    state["a"][:40] += 1.0
    state["b"][:40] += 1.0
    r2 = patcher.diff(state)
    apply(engine, [p for p in r2.sparse if p.name == "a"])  # "a" landed, then it failed
    patcher.abandon(r2)  # unknown how much landed: every tensor it carried goes dense
    state = {k: v.clone() for k, v in v1.items()}  # the trainer rewound to round 1's weights
    partial = patcher.diff({"b": state["b"]})  # a round without "a": "a" stays owed
    patcher.commit(partial)
    r3 = patcher.diff(state)
    assert partial.why_dense == {"b": "a failed round carried it"} and partial.version == 2
    assert r3.base == 2 and r3.version == 3  # the version line continues from the committed
    assert r3.why_dense == {"a": "a failed round carried it"} and r3.unchanged == ["b"]
    apply(engine, partial.dense)
    apply(engine, r3.dense)
    patcher.commit(r3)
    holds(engine, state, torch.bfloat16)
    # nothing reached the engine: the next round stays sparse against the committed base
    state["a"][:8] += 1.0
    r4 = patcher.diff(state)
    patcher.abandon(r4, applied=False)
    r5 = patcher.diff(state)
    assert [p.name for p in r5.sparse] == ["a"] and not r5.dense
    apply(engine, r5.sparse)
    patcher.commit(r5)
    holds(engine, state, torch.bfloat16)


def test_anchor_rounds_and_reset_send_every_tensor_dense() -> None:
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(4096, generator=g)}
    patcher = CheckpointPatcher(dtype=torch.bfloat16, anchor_every=2)
    kinds = []
    for _ in range(5):
        rl_step(state, g)
        rnd = patcher.diff(state)
        kinds.append("dense" if rnd.dense else "sparse")
        patcher.commit(rnd)
    assert kinds == ["dense", "sparse", "dense", "sparse", "dense"]
    patcher.reset()
    rl_step(state, g)
    rnd = patcher.diff(state)
    assert rnd.version == 6 and rnd.base == 5 and [p.name for p in rnd.dense] == ["w"]
    assert rnd.why_dense == {}  # no base: as in a first round


def test_the_device_path_finds_the_same_patches_as_the_c_loop(monkeypatch) -> None:
    """Device tensors are diffed by torch operations where they live; run here on CPU tensors
    (the same code a GPU runs), they must give the C loop's patches element for element."""
    from deltackpt.sync import checkpoint_patches

    monkeypatch.setattr(checkpoint_patches, "DEVICE_GROUP", 20_000)  # several groups a round
    g = torch.Generator().manual_seed(4)
    rounds = []
    for on_host in (True, False):
        monkeypatch.setattr(CheckpointPatcher, "_on_host", staticmethod(lambda t, h=on_host: h))
        state = master(5)
        patcher = CheckpointPatcher(dtype=torch.bfloat16)
        patcher.commit(patcher.diff(state))
        g.manual_seed(6)
        rl_step(state, g)
        state["layers.0.q.weight"] *= 2  # dense for both: too many changed
        rnd = patcher.diff(state)
        rounds.append(rnd)
        patcher.commit(rnd)
    host, dev = rounds
    assert [p.name for p in host.sparse] == [p.name for p in dev.sparse] and host.sparse
    for a, b in zip(host.sparse, dev.sparse, strict=True):
        assert a.indices.dtype == b.indices.dtype == torch.int32
        assert torch.equal(a.indices, b.indices) and torch.equal(bits(a.values), bits(b.values))
    assert host.why_dense == dev.why_dense and host.unchanged == dev.unchanged


@pytest.mark.gpu
def test_cuda_patches_stay_on_the_device_and_match_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(7)
    state = master(8)
    cuda_state = {k: v.cuda() for k, v in state.items()}
    host, dev = CheckpointPatcher(dtype=torch.bfloat16), CheckpointPatcher(dtype=torch.bfloat16)
    host.commit(host.diff(state))
    dev.commit(dev.diff(cuda_state))
    rl_step(state, g)
    for k, v in state.items():
        cuda_state[k].copy_(v)
    a, b = host.diff(state), dev.diff(cuda_state)
    assert [p.name for p in a.sparse] == [p.name for p in b.sparse] and a.sparse
    for p, q in zip(a.sparse, b.sparse, strict=True):
        assert q.values.is_cuda and q.indices.is_cuda
        assert torch.equal(p.indices, q.indices.cpu())
        assert torch.equal(bits(p.values), bits(q.values.cpu()))
    dev.commit(b)
    host.commit(a)
    assert all(t.is_cuda for t in dev._bases.values())
    # bases="host": a device tensor's base in host memory, diffed there, its patch on the device
    homed = CheckpointPatcher(dtype=torch.bfloat16, bases="host")
    for k, v in state.items():
        cuda_state[k].copy_(v)
    homed.seed(cuda_state)
    assert all(t.device.type == "cpu" for t in homed._bases.values())
    rl_step(state, g)
    for k, v in state.items():
        cuda_state[k].copy_(v)
    got, want = homed.diff(cuda_state), host.diff(state)
    assert [p.name for p in got.sparse] == [p.name for p in want.sparse] and got.sparse
    for p, q in zip(want.sparse, got.sparse, strict=True):
        assert q.values.is_cuda and q.indices.is_cuda
        assert torch.equal(p.indices, q.indices.cpu())
        assert torch.equal(bits(p.values), bits(q.values.cpu()))


def test_rounds_are_one_at_a_time_and_versions_move_forward() -> None:
    patcher = CheckpointPatcher()
    rnd = patcher.diff({"w": torch.zeros(8)}, version=10)
    with pytest.raises(SyncError, match="round 10 is still open"):
        patcher.diff({"w": torch.zeros(8)})
    patcher.commit(rnd)
    with pytest.raises(SyncError, match="round 10 is not the open round"):
        patcher.commit(rnd)
    with pytest.raises(InvalidArgumentError, match="holds version 10; expected a later one"):
        patcher.diff({"w": torch.zeros(8)}, version=10)
    assert patcher.diff({"w": torch.zeros(8)}).version == 11


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.int8}, "expected a floating torch.dtype"),
        ({"anchor_every": -1}, "expected an int >= 0"),
        ({"sparse_below": 0}, r"expected a share in \(0, 1\]"),
        ({"threads": 0}, "expected an int >= 1"),
        ({"bases": "gpu"}, r"expected one of \['auto', 'device', 'host'\]"),
    ],
)
def test_bad_arguments_are_named(kwargs, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        CheckpointPatcher(**kwargs)


def test_bad_states_are_named() -> None:
    patcher = CheckpointPatcher()
    with pytest.raises(InvalidArgumentError, match=r"name 'w' given twice"):
        patcher.diff([("w", torch.zeros(2)), ("w", torch.zeros(2))])
    with pytest.raises(InvalidArgumentError, match="'w' is a list; expected a tensor"):
        patcher.diff({"w": [1, 2]})  # type: ignore[dict-item]


def test_a_shard_is_refused_with_the_fix(monkeypatch) -> None:
    """Patches address the whole tensor: a DTensor (a rank's shard) is named, with the fix."""
    from deltackpt.sync import checkpoint_patches

    monkeypatch.setattr(checkpoint_patches, "is_dtensor", lambda t: t.numel() == 3)
    with pytest.raises(InvalidArgumentError, match=r"'s' is a DTensor .* t.full_tensor\(\)"):
        CheckpointPatcher().diff({"w": torch.zeros(2), "s": torch.zeros(3)})


def test_an_engine_started_from_the_same_weights_is_seeded_and_gets_sparse_rounds_at_once():
    state, g = master(10), torch.Generator().manual_seed(11)
    engine = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).clone()
              for k, v in state.items()}  # fmt: skip
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    patcher.seed(state)  # nothing sent: the engine started from these weights
    assert patcher.version == 0
    rl_step(state, g)
    rnd = patcher.diff(state)
    assert rnd.version == 1 and rnd.base == 0 and not rnd.dense and rnd.sparse
    apply(engine, rnd.sparse)
    patcher.commit(rnd)
    holds(engine, state, torch.bfloat16)
    with pytest.raises(SyncError, match="already holds bases"):
        patcher.seed(state)
    patcher.reset()
    with pytest.raises(InvalidArgumentError, match="holds version 1; expected a later one"):
        patcher.seed(state, version=1)
    patcher.seed(state, version=5)
    assert patcher.diff(state).unchanged == sorted(state, key=list(state).index)


def report(engine: dict[str, torch.Tensor], rows: int | None = None) -> dict:
    """A worker's ``deltackpt_checkpoint_digests`` answer for an engine holding ``engine``
    whole (``rows``: only the first ``rows`` rows of 2-D tensors, a tensor-parallel box)."""
    from deltackpt.sync.device_digest import piece_digest

    digests = {}
    for k, v in engine.items():
        n = v.shape[0] if rows is None or v.dim() != 2 else rows
        a, b = piece_digest(v[:n].contiguous().reshape(-1).view(torch.uint8))
        digests[k] = [[0] * v.dim(), [n, *v.shape[1:]], str(a), str(b)]
    return {"digests": digests, "unchecked": ["elsewhere"], "rank": 0}


def test_check_names_the_tensors_an_engine_does_not_hold_as_committed() -> None:
    state, g = master(12), torch.Generator().manual_seed(13)
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    engine: dict[str, torch.Tensor] = {}
    rnd = patcher.diff(state)
    apply(engine, rnd.dense)
    patcher.commit(rnd)
    got = patcher.check([report(engine), {**report(engine, rows=8), "rank": 1}])
    assert got.ok and got.checked == 2 * len(state) and got.version == 1
    assert got.unchecked == ["elsewhere"]  # a name no worker placed
    rl_step(state, g)
    rnd = patcher.diff(state)
    with pytest.raises(SyncError, match="round 2 is open"):
        patcher.check([report(engine)])
    apply(engine, [p for p in rnd.sparse if p.name != "embed.weight"])  # a partial update
    patcher.commit(rnd)
    got = patcher.check([report(engine)])
    assert not got.ok and got.mismatched == {0: ["embed.weight"]}
    bad = report(engine)
    bad["digests"]["embed.weight"][1] = [999, 64]  # a box outside the tensor
    with pytest.raises(SyncError, match=r"worker 0 reported .* for 'embed.weight': box"):
        patcher.check([bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_state_is_not_kept_alive(dtype) -> None:
    """A trainer that gathers one tensor at a time hands ``diff`` a generator: the patcher keeps
    each tensor's patch (or its own dense copy), never the tensor it was given or its cast."""
    import weakref

    src = {f"{k}.{i}": v.clone() for i in range(4) for k, v in master(14).items()}
    g = torch.Generator().manual_seed(15)
    given: list[weakref.ref] = []
    alive: list[int] = []  # tensors given earlier and still alive, before each next one

    def gathered():
        for k, v in src.items():  # (tensors hold no cycles: freed when the last ref goes)
            alive.append(sum(r() is not None for r in given))
            t = (v.to(dtype) if v.is_floating_point() else v).clone()  # a fresh "gathered" copy
            given.append(weakref.ref(t))
            yield k, t
            del t

    patcher = CheckpointPatcher(dtype=torch.bfloat16, threads=2)
    engine: dict[str, torch.Tensor] = {}
    for step in range(3):
        if step:
            rl_step(src, g)
        given.clear()
        alive.clear()
        rnd = patcher.diff(gathered())
        # at most the pool's window (2 x threads in flight, one being handed over) alive
        assert len(alive) == len(src) and max(alive) <= 2 * 2 + 1, alive
        apply(engine, rnd.dense)
        apply(engine, rnd.sparse)
        patcher.commit(rnd)
        want = {k: v.to(dtype) if v.is_floating_point() else v for k, v in src.items()}
        holds(engine, want, torch.bfloat16)


def test_a_dense_patch_goes_as_a_sparse_one_where_it_can() -> None:
    """For a link that carries sparse patches only: every element listed, vLLM's apply then
    gives the same tensor; NaN values and integer tensors are refused by name."""
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    state = master(16)
    state["layers.0.mlp.weight"][0, 0] = float("nan")
    rnd = patcher.diff(state)
    engine = {k: torch.zeros_like(v, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype)
              for k, v in state.items()}  # fmt: skip
    ok = [p for p in rnd.dense if p.name not in ("layers.0.mlp.weight", "pos_ids")]
    sparse = [p.as_sparse() for p in ok]
    assert all(s.indices is not None and s.indices.numel() == s.values.numel() for s in sparse)
    assert sparse[0].as_sparse() is sparse[0]
    apply(engine, sparse)
    holds(engine, {p.name: state[p.name] for p in ok}, torch.bfloat16)
    by_name = {p.name: p for p in rnd.dense}
    with pytest.raises(InvalidArgumentError, match=r"'layers\.0\.mlp\.weight' cannot go .* NaN"):
        by_name["layers.0.mlp.weight"].as_sparse()
    with pytest.raises(InvalidArgumentError, match=r"'pos_ids' cannot go .* torch\.int64"):
        by_name["pos_ids"].as_sparse()
