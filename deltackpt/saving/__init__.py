"""The save steps: state -> chunks -> packs -> manifest, one file per step in step order.

1. ``plan.py``: the state's tensors and values, cut into chunks.
2. ``stage.py``: copies into reused arenas (async saves, delta bases).
3. ``write.py``: hash, dedupe against the store, encode, append to packs, fsync, commit.
4. ``engine.py``: the per-store Saver that runs those steps (synchronously or on its
   background thread) and SaveHandle.

(The package is ``saving``, not ``save``: ``deltackpt.save`` is the public function.)
"""
