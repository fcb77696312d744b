"""In-place commits (``deltackpt/integrations/vllm/inplace.py``) on stand-ins of vLLM's modules
(same class names and attributes, plain torch: no vLLM needed). The real engine runs the same
code in test_vllm.py (one worker, linear weights kept) and test_vllm_tp.py (TP=2)."""

from __future__ import annotations

import pytest
import torch

from deltackpt.integrations.vllm import inplace
from deltackpt.sync.schedule_decl import Box

H, HEADS, KV, HD, FF = 16, 2, 1, 4, 24  # hidden, heads, kv heads, head size, mlp


class QKVParallelLinear(torch.nn.Module):
    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp, rank
        self.num_heads, self.num_kv_heads = HEADS // tp, KV
        self.total_num_heads, self.total_num_kv_heads = HEADS, KV
        self.num_kv_head_replicas = max(1, tp // KV)
        self.head_size = self.v_head_size = HD
        rows = (self.num_heads + 2 * KV) * HD
        self.weight = torch.nn.Parameter(torch.zeros(rows, H, dtype=torch.bfloat16), False)
        self.bias = torch.nn.Parameter(torch.zeros(rows, dtype=torch.bfloat16), False)


class MergedColumnParallelLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.output_sizes = 1, 0, [FF, FF]
        self.weight = torch.nn.Parameter(torch.zeros(2 * FF, H, dtype=torch.bfloat16), False)


class RowParallelLinear(torch.nn.Module):
    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.input_size_per_partition = tp, rank, FF // tp
        self.weight = torch.nn.Parameter(torch.zeros(H, FF // tp, dtype=torch.bfloat16), False)


class RMSNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16), False)


class Layer(torch.nn.Module):
    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(tp, rank)
        self.gate_up_proj = MergedColumnParallelLinear()
        self.down_proj = RowParallelLinear(tp, rank)
        self.norm = RMSNorm()


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}  # fmt: skip

    def __init__(self, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(tp, rank)])


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    p = "layers.0."
    return {
        p + "q_proj.weight": r(HEADS * HD, H), p + "k_proj.weight": r(KV * HD, H),
        p + "v_proj.weight": r(KV * HD, H), p + "q_proj.bias": r(HEADS * HD),
        p + "k_proj.bias": r(KV * HD), p + "v_proj.bias": torch.zeros(KV * HD, dtype=torch.bfloat16),
        p + "gate_proj.weight": r(FF, H), p + "up_proj.weight": r(FF, H),
        p + "down_proj.weight": r(H, FF), p + "norm.weight": r(H),
    }  # fmt: skip


def load(model: Model, sd: dict[str, torch.Tensor]) -> None:
    """What vLLM's loaders do at tp 1: fuse q/k/v and gate/up along the rows."""
    L, p = model.layers[0], "layers.0."
    with torch.no_grad():
        L.qkv_proj.weight.copy_(torch.cat([sd[p + f"{x}_proj.weight"] for x in "qkv"]))
        L.qkv_proj.bias.copy_(torch.cat([sd[p + f"{x}_proj.bias"] for x in "qkv"]))
        L.gate_up_proj.weight.copy_(
            torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]])
        )
        L.down_proj.weight.copy_(sd[p + "down_proj.weight"])
        L.norm.weight.copy_(sd[p + "norm.weight"])


def load_tp(model: Model, sd: dict[str, torch.Tensor], rank: int) -> None:
    """What vLLM's loaders do at tp 2 for q/k/v (this rank's q rows, k and v whole: one kv
    head) and down_proj (this rank's columns)."""
    L, p = model.layers[0], "layers.0."
    q = sd[p + "q_proj.weight"][rank * HD : (rank + 1) * HD]
    with torch.no_grad():
        L.qkv_proj.weight.copy_(torch.cat([q, sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]]))
        L.down_proj.weight.copy_(sd[p + "down_proj.weight"][:, rank * 12 : rank * 12 + 12])


def learned(model: Model, held: dict[str, torch.Tensor]) -> dict[str, inplace.Slot]:
    slots: dict[str, inplace.Slot] = {}
    inplace.learn(model, held, list(held), {}, {}, slots)
    return slots


