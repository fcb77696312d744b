"""Plug-ins for the training loops people already run. Import them explicitly; importing
``deltackpt`` never imports Lightning or transformers:

>>> from deltackpt.integrations.lightning import DeltaCheckpointIO        # doctest: +SKIP
>>> from deltackpt.integrations.hf_trainer import DeltaCheckpointCallback, resume_trainer  # doctest: +SKIP

One plug-in per framework, each taking a store (path, URL or ``Store``) or a
:class:`deltackpt.tiers.Tiers`. ``lightning``: a Lightning ``CheckpointIO`` that saves
``ModelCheckpoint``'s files as snapshots of a store, or as tier steps (``markers`` maps file
paths to snapshot names and writes the small marker files Lightning looks for; the backends are
``_lightning_store`` and ``_lightning_tiers``). ``hf_trainer``: a ``TrainerCallback`` that saves
every ``save_steps`` and ``resume_trainer``, which resumes a ``transformers.Trainer`` from it (the
backends are ``_hf_store`` and ``_hf_tiers``; ``_hf_resume`` swaps the Trainer's loaders).
"""

from __future__ import annotations
