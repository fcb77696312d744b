"""Tunables in one place: frozen option dataclasses and their environment overrides.

Nothing else in deltackpt reads ``os.environ``. Tests override knobs with :func:`overrides`.

=========================  ==============================================  ================
variable                   meaning                                          default
=========================  ==============================================  ================
DELTACKPT_THREADS          worker threads for hashing, encoding and I/O     min(4, cpus)
DELTACKPT_LOCK_TIMEOUT     seconds to wait for the store lock               600
DELTACKPT_FSYNC            0 skips fsync (benchmarks of page-cache speed)   1
DELTACKPT_MEMORY_BUDGET    bytes of staging buffers per store               RAM / 2
DELTACKPT_DEVICE_SCAN      how a sync save of CUDA state finds what changed: auto
                           ``auto`` (fingerprints on the device, only changed
                           chunks copied), ``off`` (copy all, hash on the
                           host), ``always`` (CPU state too: the test suite)
DELTACKPT_DEVICE_PATCH     a weight-sync sender's delta round of CUDA        off
                           tensors: ``auto`` (changed elements found on
                           the device against a device copy of the last
                           committed version, where the device has room;
                           only they cross to the host mirror), ``off``
                           (changed 1 MiB chunks copied; the default until
                           a GPU measures ``auto``), ``always`` (host
                           tensors the mirror holds too: the test suite);
                           in a device round (an ipc link on CUDA) the
                           elements go as device patches, never to the host
DELTACKPT_DEVICE_ROUNDS    weight sync on an ipc link: ``auto`` (rounds on   auto
                           a CUDA bucket stay on the device: packed from
                           the trainer's tensors, verified with device
                           digests, applied from device staging; so do
                           rounds of CUDA tensors through host buckets:
                           copied into page-locked shared memory),
                           ``off`` (through the host, as on every other
                           link), ``always`` (host tensors too: the test
                           suite's CPU stand-in)
DELTACKPT_FINGERPRINT_COMPILE  chunk fingerprints of CUDA bytes (device       auto
                           scans, device saves, device digests): ``auto``
                           (one Triton kernel for all the chunks of a call
                           where Triton is installed, as with torch's CUDA
                           builds; the torch ops if it is missing or fails,
                           with a warning), ``triton`` (the kernel, its
                           errors raised), ``off`` (torch ops, ~16 passes),
                           ``on`` (fused by ``torch.compile``; its first
                           call compiles for ~15 s). The same integers
DELTACKPT_FUSED_COPY       a device round's copies that are fingerprinted    auto
                           too (the trainer's pack of a full round, the
                           receiver's copy out of the ipc bucket):
                           ``auto`` (one pass of the Triton kernel, which
                           copies and fingerprints, where the fingerprints
                           run by it), ``off`` (copied, then fingerprinted)
DELTACKPT_IPC_BUCKETS      shared buckets a weight-sync trainer holds per    2
                           ipc link (``SyncGroup(ipc_buckets="auto")``, the
                           default): an integer >= 2 (a ring, reused within
                           a round as the receiver copies each out), or
                           ``none`` (one per bucket of the round)
DELTACKPT_PACK_THREADS     buckets a weight-sync trainer packs at once in a  2
                           host round, each on its own thread (1: one at a
                           time; device rounds always are; a ring of ipc
                           buckets packs at most ``ipc_buckets`` at once)
DELTACKPT_STAGE_DEFER      an async save of CUDA state whose sources have    auto
                           no pinned buffer yet: ``auto`` (copied on the
                           device, pinned behind the caller, where the
                           device has room), ``off`` (pinned in the call),
                           ``always`` (CPU state too: the test suite)
DELTACKPT_STAGE_ORDER      an async save's blocking phase of new stores:     auto
                           ``auto`` (chosen per save from the last one's
                           changes), ``hash-first`` or ``copy-first``
=========================  ==============================================  ================

Read by the vLLM backend's workers (``integrations/vllm``; the trainer's
``DeltackptTrainerInitInfo`` fields of the same names win over them):

=========================  ==============================================  ================
variable                   meaning                                          default
=========================  ==============================================  ================
DELTACKPT_VLLM_STAGING     ``ring`` (two message slots) or ``round`` (a       ring
                           round's arena)
DELTACKPT_VLLM_UNDO_DIR    where a round sent whole keeps the bytes it        temp dir
                           overwrote: a directory, or ``memory``
DELTACKPT_VLLM_INPLACE     commits write into parameters seen to hold the     1
                           tensors as they are (0: reload the layers)
DELTACKPT_VLLM_PREPARE     a staged round moves its commit's device copies    1
                           ahead, while the engine serves
DELTACKPT_VLLM_TP_BOXES    each worker receives only its tensor-parallel      0
                           boxes
DELTACKPT_VLLM_LORA_STORE  (the server) a store whose ``[adapter@]snapshot``  unset
                           names requests may use as ``model``: the LoRA
                           resolver ``deltackpt`` (``integrations/vllm/
                           resolver.py``)
=========================  ==============================================  ================

One variable of another program is read here too: the terminal's ``COLUMNS`` (the width of the
CLI's tables when stdout is not a terminal).

Every field is validated when an options object is built (``save(..., threads=0)`` raises
:class:`~deltackpt.errors.InvalidArgumentError` before anything is touched), and a malformed
environment variable raises the same error naming the variable.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from deltackpt.errors import InvalidArgumentError
from deltackpt.format.codecs import ENCODINGS, EncodePolicy
from deltackpt.format.policy import AUTO_REMOTE, MAX_CHAIN

_OVERRIDES: dict[str, str] = {}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env(name: str, default: str) -> str:
    return _OVERRIDES.get(name, os.environ.get(name, default))


@contextlib.contextmanager
def overrides(**values: Any) -> Iterator[None]:
    """Temporarily set ``DELTACKPT_*`` knobs: ``with overrides(DELTACKPT_THREADS=1): ...``."""
    old = dict(_OVERRIDES)
    _OVERRIDES.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(old)


def _bad_env(name: str, raw: str, expected: str, example: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"environment variable {name}={raw!r} is invalid: expected {expected}. Set it to e.g. "
        f"{name}={example}, or unset it for the default"
    )


def _env_int(name: str, default: str, minimum: int, example: str) -> int:
    raw = _env(name, default)
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad_env(name, raw, f"an integer >= {minimum}", example) from None
    if value < minimum:
        raise _bad_env(name, raw, f"an integer >= {minimum}", example)
    return value


def default_threads() -> int:
    return _env_int("DELTACKPT_THREADS", str(min(4, os.cpu_count() or 1)), 1, "4")


def default_lock_timeout() -> float:
    raw = _env("DELTACKPT_LOCK_TIMEOUT", "600")
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not value >= 0:  # also refuses nan
        raise _bad_env("DELTACKPT_LOCK_TIMEOUT", raw, "a number of seconds >= 0", "600")
    return value


def default_fsync() -> bool:
    raw = _env("DELTACKPT_FSYNC", "1")
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise _bad_env("DELTACKPT_FSYNC", raw, f"one of {_TRUE + _FALSE}", "1")
    return value in _TRUE


DEVICE_SCANS = ("auto", "off", "always")
REPLICATED = ("check", "rank0")


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Environment variable ``name``, one of ``choices`` (case and spaces ignored)."""
    raw = _env(name, default)
    value = raw.strip().lower()
    if value not in choices:
        raise _bad_env(name, raw, f"one of {choices}", default)
    return value


