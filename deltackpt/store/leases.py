"""Leases: a follower's claim on the snapshots it holds, so retention keeps them.

A follower (:class:`deltackpt.Follower`, or any reader that catches up with ``load(since=)``)
holds snapshot N and will next load N+k *incrementally from N*: if retention deleted N meanwhile,
the follower falls back to a full load. A lease asks retention not to: it is one small JSON
object per holder, ``leases/<holder>.json``::

    {"format": "deltackpt-lease", "version": 1, "holder": "eval-0-3f2a",
     "snapshots": ["step-100", "step-200"], "expires_unix": 1764103000.0}

written atomically with ``Storage.replace`` (a reader sees the old or the new object, never a
mix) and renewed by its holder; ``snapshots`` is what the holder holds (and, while it loads a
newer one, that one too). ``gc(keep_last=...)`` and ``Checkpointer(keep_last=...)`` retention
keep every snapshot named by an unexpired lease; the chunks those snapshots' delta chains need
are kept with them (a manifest's chunk table lists its whole chains, and gc keeps every chunk of
every kept manifest). gc removes expired leases (``GcReport.leases_expired``).

Costs and bounds. A lease keeps its snapshots' *unique* bytes in the store (what no newer
snapshot shares with them), for as long as its holder renews it or until it expires: a follower
that stops renewing stops costing anything after ``ttl``. A lease may ask for at most
:data:`MAX_TTL_S` from now and name at most :data:`MAX_SNAPSHOTS` snapshots.

Leases are untrusted input, like everything in a store: a lease object that is not a regular
file, is over :data:`MAX_LEASE_BYTES`, is not valid JSON of the shape above, names an invalid
snapshot name, or expires further than :data:`MAX_TTL_S` ahead is *bad*: reported
(``GcReport.bad_leases``), ignored (it keeps nothing) and left in place (gc deletes only leases
that were valid and expired). Expiry is judged by the clock of the process that reads the lease
(gc): give ``ttl`` a margin well above the clock skew between machines. Entries whose names
are not lease names (``<holder>.json``) are reported in one line and never read, so junk cannot
crowd real leases out. gc reads at most :data:`MAX_LEASES` lease objects; with more, the scan is
*incomplete* and retention fails closed: it deletes no snapshot (reported) until ``leases/`` is
cleaned up. A lease whose JSON repeats a field is bad.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from dataclasses import dataclass, field

from deltackpt.errors import InvalidArgumentError, InvalidNameError, StoreIOError
from deltackpt.store.snapshot import validate_name
from deltackpt.store.storage import ObjectTooLargeError, Storage

LEASES = "leases"  # leases/<holder>.json
LEASE_FORMAT = "deltackpt-lease"
LEASE_VERSION = 1
MAX_LEASE_BYTES = 4096
MAX_SNAPSHOTS = 8
MAX_TTL_S = 30 * 24 * 3600.0  # a lease further ahead is bad: nothing pins a store for ever
MAX_LEASES = 10_000  # read per scan (by name); more are reported and ignored: gc stays bounded
_HOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_SUFFIX = ".json"


@dataclass(frozen=True)
class Lease:
    """One valid lease: ``holder`` keeps ``snapshots`` until ``expires_unix`` (seconds since
    the epoch, by the reader's clock)."""

    holder: str
    snapshots: tuple[str, ...]
    expires_unix: float

    def expired(self, now: float) -> bool:
        return self.expires_unix <= now


@dataclass
class LeaseScan:
    """What ``leases/`` holds: valid unexpired leases, valid expired ones, and bad entries
    (``"leases/<name>: why"``)."""

    live: list[Lease] = field(default_factory=list)
    expired: list[Lease] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    # False when not every lease could be read (over MAX_LEASES): retention then deletes no
    # snapshot, since an unread lease may keep any of them
    complete: bool = True

    def leased(self) -> set[str]:
        """The snapshot names the live leases keep."""
        return {n for lease in self.live for n in lease.snapshots}


def check_holder(holder: object) -> str:
    """``holder`` if it can name a lease: 1 to 100 of ``A-Z a-z 0-9 . _ -``, starting with a
    letter or digit (it becomes a storage key)."""
    if not isinstance(holder, str) or not _HOLDER_RE.match(holder):
        raise InvalidArgumentError(
            f"lease holder {str(holder)[:120]!r} is invalid: expected 1 to 100 characters of "
            "A-Z a-z 0-9 . _ - starting with a letter or digit. Pass e.g. holder='eval-0'"
        )
    return holder


def check_lease_ttl(ttl: object, what: str) -> None:
    """Refuse a ``lease_ttl`` argument that is not seconds in (0, MAX_TTL_S] or None."""
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S
    ):
        raise InvalidArgumentError(
            f"{what}(lease_ttl={ttl!r:.80}) is invalid: expected seconds in (0, "
            f"{MAX_TTL_S:g}] or None (no lease). Pass e.g. lease_ttl=600"
        )


