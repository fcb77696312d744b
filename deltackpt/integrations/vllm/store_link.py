"""The store link from the driver: every worker of an ``LLM`` to a store's newest snapshot, and
what the engine then needs for the new weights to be what it serves and says it serves.

The worker extension's ``deltackpt_follow`` (module ``extension``) moves the weights; called
through ``collective_rpc`` alone it leaves two things behind: vLLM's prefix cache keeps KV blocks
computed with the old weights (a request whose prefix is cached is served partly by them), and
the engine's weight version (the label vLLM reports with each output, what RL frameworks tag
rollouts with) stays what it was. :func:`follow` and :func:`commit` do both once the workers
hold the new snapshot: ``reset_prefix_cache()`` and ``update_weight_version(...)``: the
snapshot's training step where it has one (:func:`label`), else its name.

    from deltackpt.integrations.vllm.store_link import follow, stage, commit
    follow(llm, "s3://bucket/run")          # or, to pause only for the load:
    stage(llm, "s3://bucket/run"); commit(llm)

Over HTTP the same three steps are ``POST /collective_rpc`` (``deltackpt_follow``), ``POST
/reset_prefix_cache`` and ``POST /update_weight_version``, in that order.
"""

from __future__ import annotations

from typing import Any

from deltackpt.sync import SyncError

__all__ = ["commit", "follow", "label", "stage"]


def _kwargs(key: str | None, storage_options: dict[str, Any] | None, lease_ttl: float | None,
            **more: Any) -> dict[str, Any]:  # fmt: skip
    return {"key": key, "storage_options": storage_options, "lease_ttl": lease_ttl, **more}


def follow(
    llm: Any,
    store: str,
    *,
    key: str | None = "model",
    storage_options: dict[str, Any] | None = None,
    lease_ttl: float | None = 600.0,
    whole: bool = False,
    tp_boxes: bool | None = None,
) -> dict[str, Any]:
    """Every worker of ``llm`` (started with the deltackpt worker extension) to the newest
    committed snapshot of ``store``, all of them to the same one; when the model changed, the
    prefix cache dropped and the engine's weight version set to the snapshot's name. Returns
    the first worker's answer (``version``, ``mode``: None when nothing was newer, ...) and
    ``workers``. Arguments: ``deltackpt_follow``'s."""
    kw = _kwargs(key, storage_options, lease_ttl, whole=whole, tp_boxes=tp_boxes)
    return _served(llm, llm.collective_rpc("deltackpt_follow", args=(store,), kwargs=kw))


def stage(
    llm: Any,
    store: str,
    *,
    key: str | None = "model",
    storage_options: dict[str, Any] | None = None,
    lease_ttl: float | None = 600.0,
    tp_boxes: bool | None = None,
) -> None:
    """Start the next snapshot's preparation on every worker (read, patched, checked on a
    background thread while the engine serves the current weights); :func:`commit` loads it."""
    kw = _kwargs(key, storage_options, lease_ttl, stage=True, tp_boxes=tp_boxes)
    llm.collective_rpc("deltackpt_follow", args=(store,), kwargs=kw)


def commit(llm: Any) -> dict[str, Any]:
    """Load what :func:`stage` prepared on every worker (the pause), then as :func:`follow`:
    the prefix cache dropped, the weight version set. A worker whose preparation failed raises
    :class:`~deltackpt.sync.SyncError` naming it (the models are untouched where it failed)."""
    got = llm.collective_rpc("deltackpt_follow_commit")
    failed = [(i, g["error"]) for i, g in enumerate(got) if "error" in g]
    if failed:
        raise SyncError(
            f"the staged follow failed on worker(s) {failed}; the models of those workers are "
            "untouched; call stage() again (a version retention deleted meanwhile: the newest)"
        )
    return _served(llm, got)


def _served(llm: Any, got: list[dict[str, Any]]) -> dict[str, Any]:
    versions = sorted({str(g.get("version")) for g in got})
    if len(versions) != 1:
        raise SyncError(
            f"the engine's workers hold different snapshots {versions} after a follow (one of "
            "them failed, or was followed alone); follow again: they agree on the newest"
        )
    if any(g.get("mode") for g in got):  # the weights changed on the workers
        llm.reset_prefix_cache()
        llm.update_weight_version(label(got[0]))
    return {**got[0], "workers": len(got)}


def label(answer: dict[str, Any]) -> str:
    """The engine's weight version for a follow's answer: the snapshot's training step where it
    has one (a ``Checkpointer``'s snapshots, ``metadata={"step": n}``), as a trainer's rounds
    label theirs, so rollouts are tagged with one kind of version whichever route brought the
    weights; else the snapshot's name."""
    step = answer.get("step")
    return str(step) if type(step) is int else str(answer.get("version"))