def default_device_scan() -> str:
    return _env_choice("DELTACKPT_DEVICE_SCAN", DEVICE_SCANS, "auto")


DEVICE_PATCHES = ("auto", "off", "always")


def default_device_patch() -> str:
    return _env_choice("DELTACKPT_DEVICE_PATCH", DEVICE_PATCHES, "off")


DEVICE_ROUNDS = ("auto", "off", "always")


def default_device_rounds() -> str:
    return _env_choice("DELTACKPT_DEVICE_ROUNDS", DEVICE_ROUNDS, "auto")


FINGERPRINT_COMPILES = ("auto", "off", "on", "triton")


def default_fingerprint_compile() -> str:
    return _env_choice("DELTACKPT_FINGERPRINT_COMPILE", FINGERPRINT_COMPILES, "auto")


def fingerprint_kernel() -> str:
    """How chunk fingerprints of CUDA bytes run (``DELTACKPT_FINGERPRINT_COMPILE``), as
    ``format.fingerprint.KERNELS`` names it: ``auto``, ``torch`` (off), ``compile`` (on),
    ``triton``."""
    mode = default_fingerprint_compile()
    return {"auto": "auto", "off": "torch", "on": "compile", "triton": "triton"}[mode]


FUSED_COPIES = ("auto", "off")


