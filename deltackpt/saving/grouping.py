"""Which small tensors share a group chunk: the ones that change together.

Tensors below ``small_bytes`` are packed into group chunks (saving/plan.py). A group chunk is
rewritten whole when any of its members changes, so a group mixing tensors that change at every
step with frozen ones rewrites the frozen bytes at every save: a LoRA run whose adapters sit next to
small frozen norms writes ~3x the adapter bytes per save. The plan therefore keeps two classes of
groups, *hot* (expected to change at the next save) and *cold*, each packed in tree order, so the
groups of a class keep the same members from save to save and unchanged groups keep deduplicating.

What decides the class of a small source (a tensor, or a shared storage):

1. what this process saw (:class:`ChangeHistory`, kept by the store's
   :class:`~deltackpt.saving.engine.StoreSaver`): after each committed save, every group chunk whose
   digest differs from the previous save's group of the same members is looked into (its members'
   bytes hashed, xxh3-64): a member that changed becomes hot, one that did not becomes cold. Hot
   groups are expected to change, so they are looked into only every :data:`RECHECK_EVERY` saves,
   changed or not (a member unchanged since the last look turns cold): a full fine-tune, where
   everything is hot, pays one hash of its small tensors every few saves, after the commit;
2. for a source this process has no evidence about yet (the first saves, a resume in a new process),
   a prior: a tensor with ``requires_grad`` (``state_dict(keep_vars=True)``), a key naming a PEFT
   adapter (``lora_``, ``modules_to_save``, ...), or an optimizer's per-parameter state
   (``.../state/<int>/...``) is hot; anything else is cold.

A change of class moves a source to another group once (the groups it left and joined are
rewritten at that save); a wrong guess costs at most that. The manifest does not change: entries
already name their group chunk and offset, whatever the grouping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import xxhash

from deltackpt.saving.plan import SavePlan

RECHECK_EVERY = 8  # saves between looks into hot groups that changed (demotion to cold)

# Key fragments of tensors trained by PEFT methods (peft's ``*_`` parameter prefixes)
ADAPTER_MARKERS = (
    "lora_",
    "modules_to_save",
    "ia3_",
    "vera_lambda",
    "hada_",
    "lokr_",
    "oft_",
    "boft_",
)
_OPTIM_STATE = re.compile(r"(^|[/.])state[/.]\d+[/.]")

SourceId = tuple[str, int]  # (source key, nbytes): a small source across saves


def likely_hot(key: str, requires_grad: bool) -> bool:
    """The prior: is a source this process has not watched yet expected to change at every
    save? (trainable, a PEFT adapter, or optimizer state)."""
    return requires_grad or any(m in key for m in ADAPTER_MARKERS) or bool(_OPTIM_STATE.search(key))


@dataclass
class ChangeHistory:
    """Per small source of this store's saves in this process: did it change lately?"""

    hot: set[SourceId] = field(default_factory=set)
    watched: set[SourceId] = field(default_factory=set)  # sources with evidence (else: prior)
    member: dict[SourceId, int] = field(default_factory=dict)  # xxh3-64 at the last look
    groups: dict[tuple[SourceId, ...], str] = field(default_factory=dict)  # members -> digest
    saves: int = 0

    def is_hot(self, key: str, nbytes: int, requires_grad: bool) -> bool:
        """The class of a small source for the next plan (saving/plan.py's ``hot_of``)."""
        sid = (key, nbytes)
        return sid in self.hot if sid in self.watched else likely_hot(key, requires_grad)

    def learn(
        self, plan: SavePlan, digests: list[str], group_bufs: Mapping[int, np.ndarray]
    ) -> None:
        """After a committed save: update what changed from ``plan``'s group chunks (their
        gathered bytes in ``group_bufs``; a group without them teaches nothing)."""
        self.saves += 1
        recheck = self.saves % RECHECK_EVERY == 0
        groups: dict[tuple[SourceId, ...], str] = {}
        small: set[SourceId] = set()
        for ci, spec in enumerate(plan.chunks):
            if spec.ref_key is not None:
                continue
            members = tuple((plan.sources[si].key, n) for si, _, n in spec.parts)
            small.update(members)
            d = groups[members] = digests[ci]
            prev = self.groups.get(members)
            hot = [m in self.hot for m in members]
            if not (recheck and any(hot)):  # a recheck looks into every hot group
                if prev == d:
                    continue  # no member changed
                if prev is not None and all(hot):
                    continue  # hot groups are expected to change
            buf = group_bufs.get(ci)
            if buf is None or buf.size != spec.size:
                continue
            for sid, (_, _, n), off in zip(members, spec.parts, spec.offsets, strict=True):
                h = xxhash.xxh3_64_intdigest(memoryview(buf[off : off + n]))
                old = self.member.get(sid)
                self.member[sid] = h
                if old is None:
                    continue  # first look: nothing to compare with yet
                self.watched.add(sid)
                if old != h:
                    self.hot.add(sid)
                else:
                    self.hot.discard(sid)
        self.groups = groups
        # forget sources the state no longer has (another structure, a bigger tensor)
        self.member = {s: h for s, h in self.member.items() if s in small}
        self.watched &= small
        self.hot &= small
