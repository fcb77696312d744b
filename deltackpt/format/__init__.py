"""What is on disk, and nothing else: no store, no threads, no collectives.

``manifest.py`` (Manifest, TensorEntry, ChunkRecord, JSON in and out), ``validate.py`` (checks
on untrusted manifests), ``tree.py`` (state tree <-> JSON), ``rng_state.py`` (generator states
in a state, and their checks), ``policy.py`` (codec names, ``EncodePolicy``, the named
``ENCODINGS``), ``codecs.py`` (raw / zstd / xor payloads), ``hashing.py`` (xxh3-128 digests),
``dtypes.py`` (dtype names, also on the sync wire), ``dtensor.py`` (DTensor boxes, also for
sync) and ``dcp_values.py`` (values DCP saves with torch.save).
"""
