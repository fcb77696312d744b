"""The save steps, one file per step; ``deltackpt/distributed/save.py`` runs them in order, for one
process (a world of one) or every rank of a process group.

1. ``plan.py``: the state's tensors and values, cut into chunks.
2. ``stage.py``: hash in place; copy what must outlive the call into reused arenas (async saves,
   delta bases).
3. (``deltackpt/distributed/save_plan.py``: the ranks agree on who writes which chunk.)
4. ``write.py``: dedupe against the store, encode, append to packs, fsync.
5. (gather: each rank's written chunks reach rank 0.)
6. ``commit.py``: THE manifest builder (local, distributed and DCP saves) and the publish.

``engine.py`` holds the per-store state (StoreSaver: save slot, background thread, arenas, delta
bases) and SaveHandle; ``hooks.py`` the fault-injection points tests use; ``chains.py``
the xor chain bounds ``Checkpointer`` derives from ``keep_last``.

(The package is ``saving``, not ``save``: ``deltackpt.save`` is the public function.)
"""
