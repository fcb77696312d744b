"""Interoperability with the formats of the ecosystem: Hugging Face safetensors export
(:func:`export_hf`) and import from safetensors, HF directories, ``torch.save`` files and DCP
checkpoints (:func:`import_checkpoint`)."""

from __future__ import annotations

from deltackpt.interop.hf_export import ExportReport, export_hf
from deltackpt.interop.hf_import import import_checkpoint

__all__ = ["ExportReport", "export_hf", "import_checkpoint"]
