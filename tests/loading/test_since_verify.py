"""What a catch-up (``load(into=, since=)``) checks, at what cost: by default each patched chunk
against its linear digest updated from the words the patch touches; ``verify="full"`` also hashes
every chunk of ``into`` it relies on. Both fail closed on what they detect, with ``into``
unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt import LoadStats
from deltackpt.errors import CorruptChunkError, HeldVersionMismatchError
from deltackpt.format import lindigest
from deltackpt.format.hashing import digest
from deltackpt.format.policy import PATCH
from deltackpt.loading.inplace import InPlace, apply_all
from deltackpt.store.chunks import ChunkReader
from tests.loading._history import new_store, publish, same, state_at


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096, 8 * 1000 + 3])
def test_linear_digest_native_and_numpy_agree(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    native = lindigest.lin_digest(buf)
    if lindigest._native_sum is not None:  # the loop without AVX-512 (what other hosts run)
        assert lindigest._native_sum(buf, True) == lindigest._native_sum(buf)
    monkeypatch.setattr(lindigest, "_native_sum", None)
    monkeypatch.setattr(lindigest, "_native_terms", None)
    monkeypatch.setattr(lindigest, "_native_at", None)
    words = np.arange(0, (n + 7) // 8, 3, dtype=np.int64)
    at = lindigest.terms_at(buf, words)
    assert lindigest.lin_digest(buf) == native
    assert lindigest.terms_at(buf, words) == at  # read in place == gathered, then summed
    assert len(native) == 32 and int(native, 16) >= 0


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_linear_digest_update_equals_recomputing(itemsize: int) -> None:
    rng = np.random.default_rng(itemsize)
    old = rng.integers(0, 256, 8 * 1001 + itemsize, dtype=np.uint8)  # a partial last word
    new = old.copy()
    elems = new.view(np.dtype(f"u{itemsize}"))
    idx = np.append(np.sort(rng.choice(elems.size - 1, 57, replace=False)), elems.size - 1)
    elems[idx] ^= 1 + rng.integers(0, 100, idx.size).astype(elems.dtype)
    w = lindigest.changed_words([idx], itemsize)
    got = lindigest.lin_update(
        lindigest.lin_digest(old), w, lindigest.words_at(old, w), lindigest.words_at(new, w)
    )
    assert got == lindigest.lin_digest(new) != lindigest.lin_digest(old)


def _history(path: Path, n: int = 4) -> deltackpt.Store:
    st = new_store(path)
    for k in range(n):
        publish(st, k)
    return st


def test_saves_that_may_write_deltas_record_each_chunks_linear_digest(tmp_path: Path) -> None:
    st = _history(tmp_path / "s")
    patched = 0
    for k in range(4):
        m = st.manifest(f"s{k}")
        with st.pack_readers() as packs:
            reader = ChunkReader(packs, m.chunks, verify=True)
            for d, rec in m.chunks.items():
                raw = np.empty(rec.size, np.uint8)
                reader.decode_into(d, raw, "test")
                # patched chunks' digests were updated from their patch: equal to a full pass
                assert rec.lin == lindigest.lin_digest(raw), (k, d, rec.codec)
        patched += sum(rec.codec == PATCH for rec in m.chunks.values())
    assert patched > 0  # w1 changes one element per step: patch payloads, lin updated from them
    # the default encoding on a local disk writes no deltas, and no linear digests
    plain = new_store(tmp_path / "plain")
    deltackpt.save(state_at(0), plain, "s0")
    assert all(rec.lin is None for rec in plain.manifest("s0").chunks.values())


def test_default_catch_up_checks_only_what_changed(tmp_path: Path) -> None:
    st = _history(tmp_path / "s")
    into, stats = state_at(2), LoadStats()
    deltackpt.load(st, "s3", into=into, since="s2", stats=stats)
    assert same(into, state_at(3))
    assert stats.chunks_patched > 0 and stats.bytes_checked == 0
    into, full = state_at(2), LoadStats()
    deltackpt.load(st, "s3", into=into, since="s2", stats=full, verify="full")
    assert same(into, state_at(3)) and full.bytes_checked > 0


def test_into_wrong_where_a_patch_writes_is_refused(tmp_path: Path) -> None:
    st = _history(tmp_path / "s")
    into = state_at(2)
    into["model"]["w1"].view(-1)[2000] += 1.0  # the element s3's patch of w1 rewrites
    before = {n: t.clone() for n, t in into["model"].items()}
    with pytest.raises(HeldVersionMismatchError) as err:
        deltackpt.load(st, "s3", into=into, since="s2")
    assert err.value.key == "model/w1" and "s2" in str(err.value)
    assert all(torch.equal(before[n], into["model"][n]) for n in before)


def test_into_wrong_where_no_patch_writes_needs_verify_full(tmp_path: Path) -> None:
    """The documented limit of the default: a flipped element the patch never touches is not
    seen (the result keeps it); verify="full" refuses it and writes nothing."""
    st = _history(tmp_path / "s")
    into = state_at(2)
    into["model"]["w1"].view(-1)[5] += 1.0  # same chunk, an element no step changes
    deltackpt.load(st, "s3", into=into, since="s2")
    assert not same(into, state_at(3))
    into = state_at(2)
    into["model"]["w1"].view(-1)[5] += 1.0
    before = into["model"]["w1"].clone()
    with pytest.raises(HeldVersionMismatchError):
        deltackpt.load(st, "s3", into=into, since="s2", verify="full")
    assert torch.equal(before, into["model"]["w1"])


def _in_place(lin: bool, wrong_value: bool) -> tuple[list[InPlace], list[np.ndarray], np.ndarray]:
    bufs = [np.arange(1000, dtype=np.uint16).view(np.uint8).copy() for _ in range(2)]
    before = [b.copy() for b in bufs]
    idx, vals = np.array([3, 500, 999], np.int64), np.array([7, 9, 11], np.uint16)
    good = before[0].copy()
    good.view(np.uint16)[idx] = vals
    d, b = digest(good), digest(before[0])
    pair = (lindigest.lin_digest(before[0]), lindigest.lin_digest(good)) if lin else None
    bad = vals.copy()
    if wrong_value:
        bad[1] += 1  # a corrupt payload value
    items = [
        InPlace(d, b, bufs[0].view(), 2, [(idx, vals)], "first", pair),
        InPlace(d, b, bufs[1].view(), 2, [(idx, bad)], "second", pair),
    ]
    return items, bufs, good


@pytest.mark.parametrize("lin", [True, False])
def test_in_place_result_checks_tell_corrupt_payload_from_wrong_held_bytes(lin: bool) -> None:
    def each(fn, xs):
        return [fn(x) for x in xs]

    def held_error(chunk: str, actual: str) -> Exception:
        return HeldVersionMismatchError(f"{chunk} {actual}", key="k", snapshot="s1", held="s0")

    items, bufs, good = _in_place(lin, wrong_value=True)
    before = [b.copy() for b in bufs]
    with pytest.raises(CorruptChunkError, match="second.*linear digest" if lin else "second"):
        apply_all(items, each, "s0", held_error)
    assert all(np.array_equal(b, o) for b, o in zip(bufs, before, strict=True))

    items, bufs, good = _in_place(lin, wrong_value=False)
    # into's bytes differ from held's: the linear digest sees it where the patch writes (a
    # whole hash of the result sees it anywhere but there: the patch overwrites it)
    bufs[1].view(np.uint16)[500 if lin else 501] = 1234
    before = [b.copy() for b in bufs]
    with pytest.raises(HeldVersionMismatchError):
        apply_all(items, each, "s0", held_error)
    assert all(np.array_equal(b, o) for b, o in zip(bufs, before, strict=True))
    apply_all(items[:1], each, "s0", held_error)
    assert np.array_equal(bufs[0], good)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_native_in_place_patch_keeps_old_values_and_sums_the_touched_words(itemsize: int) -> None:
    from deltackpt.loading import inplace

    if inplace._native_apply is None:
        pytest.skip("deltackpt._native was not built (no C compiler at install)")
    rng = np.random.default_rng(itemsize)
    buf = rng.integers(0, 256, 8 * 301 + itemsize, dtype=np.uint8)  # a partial last word
    before = buf.copy()
    n = buf.size // itemsize
    idx = np.append(np.sort(rng.choice(n - 1, 40, replace=False)), n - 1).astype(np.int64)
    vals = rng.integers(0, 255, idx.size).astype(np.dtype(f"u{itemsize}"))
    old, terms = np.empty_like(vals), np.zeros(4, np.uint64)
    inplace._native_apply(buf, idx, vals, itemsize, old, terms)
    want = before.copy()
    want.view(vals.dtype)[idx] = vals
    assert np.array_equal(buf, want)
    assert np.array_equal(old, before.view(vals.dtype)[idx])
    got = lindigest.lin_update(
        lindigest.lin_digest(before), np.empty(0, np.int64),
        (int(terms[0]), int(terms[1])), (int(terms[2]), int(terms[3])),
    )  # fmt: skip
    assert got == lindigest.lin_digest(buf)
    with pytest.raises(ValueError, match="nothing was written"):  # validated before writing
        inplace._native_apply(buf, idx[::-1].copy(), vals, itemsize, old, None)
    assert np.array_equal(buf, want)