@pytest.fixture(params=[False, True], ids=["direct", "bounced"])
def bounce(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whole writes copied directly (parameters on the host) or, as into parameters on a GPU,
    through the two reused pinned buffers; here of 100 bytes, so a tensor goes in blocks of
    rows (and a 48-byte row of down_proj two to a block)."""
    if request.param:
        monkeypatch.setattr(inplace, "BOUNCE_ON_HOST", True)
        monkeypatch.setattr(inplace, "BOUNCE", 100)
    return bool(request.param)


def test_slots_are_learned_only_where_seen_with_distinct_values_and_writes_match_a_reload(
    bounce,
):
    model, held = Model(), checkpoint(0)
    load(model, held)
    slots = learned(model, held)
    assert set(held) - set(slots) == {"layers.0.v_proj.bias"}  # all zeros: places unknown
    new = {k: v + 1 if k != "layers.0.v_proj.bias" else v for k, v in checkpoint(1).items()}
    changed = [(k, new[k].clone()) for k in slots]
    assert inplace.usable(model, slots, [k for k, _ in changed])
    n = inplace.write(slots, held, changed)
    assert n == sum(t.numel() * 2 for _, t in changed)
    want = Model()
    load(want, held)
    for (name, got), (_, exp) in zip(
        model.named_parameters(), want.named_parameters(), strict=True
    ):
        assert torch.equal(got, exp), name


def test_a_transformed_or_replaced_parameter_loses_its_slot():
    model, held = Model(), checkpoint(0)
    load(model, held)
    with torch.no_grad():  # a loader that transforms (e.g. a norm stored as w - 1)
        model.layers[0].norm.weight.sub_(1)
    slots = learned(model, held)
    assert "layers.0.norm.weight" not in slots and "layers.0.down_proj.weight" in slots
    model.layers[0].down_proj.weight = torch.nn.Parameter(held["layers.0.down_proj.weight"].clone())
    assert not inplace.usable(model, slots, ["layers.0.down_proj.weight"])
    assert inplace.usable(model, slots, ["layers.0.q_proj.weight"])


def test_a_kernel_with_its_own_copy_is_never_written_in_place():
    model, held = Model(), checkpoint(0)
    load(model, held)
    kernel = model.layers[0].down_proj.weight.detach().clone()
    model.layers[0].down_proj.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, kernel, b)
    model.layers[0].gate_up_proj.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)
    model.layers[0].norm.cached = model.layers[0].norm.weight.detach().float()
    slots = learned(model, held)
    assert "layers.0.down_proj.weight" not in slots  # closed over a tensor
    assert "layers.0.gate_proj.weight" in slots  # closed over nothing that holds weights
    assert "layers.0.norm.weight" not in slots  # keeps a tensor beside its parameter


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_and_boxes(rank, bounce):
    """TP=2: q rows and down_proj columns of this rank; k/v replicated (1 kv head)."""
    model, held = Model(tp=2, rank=rank), checkpoint(0)
    L, p = model.layers[0], "layers.0."
    q = held[p + "q_proj.weight"][rank * HD : (rank + 1) * HD]
    with torch.no_grad():
        L.qkv_proj.weight.copy_(
            torch.cat([q, held[p + "k_proj.weight"], held[p + "v_proj.weight"]])
        )
        L.down_proj.weight.copy_(
            held[p + "down_proj.weight"][:, rank * FF // 2 : (rank + 1) * FF // 2]
        )
    names = [p + "q_proj.weight", p + "k_proj.weight", p + "down_proj.weight"]
    slots: dict[str, inplace.Slot] = {}
    inplace.learn(model, held, names, {}, {}, slots)
    assert set(slots) == set(names)
    # with tp_boxes the worker holds the box itself
    box = Box((0, rank * FF // 2), (H, FF // 2))
    boxed = {
        p + "down_proj.weight": held[p + "down_proj.weight"][:, rank * 12 : rank * 12 + 12].clone()
    }
    slots2: dict[str, inplace.Slot] = {}
    inplace.learn(model, boxed, list(boxed), {p + "down_proj.weight": (H, FF)},
                  {p + "down_proj.weight": box}, slots2)  # fmt: skip
    assert list(slots2) == [p + "down_proj.weight"]
    new = boxed[p + "down_proj.weight"] * 2
    inplace.write(slots2, boxed, [(p + "down_proj.weight", new)])
    assert torch.equal(L.down_proj.weight, new)


def test_the_switch(monkeypatch):
    assert inplace.enabled(False) is False and inplace.enabled(True) is True
    monkeypatch.setenv("DELTACKPT_VLLM_PREPARE", "0")  # a switch of its own for prepare
    assert inplace.enabled(None) is True
    assert inplace.enabled(None, "DELTACKPT_VLLM_PREPARE") is False


@pytest.mark.parametrize("rank", [0, 1])
def test_changed_elements_alone_land_where_the_whole_tensor_would(rank, monkeypatch):
    """Element-by-element writes (the receiver's changed indices) give the same parameters as
    whole-tensor writes: fused rows, this rank's columns of a whole tensor (indices outside its
    part dropped), a box held by the worker. (Only parameters on a device take element
    writes by default: forced here on the host.)"""
    monkeypatch.setattr(inplace, "SPARSE_ON_HOST", True)
    p = "layers.0."
    whole, sparse = Model(tp=2, rank=rank), Model(tp=2, rank=rank)
    held = checkpoint(0)
    for model in (whole, sparse):
        L = model.layers[0]
        q = held[p + "q_proj.weight"][rank * HD : (rank + 1) * HD]
        with torch.no_grad():
            L.qkv_proj.weight.copy_(
                torch.cat([q, held[p + "k_proj.weight"], held[p + "v_proj.weight"]])
            )
            L.down_proj.weight.copy_(held[p + "down_proj.weight"][:, rank * 12 : rank * 12 + 12])
    names = [p + "q_proj.weight", p + "v_proj.weight", p + "down_proj.weight"]
    g = torch.Generator().manual_seed(3)
    changed, elements = [], {}
    for n in names:
        t = held[n].clone()
        idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 10]
        t.view(-1)[idx] += 1
        changed.append((n, t))
        elements[n] = idx
    wrote: list[int] = []
    for model, el in ((whole, None), (sparse, elements)):
        h = dict(held)
        slots: dict[str, inplace.Slot] = {}
        inplace.learn(model, h, names, {}, {}, slots)
        assert set(slots) == set(names)
        wrote.append(inplace.write(slots, h, [(k, v.clone()) for k, v in changed], elements=el))
    assert 0 < wrote[1] < wrote[0]  # indices and values of 10% of the elements, not all
    for (name, a), (_, b) in zip(whole.named_parameters(), sparse.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # and both hold the new bytes of this rank's part
    new = dict(changed)[p + "down_proj.weight"][:, rank * 12 : rank * 12 + 12]
    assert torch.equal(sparse.layers[0].down_proj.weight, new)


def _rl_step(held: dict[str, torch.Tensor], names: list[str], seed: int = 3):
    """New bytes of ``names``: a tenth of each tensor's elements changed, and their indices."""
    g = torch.Generator().manual_seed(seed)
    changed, elements = [], {}
    for n in names:
        t = held[n].clone()
        idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 10].sort().values
        t.view(-1)[idx] += 1
        changed.append((n, t))
        elements[n] = idx
    return changed, elements


