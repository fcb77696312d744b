"""How :class:`~deltackpt.store.objstore.FsspecStorage` calls an object store: under deadlines.

Why deadlines here: the S3 client stack (s3fs over aiobotocore over aiohttp) bounds connecting
(``connect_timeout``) and waiting for a response's bytes (``read_timeout``), but not sending a
request's body: a connection whose peer stops reading (a black-holed NAT or load balancer) blocks
a part upload forever, and the retries of s3fs and botocore multiply (a store that drops every
connection took 160 s to fail). So every call of the store runs on fsspec's event loop inside
``asyncio.wait_for``, and a call that misses its deadline is cancelled (its connection closed)
and raised as :class:`~deltackpt.errors.StoreIOError` naming the URL.

The four deadlines, in seconds (:class:`StoreTimeouts`; set them as ``storage_options`` keys of
the same names, or ``FsspecStorage(..., timeouts=StoreTimeouts(...))``):

============================  =======  ==========================================================
``connect_timeout``           5        one connection attempt (S3: botocore's ``connect_timeout``;
                                       5 and 15 are s3fs's own defaults)
``read_timeout``              15       the longest silence while a response is awaited or read
                                       (S3: botocore's ``read_timeout``)
``request_timeout``           60       one try of a request that sends a body (a pack part, a
                                       small pack, a manifest), from its first byte to the
                                       answer; a try that misses it is cancelled and retried.
                                       It must cover sending ``block_size`` bytes: raise it for
                                       links slower than about ``parts_in_flight * block_size /
                                       request_timeout`` (4 x 64 MiB / 60 s: 4.5 MB/s)
``operation_timeout``         90       one operation across all its retries: a part, the
                                       manifest, a ranged read, a listing, a delete
============================  =======  ==========================================================

So a dead or silent store fails a save, load, gc or verify with ``StoreIOError`` within
``operation_timeout`` plus cleanup. Cleanup is bounded too: after a call missed its deadline the
store is presumed silent for ``operation_timeout`` seconds, and calls meanwhile get one try of at
most ``connect_timeout`` (aborting the save's uploads then costs seconds, not minutes); the first
call that succeeds ends that. (``gs://`` and ``az://`` packs are written through their file
system's own writer, which these deadlines do not bound; every other call of those is.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import time
from typing import Any

from deltackpt.errors import InvalidArgumentError, StoreIOError

TIMEOUT_KEYS = ("connect_timeout", "read_timeout", "request_timeout", "operation_timeout")
_BOTOCORE_KEYS = ("connect_timeout", "read_timeout")  # also s3fs's config_kwargs keys


@dataclasses.dataclass(frozen=True)
class StoreTimeouts:
    """The deadlines of an object store's calls, in seconds (see the module docstring)."""

    connect_timeout: float = 5.0
    read_timeout: float = 15.0
    request_timeout: float = 60.0
    operation_timeout: float = 90.0

    def __post_init__(self) -> None:
        for name in TIMEOUT_KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise InvalidArgumentError(
                    f"{name}={v!r} is invalid: expected seconds, a number > 0. Pass e.g. "
                    f"storage_options={{{name!r}: {getattr(StoreTimeouts, name)}}}"
                )

    def __str__(self) -> str:
        return ", ".join(f"{k}={getattr(self, k):g} s" for k in TIMEOUT_KEYS)


