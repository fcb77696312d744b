"""The load steps: manifest -> chunk targets -> tensors.

``assemble.py`` turns manifest entries into chunk targets and builds new tensors or fills
``into=`` ones; ``reshard.py`` maps saved shards onto the boxes a rank wants. Reading, decoding
and verifying chunks is :mod:`deltackpt.store.chunks`.

(The package is ``loading``, not ``load``: ``deltackpt.load`` is the public function.)
"""