def lease_key(holder: str) -> str:
    return f"{LEASES}/{check_holder(holder)}{_SUFFIX}"


def write_lease(storage: Storage, holder: str, snapshots: list[str], ttl: float) -> Lease:
    """Create or renew ``holder``'s lease on ``snapshots`` for ``ttl`` seconds (atomic)."""
    check_holder(holder)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
        raise InvalidArgumentError(
            f"lease ttl={ttl!r} is invalid: expected seconds in (0, {MAX_TTL_S:g}]. Pass e.g. "
            "lease_ttl=600"
        )
    names = list(dict.fromkeys(snapshots))
    if not 1 <= len(names) <= MAX_SNAPSHOTS:
        raise InvalidArgumentError(
            f"lease of {holder!r}: {len(names)} snapshots; a lease names 1 to {MAX_SNAPSHOTS}"
        )
    for n in names:
        validate_name(n)
    lease = Lease(holder, tuple(names), time.time() + float(ttl))
    body = {
        "format": LEASE_FORMAT,
        "version": LEASE_VERSION,
        "holder": holder,
        "snapshots": names,
        "expires_unix": lease.expires_unix,
    }
    storage.replace(lease_key(holder), json.dumps(body, sort_keys=True).encode())
    return lease


def drop_lease(storage: Storage, holder: str) -> None:
    """Remove ``holder``'s lease (absent: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        storage.delete(lease_key(holder))


def _is_lease_name(name: str) -> bool:
    return name.endswith(_SUFFIX) and bool(_HOLDER_RE.match(name[: -len(_SUFFIX)]))


def parse_lease(name: str, data: bytes, now: float) -> Lease:
    """The lease in object ``leases/<name>``; ValueError saying why it is bad."""
    if not name.endswith(_SUFFIX) or not _HOLDER_RE.match(name[: -len(_SUFFIX)]):
        raise ValueError("not a name a follower writes (<holder>.json)")
    try:
        d = json.loads(data.decode("utf-8"), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"not JSON ({e})"[:200]) from None
    if not isinstance(d, dict) or d.get("format") != LEASE_FORMAT:
        raise ValueError(f'expected a JSON object with "format": "{LEASE_FORMAT}"')
    if d.get("version") != LEASE_VERSION:
        raise ValueError(f"version {d.get('version')!r:.40}, expected {LEASE_VERSION}")
    if set(d) != {"format", "version", "holder", "snapshots", "expires_unix"}:
        raise ValueError(f"fields {sorted(d)[:8]!r:.200}, expected exactly format, version, "
                         "holder, snapshots, expires_unix")  # fmt: skip
    holder, snaps, exp = d["holder"], d["snapshots"], d["expires_unix"]
    if holder != name[: -len(_SUFFIX)]:
        raise ValueError(f"holder {str(holder)[:80]!r} does not match its object's name")
    if not isinstance(snaps, list) or not 1 <= len(snaps) <= MAX_SNAPSHOTS:
        raise ValueError(f"snapshots must be a list of 1 to {MAX_SNAPSHOTS} names")
    for n in snaps:
        if not isinstance(n, str):
            raise ValueError(f"snapshot name {n!r:.80} is not a string")
        try:
            validate_name(n)
        except InvalidNameError:
            raise ValueError(f"snapshot name {n[:80]!r} is not a valid name") from None
    if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not math.isfinite(exp):
        raise ValueError(f"expires_unix {exp!r:.40} is not a finite number")
    if exp > now + MAX_TTL_S:
        raise ValueError(
            f"expires_unix {exp:.0f} is {exp - now:.0f} s ahead, over the {MAX_TTL_S:.0f} s a "
            "lease may ask for"
        )
    return Lease(holder, tuple(snaps), float(exp))


def _no_repeats(pairs: list[tuple[str, object]]) -> dict[str, object]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        again = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"field {again[:40]!r} appears more than once")
    return d


def scan_leases(storage: Storage, now: float | None = None) -> LeaseScan:
    """Read and sort every lease of the store; never raises on a bad lease (it is listed in
    ``bad``). An unreadable ``leases/`` itself (a symlink, an I/O error) is one bad entry."""
    now = time.time() if now is None else now
    out = LeaseScan()
    try:
        entries = storage.list(LEASES)
    except (OSError, ValueError) as e:  # UnsafePathError is a ValueError
        out.bad.append(f"{LEASES}: cannot be listed ({type(e).__name__}: {e})"[:300])
        return out
    named = [e for e in entries if _is_lease_name(e.name)]
    if len(named) < len(entries):
        junk = sorted(e.name for e in entries if not _is_lease_name(e.name))
        out.bad.append(
            f"{LEASES}: {len(junk)} entries are not lease names (<holder>.json) and were not "
            f"read, e.g. {junk[0][:80]!r}"
        )
    entries = sorted(named, key=lambda e: e.name)
    if len(entries) > MAX_LEASES:
        out.bad.append(
            f"{LEASES}: {len(entries)} leases, over the {MAX_LEASES} read; retention deletes no "
            "snapshot until leases/ is cleaned up (an unread lease may keep any of them)"
        )
        out.complete = False
        entries = entries[:MAX_LEASES]
    for e in entries:
        where = f"{LEASES}/{e.name[:120]}"
        if e.kind != "file":
            out.bad.append(f"{where}: is a {e.kind}, not a regular file")
            continue
        try:
            blob = storage.read(f"{LEASES}/{e.name}", max_bytes=MAX_LEASE_BYTES)
            assert blob.data is not None
            lease = parse_lease(e.name, blob.data, now)
        except FileNotFoundError:
            continue  # dropped by its holder meanwhile
        except ObjectTooLargeError as err:
            out.bad.append(f"{where}: {err.size} bytes, over the {MAX_LEASE_BYTES} allowed")
            continue
        except (ValueError, OSError, StoreIOError) as err:
            out.bad.append(f"{where}: {err}"[:300])
            continue
        (out.expired if lease.expired(now) else out.live).append(lease)
    return out


def sweep_expired(storage: Storage, leases: list[Lease], now: float | None = None) -> list[str]:
    """Delete the expired leases in ``leases`` that are still expired when read again (a holder
    may have renewed one since the scan); return the holders whose lease was removed."""
    now = time.time() if now is None else now
    gone: list[str] = []
    for lease in leases:
        key = lease_key(lease.holder)
        try:
            blob = storage.read(key, max_bytes=MAX_LEASE_BYTES)
            assert blob.data is not None
            again = parse_lease(key.rsplit("/", 1)[1], blob.data, now)
        except (FileNotFoundError, ValueError, OSError):
            continue
        if again.expired(now):
            with contextlib.suppress(FileNotFoundError):
                storage.delete(key)
                gone.append(lease.holder)
    return gone