def split_options(
    storage_options: dict[str, Any], timeouts: StoreTimeouts | None, *, s3: bool
) -> tuple[StoreTimeouts, dict[str, Any]]:
    """``storage_options`` -> (the deadlines, the options for the file system). Our keys are
    taken out. For S3 the connect and read deadlines also go into botocore's
    ``config_kwargs``; a value the caller set there is kept (and is the deadline), but one that
    disagrees with ours given explicitly is a mistake, not a preference."""
    rest = dict(storage_options)
    given = {k: rest.pop(k) for k in TIMEOUT_KEYS if k in rest}
    if given and timeouts is not None:
        raise InvalidArgumentError(
            f"deadlines given twice: storage_options {sorted(given)} and timeouts={timeouts!r}; "
            "pass them one way"
        )
    t = timeouts or StoreTimeouts(**given)
    if not s3:
        return t, rest
    explicit = set(given) if timeouts is None else set(TIMEOUT_KEYS)
    cfg = dict(rest.get("config_kwargs") or {})
    for k in _BOTOCORE_KEYS:
        if k in cfg and k in explicit and float(cfg[k]) != float(getattr(t, k)):
            raise InvalidArgumentError(
                f"{k} given twice: config_kwargs[{k!r}]={cfg[k]!r} and {k}={getattr(t, k)!r}; "
                f"pass it one way (storage_options={{{k!r}: ...}})"
            )
        if k in cfg:
            t = dataclasses.replace(t, **{k: float(cfg[k])})
        cfg[k] = getattr(t, k)
    rest["config_kwargs"] = cfg
    return t, rest


class DeadlineExceeded(Exception):
    """A call of the store missed its deadline (converted to StoreIOError by the caller)."""

    def __init__(self, seconds: float, which: str) -> None:
        super().__init__(f"no answer within {which}={seconds:g} s")
        self.seconds, self.which = seconds, which


class Caller:
    """Runs the calls of one storage's file system under :class:`StoreTimeouts` (thread-safe:
    every call runs on fsspec's event loop; the 'silent' mark is one float)."""

    def __init__(self, fs: Any, timeouts: StoreTimeouts) -> None:
        self.fs = fs
        self.t = timeouts
        self._silent_until = 0.0

    def __call__(self, method: str, *args: Any, body: bool = False, **kw: Any) -> Any:
        """``fs.<method>(*args, **kw)`` (its async twin, under the deadlines). ``body``: the
        request sends a body, so each try gets ``request_timeout`` and a try that misses it is
        retried while ``operation_timeout`` lasts."""
        fs = self.fs
        if not getattr(fs, "async_impl", False):  # memory://: no network, nothing to bound
            return getattr(fs, method)(*args, **kw)
        from fsspec.asyn import sync

        t = self.t
        budget, which = t.operation_timeout, "operation_timeout"
        per_try = t.request_timeout if body else budget
        if time.monotonic() < self._silent_until:  # presumed silent: one short try
            budget = per_try = min(budget, t.connect_timeout)
            which = "connect_timeout (the store missed a deadline just before)"

        async def run() -> Any:
            loop = asyncio.get_running_loop()
            end = loop.time() + budget
            while True:
                start = loop.time()
                limit = min(end - start, per_try)
                try:
                    return await asyncio.wait_for(getattr(fs, "_" + method)(*args, **kw), limit)
                except (asyncio.TimeoutError, TimeoutError):
                    if loop.time() - start < limit - 0.05:
                        raise  # the library's own timeout, not ours
                    if loop.time() >= end - 0.05:
                        raise DeadlineExceeded(budget, which) from None
                    # this try ran out of request_timeout and the operation has time: retry

        try:
            out = sync(fs.loop, run)
        except DeadlineExceeded:
            self._silent_until = time.monotonic() + t.operation_timeout
            raise
        self._silent_until = 0.0
        return out


def deadline_error(e: DeadlineExceeded, what: str, where: str, t: StoreTimeouts) -> StoreIOError:
    return StoreIOError(
        errno.ETIMEDOUT,
        f"{what} {where} failed: the store gave {e} ({t}): it is unreachable, stalled or not "
        "reading. Check the endpoint and the network; on a slow link raise request_timeout and "
        "operation_timeout (storage_options={'request_timeout': 300, 'operation_timeout': 600})",
    )


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and its causes and contexts, each once (a chain may loop back on itself)."""
    out: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and all(seen is not x for x in out) and len(out) < 64:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def is_checksum_error(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is the client's response-checksum check failing: the bytes
    received are not the bytes the store holds a checksum of (corruption, not the network's
    refusal)."""
    return any(
        type(x).__name__ in ("FlexibleChecksumError", "ChecksumError")
        or "did not match calculated checksum" in str(x)
        for x in _chain(e)
    )


def precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is S3's answer to a lost If-None-Match race (HTTP 412)."""
    for x in _chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = str(resp.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return True
    return False