def fused_copies() -> bool:
    """Whether a device round may copy and fingerprint in one pass
    (``DELTACKPT_FUSED_COPY``; it then does so where the fingerprint kernel runs)."""
    return _env_choice("DELTACKPT_FUSED_COPY", FUSED_COPIES, "auto") == "auto"


def default_ipc_buckets() -> int | None:
    """``SyncGroup(ipc_buckets="auto")``: ``DELTACKPT_IPC_BUCKETS``, a ring of that many shared
    buckets per ipc link (default 2), or None for ``none`` (one per bucket of the round)."""
    if _env("DELTACKPT_IPC_BUCKETS", "2").strip().lower() == "none":
        return None
    return _env_int("DELTACKPT_IPC_BUCKETS", "2", 2, "2")


def default_pack_threads() -> int:
    """``WeightSender``: ``DELTACKPT_PACK_THREADS``, the buckets a host round packs at once."""
    return _env_int("DELTACKPT_PACK_THREADS", "2", 1, "2")


STAGE_DEFERS = ("auto", "off", "always")


def default_stage_defer() -> str:
    return _env_choice("DELTACKPT_STAGE_DEFER", STAGE_DEFERS, "auto")


def _env_switch(name: str, default: bool) -> bool:
    """On/off variable ``name``: one of 1/0, true/false, yes/no, on/off (case and spaces
    ignored); unset or empty: ``default``."""
    raw = _env(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value not in _TRUE + _FALSE:
        raise _bad_env(name, raw, f"one of {_TRUE + _FALSE}", "1" if default else "0")
    return value in _TRUE


VLLM_SWITCHES = {
    "DELTACKPT_VLLM_INPLACE": True,
    "DELTACKPT_VLLM_PREPARE": True,
    "DELTACKPT_VLLM_TP_BOXES": False,
}


def vllm_switch(name: str) -> bool:
    """A vLLM worker's on/off variable (``VLLM_SWITCHES``: its name and default)."""
    if name not in VLLM_SWITCHES:
        raise InvalidArgumentError(
            f"vllm_switch({name!r}): not a switch of the vLLM workers; one of {sorted(VLLM_SWITCHES)}"
        )
    return _env_switch(name, VLLM_SWITCHES[name])


VLLM_STAGINGS = ("ring", "round")


def vllm_staging() -> str:
    """A vLLM worker's staging (``DELTACKPT_VLLM_STAGING``; unset or empty: ``ring``)."""
    if not _env("DELTACKPT_VLLM_STAGING", "").strip():
        return "ring"
    return _env_choice("DELTACKPT_VLLM_STAGING", VLLM_STAGINGS, "ring")


def vllm_undo_dir() -> str | None:
    """``DELTACKPT_VLLM_UNDO_DIR``: a directory or ``memory``; None when unset or empty."""
    return _env("DELTACKPT_VLLM_UNDO_DIR", "").strip() or None


def vllm_lora_store() -> str | None:
    """``DELTACKPT_VLLM_LORA_STORE``: the store of the vLLM LoRA resolver; None when unset or
    empty (no resolver)."""
    return _env("DELTACKPT_VLLM_LORA_STORE", "").strip() or None


def console_columns(default: int = 120) -> int:
    """The terminal's ``COLUMNS`` (a positive integer), else ``default``."""
    raw = _env("COLUMNS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def default_memory_budget() -> int:
    if _env("DELTACKPT_MEMORY_BUDGET", ""):
        return _env_int("DELTACKPT_MEMORY_BUDGET", "", 0, str(8 << 30))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


# ----------------------------------------------------------------------------- validation


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but threads=True is a mistake, not a thread count
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(owner: str, name: str, value: Any, expected: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"option {name}={value!r} ({owner}.{name}) is invalid: expected {expected}, got "
        f"{type(value).__name__} {value!r}. {fix}"
    )


def _check_bool(owner: str, obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise _bad(owner, name, value, "True or False", f"Pass {name}=True or {name}=False")


def _check_threads(owner: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise _bad(
            owner,
            "threads",
            value,
            "an int >= 1",
            "Pass e.g. threads=4, or leave it out for the default (min(4, cpus), env "
            "DELTACKPT_THREADS)",
        )


_ENCODING_HINT = (
    f'Pass one of {sorted(ENCODINGS)} ("auto" is the default), or build an EncodePolicy: `from deltackpt.codecs import EncodePolicy, RAW, ZSTD, XOR`, then '
    "encoding=EncodePolicy(codecs=(RAW, ZSTD)) allows zstd, EncodePolicy(force=ZSTD) always uses "
    "it, EncodePolicy(codecs=(RAW,)) turns encoding off; leave it out for the default"
)


DEFAULT_CHAIN_BUDGET = 1.0
DEFAULT_KEYFRAME_EVERY = 32


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs. Chunk size lives in the store (STORE.json), not here: it must not change
    between saves or dedupe would stop matching. Every field is validated on construction."""

    allow_pickle: bool = False
    overwrite: bool = False
    threads: int = field(default_factory=default_threads)
    lock_timeout: float = field(default_factory=default_lock_timeout)
    fsync: bool = field(default_factory=default_fsync)
    # "auto" | "fast-restore" | "smallest" (deltackpt.format.codecs.ENCODINGS) or an EncodePolicy;
    # a name is replaced by its policy on construction
    encoding: EncodePolicy = field(default_factory=lambda: ENCODINGS["auto"])
    # xor deltas (encodings "smallest", or "auto" on an object store): a chunk's next version is
    # a keyframe (raw or zstd) when its chain's xor payloads, the new one included, would exceed
    # chain_budget x the chunk's raw size, so a reader at the end of a chain reads at most
    # (1 + chain_budget) x its raw bytes; 0 writes no deltas. keyframe_every additionally caps
    # the versions per chain (keyframe + K-1 deltas), because every link costs a full-chunk
    # decode whatever its size. Whichever cuts first wins. Defaults measured in BENCHMARKS.md
    # ("Catch-up and refit through the store").
    chain_budget: float = DEFAULT_CHAIN_BUDGET
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY
    # Bytes of host staging buffers a store may hold (None: half the machine's RAM). xor deltas
    # need two copies of the state (this save and the bases); one copy for plain async saves;
    # a state larger than the budget is written from the live tensors and the call blocks.
    memory_budget: int | None = None
    # With a process group: "check" (the default) refuses plain (non-DTensor) values that the
    # ranks hold differently, since one copy (rank 0's) is kept; "rank0" keeps rank 0's copy
    # without looking (torch.distributed.checkpoint's behaviour). distributed/replicas.py.
    replicated: str = "check"

    def for_storage(self, *, remote: bool) -> SaveOptions:
        """These options for a store whose storage is ``remote`` (an object store): there
        ``encoding="auto"`` (the default) is :data:`~deltackpt.format.policy.AUTO_REMOTE`,
        which writes xor deltas, because bytes cost more over a network than decoding does."""
        if remote and self.encoding is ENCODINGS["auto"]:
            return replace(self, encoding=AUTO_REMOTE)
        return self

    def __post_init__(self) -> None:
        owner = "SaveOptions"
        for name in ("allow_pickle", "overwrite", "fsync"):
            _check_bool(owner, self, name)
        _check_threads(owner, self.threads)
        if self.replicated not in REPLICATED:
            raise _bad(
                owner,
                "replicated",
                self.replicated,
                f"one of {REPLICATED}",
                "Pass replicated='check' (refuse plain values that differ between ranks) or "
                "replicated='rank0' (keep rank 0's copy, as torch.distributed.checkpoint does)",
            )
        t = self.lock_timeout
        # inf is allowed (wait forever); nan and negatives would make the deadline meaningless
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0:
            raise _bad(
                owner,
                "lock_timeout",
                t,
                "a number of seconds >= 0",
                "Pass e.g. lock_timeout=600 (env DELTACKPT_LOCK_TIMEOUT), or 0 to fail at once "
                "when the store is locked",
            )
        if isinstance(self.encoding, str) and self.encoding in ENCODINGS:
            object.__setattr__(self, "encoding", ENCODINGS[self.encoding])
        if not isinstance(self.encoding, EncodePolicy):
            raise _bad(
                owner,
                "encoding",
                self.encoding,
                f"one of {sorted(ENCODINGS)} or a deltackpt.codecs.EncodePolicy",
                _ENCODING_HINT,
            )
        k = self.keyframe_every
        if not _is_int(k) or not 1 <= k <= MAX_CHAIN:
            raise _bad(
                owner,
                "keyframe_every",
                k,
                f"an int between 1 and {MAX_CHAIN} (the most xor links a manifest may hold)",
                f"Pass e.g. keyframe_every={DEFAULT_KEYFRAME_EVERY} (1 writes every changed chunk "
                "in full, no xor chains); chain_budget cuts chains by their bytes",
            )
        b = self.chain_budget
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 <= b <= MAX_CHAIN:
            raise _bad(
                owner,
                "chain_budget",
                b,
                f"a number between 0 and {MAX_CHAIN} (xor bytes of a chain / its chunk's size)",
                f"Pass e.g. chain_budget={DEFAULT_CHAIN_BUDGET} (a reader at the end of a chain "
                "reads at most 1 + chain_budget times the raw bytes), or 0 for no xor deltas",
            )
        mb = self.memory_budget
        if mb is not None and (not _is_int(mb) or mb < 0):
            raise _bad(
                owner,
                "memory_budget",
                mb,
                "None or an int number of bytes >= 0",
                "Pass e.g. memory_budget=8 << 30, 0 to never stage (saves block), or None for "
                "half the RAM (env DELTACKPT_MEMORY_BUDGET)",
            )

    @staticmethod
    def from_kwargs(base: SaveOptions | None, kwargs: dict[str, Any]) -> SaveOptions:
        return _apply(base, SaveOptions, kwargs, "save")


@dataclass(frozen=True)
class LoadOptions:
    # True: re-hash every chunk read and compare with its digest; a catch-up (since=) checks
    # what it patches at the cost of the change (docs/loading.md). "full": a catch-up also
    # hashes every chunk of into it relies on, and each patched result whole. False: trust reads
    verify: bool | str = True
    strict: bool = True  # into=: keys, shapes and dtypes must match exactly
    allow_pickle: bool = False
    threads: int = field(default_factory=default_threads)
    # load(mode="broadcast"): bytes the reading rank sends per broadcast (two such buffers on
    # the reading rank: one on the wire, the next being read; one on every other rank)
    bucket_bytes: int = 64 << 20
    # load() without into=: the device its new tensors are made on (torch.load's map_location,
    # one device); whole tensors are read straight there through host buckets
    device: Any = None

    def __post_init__(self) -> None:
        for name in ("strict", "allow_pickle"):
            _check_bool("LoadOptions", self, name)
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise _bad(
                    "LoadOptions", "device", self.device, 'a torch device, e.g. "cuda:0"',
                    f"({e}). Pass device=\"cuda\", a torch.device, or leave it out (CPU)",
                ) from e  # fmt: skip
        if self.verify not in (True, False, "full") or type(self.verify) not in (bool, str):
            raise _bad(
                "LoadOptions", "verify", self.verify, 'True, False or "full"',
                'Pass verify=True (the default), verify="full" for a catch-up (since=) that also '
                "hashes every chunk of into it relies on, or verify=False to trust what is read",
            )  # fmt: skip
        _check_threads("LoadOptions", self.threads)
        if not _is_int(self.bucket_bytes) or self.bucket_bytes < 4096:
            raise _bad(
                "LoadOptions", "bucket_bytes", self.bucket_bytes, "an int >= 4096",
                "Pass e.g. bucket_bytes=64 << 20, or leave it out (64 MiB)",
            )  # fmt: skip

    @staticmethod
    def from_kwargs(base: LoadOptions | None, kwargs: dict[str, Any]) -> LoadOptions:
        return _apply(base, LoadOptions, kwargs, "load")


_Options = TypeVar("_Options", SaveOptions, LoadOptions)


def _apply(base: object, cls: type[_Options], kwargs: dict[str, Any], what: str) -> _Options:
    if base is not None and not isinstance(base, cls):
        raise InvalidArgumentError(
            f"{what}(options={base!r}) is invalid: expected None or a {cls.__name__}, got "
            f"{type(base).__name__}. Pass options={cls.__name__}(...) or the fields as keyword "
            f"arguments, e.g. {what}(..., threads=2)"
        )
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidArgumentError(
            f"{what}() got unknown option(s) {unknown}; known options: {sorted(known)}. Check "
            "the spelling"
        )
    if not isinstance(base, cls):  # None
        return cls(**kwargs)
    return replace(base, **kwargs) if kwargs else base