ELEMENT_NAMES = ["layers.0.q_proj.weight", "layers.0.v_proj.weight", "layers.0.down_proj.weight"]


@pytest.mark.parametrize("rank", [0, 1])
def test_element_writes_prepared_ahead_land_as_those_made_at_the_commit(rank, monkeypatch):
    """A staged round's element writes moved to the parameters' device before the commit
    (``inplace.prepare``, off the pause; indices as int32) give the same parameters and bytes
    as those gathered and moved at the commit; a tensor prepared from other bytes (a rollback
    writes the old ones) or for a slot learned anew is written from what the commit gets."""
    monkeypatch.setattr(inplace, "SPARSE_ON_HOST", True)  # the CPU cover of device parameters
    models, held = [Model(tp=2, rank=rank) for _ in range(4)], checkpoint(0)
    sd = {n: t.clone() for n, t in held.items()}
    for m in models:
        load_tp(m, sd, rank)
    changed, elements = _rl_step(held, ELEMENT_NAMES)
    wrote, prep = [], None
    for i, m in enumerate(models):
        h = {n: t.clone() for n, t in held.items()}
        slots: dict[str, inplace.Slot] = {}
        inplace.learn(m, h, list(h), {}, {}, slots)
        mine = [(n, t.clone()) for n, t in changed]
        prep = inplace.prepare(slots, mine, elements) if i else None
        if prep is not None:
            assert set(prep.writes) == set(ELEMENT_NAMES)
            assert all(w.at.dtype == torch.int64 for w in prep.writes.values())
            assert 0 < prep.device_bytes <= sum(i.numel() * 10 for i in elements.values())
        if i == 2:  # a rollback: the old bytes of the same elements, not the prepared ones
            mine = [(n, held[n].clone()) for n, _ in mine]
        if i == 3:  # a slot learned anew since: not used
            inplace.learn(m, h, [ELEMENT_NAMES[0]], {}, {}, slots)
        wrote.append(inplace.write(slots, h, mine, elements=elements, prepared=prep))
    assert wrote[0] == wrote[1] == wrote[3] > 0
    for name, p in models[0].named_parameters():
        assert torch.equal(p, dict(models[1].named_parameters())[name]), name
        assert torch.equal(p, dict(models[3].named_parameters())[name]), name
    # the tensors the commit got, not the prepared ones: the model as it was
    was = Model(tp=2, rank=rank)
    load_tp(was, sd, rank)
    for name, p in models[2].named_parameters():
        assert torch.equal(p, dict(was.named_parameters())[name]), name


