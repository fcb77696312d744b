"""The load steps: manifest -> chunk targets -> tensors.

1. ``plan.py``: the one branch on what a manifest entry is (whole tensor, saved shards, view of a
   shared storage; DCP's byte values are whole uint8 tensors) turning an entry and the region
   wanted of it into chunk targets; ``reshard.py`` maps saved shards onto the box a rank wants;
2. :mod:`deltackpt.store.chunks`: read, decode and verify the chunks into their targets;
3. ``assemble.py``: ``load()``: new tensors, or ``into=`` tensors filled in place after strict
   checks; non-tensor values; the retry when gc compaction moved a pack mid-read.

The DCP reader (:mod:`deltackpt.dcp.reader`) uses steps 1 and 2 the same way.

(The package is ``loading``, not ``load``: ``deltackpt.load`` is the public function.)
"""
