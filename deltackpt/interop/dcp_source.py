"""Read a ``torch.distributed.checkpoint`` directory into one nested state, without running code
from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its load planner
unpickles non-tensor values with ``torch.load(weights_only=False)``: a hostile checkpoint could
run code. Here the metadata goes through an unpickler that builds only DCP's metadata records,
dtypes, sizes and paths (any other global is refused), every data file it names must be a plain
file name inside the directory, and non-tensor values load with ``weights_only=True``. The rest is
DCP's own no-process-group load (what ``dcp_to_torch_save`` does), which rebuilds the nesting
from the metadata's planner data.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import ImportFormatError

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata records and nothing else (the "restricting globals" recipe of the
    ``pickle`` documentation)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def read_metadata(path: Path) -> Any:
    """The validated ``Metadata`` of the DCP checkpoint at ``path``."""
    from torch.distributed.checkpoint.metadata import Metadata

    raw = (path / ".metadata").read_bytes()
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # any unpickling failure of untrusted bytes
        raise ImportFormatError(
            f"{path}/.metadata is not DCP metadata deltackpt can read safely ({e}); only "
            "checkpoints written by torch.distributed.checkpoint's FileSystemWriter are imported"
        ) from e
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise ImportFormatError(f"{path}/.metadata holds a {type(md).__name__}, not DCP Metadata")
    for info in md.storage_data.values():
        rel = str(getattr(info, "relative_path", ""))
        p = path / rel
        if not rel or "/" in rel or "\\" in rel or rel in (".", "..") or not p.is_file():
            raise ImportFormatError(
                f"{path}/.metadata names data file {rel!r:.80}, which is not a file inside the "
                "checkpoint directory; the checkpoint is incomplete or hostile"
            )
    return md


def load_dcp(path: Path) -> Any:
    """The whole state of the DCP checkpoint at ``path``, nested as it was saved, on CPU."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    md = read_metadata(path)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=Reader(path), planner=Planner(), no_dist=True)
    except ImportFormatError:
        raise
    except Exception as e:
        raise ImportFormatError(f"could not read the DCP checkpoint {path}: {e}") from e
    return state