def test_a_prepared_write_is_used_once(monkeypatch):
    """A rollback puts the old bytes back into the very tensors a staged round prepared from
    and writes them with the same elements: it must write those bytes, not the prepared."""
    monkeypatch.setattr(inplace, "SPARSE_ON_HOST", True)
    model, held = Model(), checkpoint(0)
    load(model, held)
    slots = learned(model, held)
    changed, elements = _rl_step(held, ELEMENT_NAMES)
    old = {n: held[n].clone() for n in ELEMENT_NAMES}
    prepared = inplace.prepare(slots, changed, elements)
    assert set(prepared.writes) == set(ELEMENT_NAMES)
    h = dict(held)
    inplace.write(slots, h, changed, elements=elements, prepared=prepared)
    for n, t in changed:  # revert() writes the old bytes into the same tensors
        t.copy_(old[n])
    inplace.write(slots, h, changed, elements=elements, prepared=prepared)
    was = Model()
    load(was, checkpoint(0))
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(was.named_parameters())[name]), name


@pytest.mark.parametrize("why", ["no room counted", "the allocation fails"])
def test_no_room_on_the_device_prepares_nothing(why, monkeypatch):
    """No room beside the engine: none counted (``cuda.serving_room``), or counted but the device
    memory not had all the same (unused memory torch holds that a new block cannot take: an
    out-of-memory error while preparing): nothing prepared, the commit writes as before."""
    monkeypatch.setattr(inplace, "SPARSE_ON_HOST", True)
    if why == "no room counted":
        monkeypatch.setattr(inplace.cuda, "serving_room", lambda device, nbytes: False)
    else:

        def no_memory(*args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")

        monkeypatch.setattr(inplace.cuda, "serving_room", lambda device, nbytes: True)
        monkeypatch.setattr(inplace, "_positions", no_memory)
    model, held = Model(), checkpoint(0)
    load(model, held)
    slots = learned(model, held)
    changed, elements = _rl_step(held, ELEMENT_NAMES)
    assert inplace.prepare(slots, changed, elements).writes == {}


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["whole", "elements", "prepared"])
def test_parameters_on_the_gpu_take_host_held_tensors(how, monkeypatch):
    """As on a GPU worker: parameters on the device, the receiver's copies on the host; a
    changed tensor written whole, element by element, or from elements moved to the device
    ahead of the commit (a staged round's ``inplace.prepare``), which asks for room for what it
    holds at its peak (up to the allocator's 512-byte rounding of each of its few blocks)."""
    asked: list[int] = []

    def room(device: torch.device, nbytes: int) -> bool:  # a busy GPU: room said, noted
        asked.append(nbytes)
        return True

    monkeypatch.setattr(inplace.cuda, "serving_room", room)
    model, held = Model().cuda(), checkpoint(0)
    load(model, held)
    slots = learned(model, held)
    name = "layers.0.k_proj.weight"
    new = held[name].clone()
    idx = torch.arange(0, new.numel(), 7)
    new.view(-1)[idx] += 1
    elements = None if how == "whole" else {name: idx}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prepared = inplace.prepare(slots, [(name, new)], elements) if how == "prepared" else None
    if prepared is not None:
        w = prepared.writes[name]
        assert w.at.is_cuda and w.vals.is_cuda and w.at.dtype == torch.int64
        peak = torch.cuda.max_memory_allocated() - base
        assert len(asked) == 1 and peak <= asked[0] + 8 * 512, (peak, asked)
    inplace.write(slots, held, [(name, new)], elements=elements, prepared=prepared)
    assert torch.equal(model.layers[0].qkv_proj.weight[HEADS * HD : (HEADS + KV) * HD].cpu(), new)


def test_elements_are_written_alone_only_where_that_moves_fewer_bytes():
    """An element write costs its int64 index and its value (10 bytes for bf16, against 2 for
    the element written whole), and every changed element of the tensor goes to the device
    (a rank's part is picked there): bf16 pays below a fifth of the region changed, and a rank
    holding half of the tensor below a tenth of the tensor."""
    t = torch.zeros(10, 10, dtype=torch.bfloat16)
    p = torch.nn.Parameter(torch.zeros(10, 10, dtype=torch.bfloat16), requires_grad=False)

    def slot(src: tuple[slice, ...]) -> inplace.Slot:
        return inplace.Slot("m", "weight", p, p.data_ptr(), src, src)

    whole, half = slot((slice(None), slice(None))), slot((slice(0, 5), slice(None)))
    assert inplace._sparse_pays(whole, t, torch.arange(19))
    assert not inplace._sparse_pays(whole, t, torch.arange(20))
    assert inplace._sparse_pays(half, t, torch.arange(9))
    assert not inplace._sparse_pays(half, t, torch.arange(10))
