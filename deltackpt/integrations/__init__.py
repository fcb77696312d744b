"""Plug-ins for the training loops people already run. Import them explicitly; importing
``deltackpt`` never imports Lightning or transformers:

>>> from deltackpt.integrations.lightning import DeltaCheckpointIO        # doctest: +SKIP
>>> from deltackpt.integrations.hf_trainer import DeltaCheckpointCallback, resume_trainer  # doctest: +SKIP

``lightning``: a Lightning ``CheckpointIO`` that saves ``ModelCheckpoint``'s files as snapshots
of a store (``markers`` maps file paths to snapshot names and writes the small marker files
Lightning looks for). ``hf_trainer``: a ``TrainerCallback`` that saves every ``save_steps`` to a
store and ``resume_trainer``, which resumes a ``transformers.Trainer`` from it.
"""

from __future__ import annotations
