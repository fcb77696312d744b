"""What is on disk, and nothing else: no store, no threads, no collectives.

``manifest.py`` (Manifest, TensorEntry, ChunkRecord, JSON in and out), ``validate.py`` (checks
on untrusted manifests), ``tree.py`` (state tree <-> JSON), ``codecs.py`` (raw / zstd / xor
payloads), ``hashing.py`` (xxh3-128 digests), ``dtypes.py``, ``dtensor.py`` (DTensor boxes) and
``dcp_values.py`` (values DCP saves with torch.save).
"""
