"""``torch.distributed.checkpoint`` (DCP) storage plug-in: DCP's planners, deltackpt's store.

::

    import torch.distributed.checkpoint as dcp
    from deltackpt.dcp import StoreReader, StoreWriter

    dcp.save(state, storage_writer=StoreWriter("ckpts", "step-100"))
    dcp.load(state, storage_reader=StoreReader("ckpts", "step-100"))   # or "latest"

DCP keeps doing what it does (flattening, planning, deduplicating replicated tensors, resharding
on load); deltackpt stores the bytes: chunked, content-addressed (a chunk any snapshot already
holds is not written again: incremental saves), encoded per :class:`~deltackpt.SaveOptions`,
checksummed, and committed crash-safely as one manifest. A DCP snapshot is an ordinary snapshot:
``deltackpt.load`` returns ``{fqn: full tensor or value}`` (shards assembled), and
``ls``/``verify``/``gc`` treat it like any other. ``StoreReader`` also reads snapshots written
by ``deltackpt.save``, so ``dcp.load`` can reshard any deltackpt snapshot. Both take the
arguments of DCP's ``FileSystemWriter``/``FileSystemReader`` (``overwrite`` defaults to True,
``thread_count``, ``sync_files``...), with the meaning they have there or a documented reason
to ignore them.

The plug-in in three files:

* ``writer.py``: :class:`StoreWriter` (DCP write items -> chunks and packs on every rank; one
  manifest committed by the coordinator);
* ``reader.py``: :class:`StoreReader` (DCP read items -> chunk targets of
  :mod:`deltackpt.loading.plan` -> the load engine of :mod:`deltackpt.store.chunks`);
* ``metadata.py``: a manifest -> DCP ``Metadata`` (what DCP's load planner sees).

The manifest stays within the version-1 schema: DCP-specific facts (``planner_data``,
``storage_meta``, which entries hold raw serialised values) sit in ``metadata["dcp"]`` as JSON.
"""

from __future__ import annotations

from deltackpt.dcp.reader import StoreReader
from deltackpt.dcp.writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter"]
