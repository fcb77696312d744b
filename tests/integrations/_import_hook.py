"""The import hook of the test-only ``sitecustomize`` folders (``_vllm_linear/``, ``_vllm_amx/``):
:func:`patch_on_import` runs ``fn(module)`` right after a named module executes, in every
process that has the folder on ``PYTHONPATH``. The same hook as
``deltackpt.integrations.vllm.when_imported``, kept here free of torch and deltackpt: a
sitecustomize runs before anything else in every vLLM process, and importing the package there
would import torch first. Each sitecustomize imports it with this folder on ``sys.path`` for the import alone."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


def patch_on_import(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    """``patches[name](module)`` right after module ``name`` executes (first in the finders)."""
    sys.meta_path.insert(0, _PatchOnImport(patches))
