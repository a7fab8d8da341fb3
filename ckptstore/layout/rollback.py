"""Rolling a root back to an older step: the newer steps are set aside, not deleted.

A run that resumes from step 10 while its root holds steps up to 20 would otherwise meet its
own future: its save of step 15 conflicts with the old step 15 (and an incremental save could
take the old step 20 as its base). Rolling back makes step 10 the newest committed step:

* :func:`set_aside` takes every committed step above it out of sight, newest first, so that
  at any crash point the visible steps are still a prefix of the run and running it again
  finishes the job. For each step, the manifest is first copied into its own attempt as
  ``<step>/<attempt>/set-aside.json``, then the manifest is deleted. From then on the step's
  attempt is an uncommitted one, and its data stays until :mod:`ckptstore.layout.gc` removes
  it as abandoned, after the grace period counted from the copy (its newest object).
* :func:`recover` puts a set-aside step back, if nothing committed that step since, its own
  objects are all still there and every object it references is still a committed object
  (:func:`~ckptstore.layout.references.check_references`): a step is never recovered half,
  and never mixed with a step saved after the roll-back (that one holds the manifest, so the
  put-if-absent of the recovery fails with :class:`~ckptstore.errors.CommitConflictError`).

The copy is not named ``committed.json``: that name makes an attempt a committed one that
newer steps may reference (:mod:`ckptstore.layout.references`), which a set-aside step is not.
"""

from __future__ import annotations

import contextlib

from ckptstore.errors import (
    AlreadyExistsError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.layout.commit import committed_steps, read_manifest
from ckptstore.layout.keys import ATTEMPT_RE, attempt_prefix, check_step, manifest_key, parse_step
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.references import check_references
from ckptstore.store.base import Store

__all__ = ["SET_ASIDE_NAME", "recover", "set_aside", "set_aside_step", "set_aside_steps"]

#: The copy of a set-aside step's manifest, inside the attempt it commits.
SET_ASIDE_NAME = "set-aside.json"


async def set_aside(store: Store, after: int) -> list[int]:
    """Set aside every committed step above ``after``, newest first.

    Returns:
        The steps set aside, descending.

    Raises:
        CorruptCheckpointError: a newer step's manifest fails validation; it and the steps
            below it are left in place (nothing is set aside that could not be recovered).
    """
    check_step(after)
    newer = [step for step in await committed_steps(store) if step > after]
    return [step for step in reversed(newer) if await set_aside_step(store, step)]


async def set_aside_step(store: Store, step: int) -> bool:
    """Set aside committed step ``step``: its manifest copied into its attempt, then deleted.

    Returns:
        Whether it was set aside (``False``: not committed, as when another process set it
        aside or deleted it meanwhile).

    Raises:
        CorruptCheckpointError: its manifest fails validation; it is left in place.
    """
    try:
        manifest = await read_manifest(store, step)
    except NotFoundError:
        return False
    await store.put(attempt_prefix(step, manifest.attempt) + SET_ASIDE_NAME, manifest.encode())
    with contextlib.suppress(NotFoundError):
        await store.delete([manifest_key(step)])
    return True


async def set_aside_steps(store: Store) -> dict[int, str]:
    """Steps set aside and not committed again, with the attempt that holds each copy."""
    found: dict[int, str] = {}
    for key in await store.list_keys():
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != SET_ASIDE_NAME or not ATTEMPT_RE.fullmatch(parts[1]):
            continue
        step = parse_step(parts[0])
        if step is not None:
            found[step] = parts[1]
    committed = set(await committed_steps(store)) if found else set()
    return {step: attempt for step, attempt in sorted(found.items()) if step not in committed}


async def recover(store: Store, step: int) -> Manifest:
    """Commit a set-aside step again, exactly as it was.

    Raises:
        NotFoundError: ``step`` holds no set-aside copy (never set aside, or removed by gc).
        CommitConflictError: ``step`` has been committed again since it was set aside.
        CorruptCheckpointError: the copy fails validation, an object of the step is missing
            or has another size, or a referenced object is no longer a committed one.
    """
    check_step(step)
    copies = [
        key
        for key in await store.list_keys(f"{step}/")
        if key.count("/") == 2 and key.endswith("/" + SET_ASIDE_NAME)
    ]
    if not copies:
        raise NotFoundError(f"{store.url}: step {step} has no set-aside copy to recover")
    with contextlib.suppress(NotFoundError):
        current = await read_manifest(store, step)
        raise CommitConflictError(
            f"{store.url}: step {step} was committed again (attempt {current.attempt}) after "
            "it was set aside; the set-aside copy stays until gc removes it"
        )
    key = max(copies)  # the newest attempt, should a step have been set aside twice
    cap = store.settings.layout.manifest_max_bytes
    if (await store.head(key)).size > cap:
        raise CorruptCheckpointError(f"{store.url}/{key}: over the {cap}-byte cap")
    data = await store.get(key)
    manifest = Manifest.parse(data, step=step, max_bytes=cap, source=f"{store.url}/{key}")
    await store.put(key, data)  # newest object again: gc's grace period starts over
    sizes = {
        meta.key: meta.size async for meta in store.list(attempt_prefix(step, manifest.attempt))
    }
    for index in range(len(manifest.object_keys)):
        if manifest.object_step(index) != step:
            continue
        object_key = manifest.object_key(index)
        if sizes.get(object_key) != manifest.object_lengths[index]:
            raise CorruptCheckpointError(
                f"{store.url}: set-aside step {step} cannot be recovered: its object "
                f"{object_key!r} is {'missing' if object_key not in sizes else 'of another size'}"
            )
    await check_references(store, manifest, markers=True)
    try:
        await store.put(manifest_key(step), data, mode="create")
    except AlreadyExistsError:
        raise CommitConflictError(
            f"{store.url}: step {step} was committed again while it was being recovered"
        ) from None
    with contextlib.suppress(NotFoundError):
        await store.delete([key])
    return manifest
