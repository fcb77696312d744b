"""STORE.json: the store's format version, hash and chunking parameters, written once.

The chunking is fixed when a store is created (dedupe only matches chunks cut alike), so the
checks of ``chunk_bytes`` / ``small_bytes`` arguments live here beside the parser that validates
every field a save or load relies on.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from deltackpt.errors import InvalidArgumentError, StoreFormatError
from deltackpt.format.hashing import DIGEST_NAME
from deltackpt.store.packs import PACK_ALIGN

if TYPE_CHECKING:
    from deltackpt.store.store import Store

STORE_FORMAT = "deltackpt.store"
STORE_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_SMALL_BYTES = 1 << 20  # tensors below this are grouped into shared chunks
MAX_CHUNK_BYTES = 1 << 30  # one chunk is hashed, encoded and staged as a unit: keep it sane


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chunk_bytes_problem(value: Any) -> str | None:
    if not is_int(value):
        return f"expected an int, got {type(value).__name__} {value!r}"
    if not PACK_ALIGN <= value <= MAX_CHUNK_BYTES or value % PACK_ALIGN:
        return (
            f"expected a multiple of {PACK_ALIGN} between {PACK_ALIGN} and {MAX_CHUNK_BYTES} "
            f"(1 GiB), got {value!r}"
        )
    return None


def small_bytes_problem(value: Any, chunk_bytes: int | None) -> str | None:
    if not is_int(value):
        return f"expected an int, got {type(value).__name__} {value!r}"
    if chunk_bytes is None:  # checked against the store's chunk_bytes once that is known
        return None if value >= 0 else f"expected an int >= 0 (at most chunk_bytes), got {value!r}"
    if not 0 <= value <= chunk_bytes:
        return f"expected an int between 0 and chunk_bytes={chunk_bytes}, got {value!r}"
    return None


def check_chunk_args(chunk_bytes: Any, small_bytes: Any) -> None:
    if chunk_bytes is not None:
        problem = chunk_bytes_problem(chunk_bytes)
        if problem:
            raise InvalidArgumentError(
                f"open_store(chunk_bytes={chunk_bytes!r}) is invalid: {problem}. Pass e.g. "
                f"chunk_bytes=4 << 20 (the default), or leave it out"
            )
    if small_bytes is not None:
        problem = small_bytes_problem(small_bytes, chunk_bytes)
        if problem:
            raise InvalidArgumentError(
                f"open_store(small_bytes={small_bytes!r}) is invalid: {problem}. Pass e.g. "
                f"small_bytes=1 << 20 (tensors below it share chunks; 0 turns grouping off), or "
                "leave it out"
            )


def check_fixed(store: Store, chunk_bytes: int | None, small_bytes: int | None) -> None:
    """Chunking is fixed at creation: an explicit, different value must not be ignored."""
    for name, given, have in (
        ("chunk_bytes", chunk_bytes, store.chunk_bytes),
        ("small_bytes", small_bytes, store.small_bytes),
    ):
        if given is not None and given != have:
            raise InvalidArgumentError(
                f"open_store({name}={given}) differs from the existing store's {name}={have} "
                f"({str(store.root)!r}/STORE.json): chunking is fixed when a store is created, "
                f"or dedupe would stop matching. Leave {name} out (or pass {name}={have}) to "
                "open it, or use a new directory for a store with other chunking"
            )


def config_bytes(chunk_bytes: int, small_bytes: int) -> bytes:
    """The bytes of a new store's STORE.json."""
    cfg = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "hash": DIGEST_NAME,
        "chunk_bytes": chunk_bytes,
        "small_bytes": small_bytes,
        "pack_align": PACK_ALIGN,
    }
    return json.dumps(cfg, sort_keys=True, indent=1).encode() + b"\n"


def parse_config(raw: bytes, path: str) -> dict[str, Any]:
    """Parse and fully validate STORE.json (read from ``path``): every field a save or load
    relies on."""
    try:
        cfg = json.loads(raw)
    except ValueError as e:  # also UnicodeDecodeError
        raise StoreFormatError(f"{path} is not valid JSON ({e}); the store is damaged") from e
    fix = (
        "The store is damaged or was not written by deltackpt; restore STORE.json from a copy "
        "(its chunking must match the existing snapshots)"
    )
    if not isinstance(cfg, dict):
        raise StoreFormatError(
            f"{path} holds a JSON {type(cfg).__name__}; expected an object with format, version, "
            f"hash, chunk_bytes, small_bytes and pack_align. {fix}"
        )
    version = cfg.get("version")
    if cfg.get("format") != STORE_FORMAT or not is_int(version) or version != STORE_VERSION:
        raise StoreFormatError(
            f"{path} says format={cfg.get('format')!r} version={cfg.get('version')!r}; this "
            f"deltackpt reads {STORE_FORMAT!r} version {STORE_VERSION}"
        )
    if cfg.get("hash") != DIGEST_NAME:
        raise StoreFormatError(f"{path} uses hash {cfg.get('hash')!r}; expected {DIGEST_NAME!r}")
    if not is_int(cfg.get("pack_align")) or cfg["pack_align"] != PACK_ALIGN:
        raise StoreFormatError(
            f"{path}: field 'pack_align' is {cfg.get('pack_align')!r}; expected {PACK_ALIGN}. {fix}"
        )
    problem = chunk_bytes_problem(cfg.get("chunk_bytes"))
    if problem is None:
        problem = small_bytes_problem(cfg.get("small_bytes"), cfg["chunk_bytes"])
        field_name = "small_bytes"
    else:
        field_name = "chunk_bytes"
    if problem:
        raise StoreFormatError(
            f"{path}: field {field_name!r} is {cfg.get(field_name)!r}: {problem}. {fix}"
        )
    return cfg
