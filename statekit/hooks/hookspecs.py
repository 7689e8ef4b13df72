"""The statekit hook contract: the hook specifications, and nothing else.

Each spec is an empty function whose docstring *is* the reference (as in pytest's
``hookspec.py``). Plugins implement them with :data:`statekit.hookimpl`. The calling rules
common to every hook (one at a time, under an RNG guard, no wrappers, errors become
:class:`statekit.PluginError`): docs/hooks.md, "Calling rules".
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

if TYPE_CHECKING:  # annotation-only imports keep this module cheap
    import torch

    from statekit.engine.context import Checkpoint
    from statekit.format.manifest_types import Manifest

hookspec = pluggy.HookspecMarker("statekit")


@hookspec
def statekit_attach(accelerator: Any, objects: MutableMapping[str, Any]) -> None:
    """Prepare a training run for exact checkpointing.

    Called once, on every rank, when a :class:`statekit.CheckpointManager` is created or
    :func:`statekit.attach` is called, before the training loop starts; and, for an
    accelerator attached before (or between) its ``prepare()`` calls, again after each
    later ``prepare()`` with only the objects that call added (so a data loader prepared
    after ``attach`` is prepared for exact resume too).

    Args:
        accelerator: the ``accelerate.Accelerator`` of the run, or None when the run uses
            the mapping API without Accelerate.
        objects: the run's stateful objects by stable key (``model_0``, ``optimizer_0``,
            ``scheduler_0``, ``dataloader_0``, ``custom_0``...; or the mapping's own keys).
            Read-only by convention: a plugin may change the objects (for example give a
            data loader's sampler a ``torch.Generator`` of its own) but must not add or
            remove keys.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`;
            the manager or ``attach()`` call fails.
    """


@hookspec
def statekit_save_state_pre(
    models: list[torch.nn.Module],
    weights: list[Mapping[str, torch.Tensor]],
    output_dir: str,
    checkpoint: Checkpoint,
) -> None:
    """Save state before the core does; optionally take models and objects out of its path.

    Called on every rank, before any I/O of the core, once per save (the Accelerate
    ``register_save_state_pre_hook`` contract, widened).

    Args:
        models: the models to save, in stable-key order. A plugin that saves a model
            itself removes it from this list (``models.remove(m)``) *and* removes the entry
            at the same index from ``weights``; the core then skips it and the manifest
            records the plugin as its owner. Removal is matched by identity, so the other
            models keep their file names.
        weights: state dicts parallel to ``models``. Entries are lazy: the state dict is
            computed on first access (no collective is run), and ``weights.pop(i)`` does
            not compute it. In ``attach`` mode these are Accelerate's own state dicts.
        output_dir: the checkpoint's URL (``/local/path``, ``s3://bucket/x``...).
        checkpoint: the :class:`statekit.engine.context.Checkpoint` context: ``url``, ``fs``,
            ``rank``, ``world_size``, ``step``, ``accelerator``, ``options``, ``plugin``,
            ``objects`` (other stateful objects by stable key; pop one to own it),
            ``records`` (a JSON-able dict stored in the manifest for this plugin), and the
            writers ``open``, ``save_tensors``, ``save_json``, ``save_state``. With an async
            save the writers stage (copy what they are given) and defer the I/O.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`
            naming plugin and hook. Nothing is committed; the previous checkpoint is
            untouched.
    """


@hookspec
def statekit_boundary_state(objects: Mapping[str, Any]) -> Any:
    """Capture, at a step boundary, the state this plugin's ``statekit_save_state_pre``
    would save that does not live in the run's tensors (random states, counters), so that
    a save of that boundary made later, while training has gone on, writes it.

    Called on the main thread at every safe point of a manager with ``save_on_signal``
    (``step_boundary``), without the RNG guard: keep it cheap (microseconds) and read-only.
    A save of the boundary (the save on a signal from the watcher thread,
    :mod:`statekit.manager.signal_watcher`) runs ``statekit_save_state_pre`` with
    ``checkpoint.boundary_state()`` returning what this call returned; a plugin that does
    not implement it saves its live state there (fine for state that only training steps
    change: the watcher proves none ran).

    Args:
        objects: the stateful objects of the save by stable key (as ``checkpoint.objects``).

    Returns:
        Anything (kept by reference: return copies of what changes), or None.

    Raises:
        PluginError: anything the plugin raises; the boundary's state is not taken (a
            signal then saves at the next safe point).
    """


@hookspec
def statekit_save_state_post(models: list[torch.nn.Module], output_dir: str, checkpoint: Checkpoint) -> None:
    """React to a committed checkpoint (upload a copy, log, notify...).

    Called on every rank after the manifest was written and all ranks passed a barrier.
    With async saving it is called when the background write has committed, from the
    next ``save()`` or ``wait()``.

    Args:
        models: every model of the save, including those plugins took.
        output_dir: the checkpoint's URL.
        checkpoint: the context; ``checkpoint.manifest`` holds the committed manifest.
            Writers are closed: a post-hook must not write into the checkpoint.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`,
            but the checkpoint stays committed.
    """


@hookspec
def statekit_load_state_pre(models: list[torch.nn.Module], input_dir: str, checkpoint: Checkpoint) -> None:
    """Load state before the core does; take the models and objects this plugin owns.

    Called on every rank after the manifest was read and validated, before the core
    loads anything (the Accelerate ``register_load_state_pre_hook`` contract, widened).

    Args:
        models: the models to load into, in stable-key order. A plugin that loads a model
            itself removes it from the list; the core skips it. A model the manifest
            records as owned by this plugin *must* be taken, or load fails with
            :class:`statekit.PluginError`; a model owned by a plugin that is not installed
            fails with :class:`statekit.PluginMissingError` before any hook runs.
        input_dir: the checkpoint's URL.
        checkpoint: the context: as for save, plus ``manifest`` and ``records`` (what this
            plugin stored in ``checkpoint.records`` at save time), and the readers
            ``open``, ``load_tensors``, ``load_json``, ``load_state``. ``key_of(model)``
            and ``owner_of(key)`` give the stable key and the owner recorded at save time.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`.
            Models the core has not loaded yet are untouched; the error says which
            plugin failed.
    """


@hookspec
def statekit_load_state_post(models: list[torch.nn.Module], input_dir: str, checkpoint: Checkpoint) -> None:
    """Finish a load after the core restored its objects (statekit-rng restores RNG here, last).

    Called on every rank after every model and object has been restored.

    Args:
        models: every model of the load, including those plugins took.
        input_dir: the checkpoint's URL.
        checkpoint: the context, as for ``statekit_load_state_pre``.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`;
            the models and objects are already restored.
    """


# ----------------------------------------------------------------------------------------
# Manager hooks: a run's checkpoints under a CheckpointManager root, not one checkpoint.
# They let a plugin extend the manager (another tier, a background copy of each
# checkpoint) with them and statekit.plugin_api alone (``docs/hooks.md``). ``manager``
# is the :class:`statekit.CheckpointManager`; a plugin relies on what :class:`ManagerView`
# lists and nothing else. No ``checkpoint`` context is passed, and ``checkpoint.plugin``
# attribution does not apply.


@runtime_checkable
class Tier(Protocol):
    """What the core asks of a tier plugin: one that copies every committed checkpoint to
    another root (``docs/tiers.md``). The plugin keeps an object with these three methods in
    ``manager.plugin_state[<its name>]`` (from ``statekit_manager_start``); the core finds it
    there by this protocol, never by the plugin's name (``statekit.plugin_api.Tier``).

    What the core does with it: :meth:`statekit.CheckpointManager.stats` reports the summed
    :meth:`backlog`; the save on a signal waits (up to the grace period) for the signal's
    checkpoint to be in :meth:`copied_names` of every tier, then bounds the tiers' exit
    wait with :meth:`exit_by`. A class may inherit from it (``class MyTier(Tier)``) or just
    have the methods.
    """

    def backlog(self) -> dict[str, int]:
        """What this rank has still to copy: ``{"checkpoints": n, "files": n, "bytes": n, ...}``
        (counts, bytes; more keys allowed). Called from any thread; cheap."""

    def copied_names(self) -> set[str]:
        """Names (``CheckpointDir.name``) of the checkpoints whose copy on the tier committed."""

    def exit_by(self, deadline: float) -> None:
        """Give up waiting for queued copies at interpreter exit after ``deadline``
        (``time.monotonic()`` seconds): the process must exit before the scheduler's kill."""


@runtime_checkable
class ManagerView(Protocol):
    """What a manager hook may rely on of the :class:`statekit.CheckpointManager` it is
    handed (``manager``): the promised part of the manager for plugins
    (``statekit.plugin_api.ManagerView``, ``docs/hooks.md``). Anything else on the manager
    may change between releases.

    Attributes:
        root_url: the manager's root (this rank's; with several ranks it may be a disk of
            the node only), normalised as a URL.
        storage_options: fsspec options of the root, or None.
        options: the checkpoint options passed to every save and load (``**options`` of
            ``CheckpointManager`` that are not manager options).
        manager_options: the manager-level options plugins declare
            (``STATEKIT_MANAGER_OPTIONS``): every declared name, with the value given to
            ``CheckpointManager(...)`` or the declared default, validated by
            ``statekit_manager_options`` (read-only).
        resumed_from: URL of the checkpoint the run resumed from (it may be under another
            root a plugin offered), or None before a resume.
        plugin_state: per-manager state of plugins, a dict in which each plugin keeps its
            own under its own name (as pytest's ``config.stash``).
    """

    root_url: str
    storage_options: dict[str, Any] | None
    options: dict[str, Any]
    manager_options: Mapping[str, Any]
    resumed_from: str | None
    plugin_state: dict[str, Any]

    def list(self) -> list[Any]:
        """Every checkpoint directory under the root (committed or not), oldest first, as
        ``statekit.plugin_api.CheckpointDir`` (``url``, ``name``, ``step``, ``committed``,
        ``kind``, ``metrics``...); folders statekit did not write (a Trainer ``checkpoint-500``)
        are listed with their ``kind`` and never committed."""

    def url_for(self, step: int) -> str:
        """URL of the checkpoint directory of ``step`` under the root (``checkpoint-<step:08d>``)."""

    def url_of(self, name: str) -> str:
        """URL of the directory ``name`` under the root (a checkpoint's name, as
        ``CheckpointDir.name``, on this rank's root)."""


@hookspec
def statekit_manager_options(options: Mapping[str, Any]) -> None:
    """Validate the manager-level options a plugin declares.

    A plugin owns keyword options of ``CheckpointManager(...)`` by declaring them as
    ``STATEKIT_MANAGER_OPTIONS``, a mapping of option name to default
    (``docs/hooks.md``). The manager takes them out of its ``**options`` (they are
    not passed to saves and loads) and calls this hook with them before it creates
    anything, on every rank.

    Args:
        options: every manager-level option of the registered plugins, with the value
            given or the declared default (read-only; a plugin checks its own names). The
            same mapping is ``manager.manager_options`` in the other manager hooks.

    Returns:
        Nothing; return values are ignored.

    Raises:
        InvalidOptionError: a value is invalid (naming the option and the value); it
            passes through with its type and the manager is not created. Anything else
            the plugin raises becomes a :class:`statekit.PluginError`.
    """


@hookspec
def statekit_manager_start(manager: ManagerView) -> None:
    """Start what a plugin runs beside a manager (a background copier, say) and catch
    up on work a killed process left undone.

    Called on every rank, once, at the end of ``CheckpointManager(...)`` (after
    ``statekit_attach``). Every rank calls it at the same point, so an implementation may
    run collectives on :func:`statekit.plugin_api.statekit_group` (and then must not raise
    between them on one rank only).

    Args:
        manager: the new :class:`statekit.CheckpointManager` (as a :class:`ManagerView`).

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`;
            the manager is not created.
    """


@hookspec
def statekit_checkpoint_committed(url: str, manifest: Manifest, manager: ManagerView) -> None:
    """React at once to a checkpoint the manager committed under its root.

    Called on every rank right after the commit, once rank 0 updated ``latest`` and
    applied retention, on the thread that committed: the caller's for a blocking save,
    the background writer's for an async save, while training goes on. (That is the
    difference from ``statekit_save_state_post``, which for an async save waits for the
    next ``save()`` or ``wait()``.) So an implementation must return quickly (queue the
    work; no I/O of checkpoint size), runs **without** the RNG guard (restoring the global
    random state from another thread would rewind the training thread's) and must not
    draw from the global random generators. Every rank calls it at the same point: it may
    run collectives on :func:`statekit.plugin_api.statekit_group` (never raising between
    them on one rank only).

    Args:
        url: the committed checkpoint's URL under ``manager.root_url`` (this rank's root).
        manifest: the committed manifest (a :class:`statekit.plugin_api.Manifest`, frozen).
        manager: the :class:`statekit.CheckpointManager` (as a :class:`ManagerView`).

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`,
            raised by the save (an async save's by its ``wait()``); the checkpoint stays
            committed.
    """


@hookspec
def statekit_retention_keep(checkpoints: list[Any], manager: ManagerView) -> Any:
    """Veto the deletion of checkpoints by the manager's retention.

    Called on rank 0 each time retention runs (after a commit, when a policy such as
    ``keep_last`` is set), before anything is deleted. A checkpoint is kept if a policy,
    the manager (the newest, the resumed-from one) or *any* implementation keeps it.

    Args:
        checkpoints: the committed checkpoints under the root retention chooses from, as
            ``statekit.plugin_api.CheckpointDir`` (``url``, ``name``, ``step``,
            ``metrics``...), oldest first.
        manager: the :class:`statekit.CheckpointManager` (as a :class:`ManagerView`).

    Returns:
        An iterable of URLs (from ``checkpoints``) to keep, one URL, or None.

    Raises:
        PluginError: anything the plugin raises, or a result that is not URLs, becomes a
            :class:`statekit.PluginError`; nothing is deleted and the save raises it (the
            checkpoint stays committed).
    """


@hookspec
def statekit_resume_roots(manager: ManagerView) -> Any:
    """Offer other roots (a remote tier, say) whose committed checkpoints ``resume()`` may
    load.

    Called on rank 0 only, at the start of ``CheckpointManager.resume()``. Rank 0 lists
    the manager's root and every root offered, and decides for every rank the order the
    candidates are tried in: newest step first; for the same step the manager's own root
    first, then the roots in the order offered. A root that cannot be listed warns with
    its URL and is left out. When the newest local checkpoint also exists under an
    offered root with a different manifest, a warning names both (the local one is
    tried first). Checkpoints are loaded from an offered root in place, streamed and
    verified, with that root's storage options.

    Args:
        manager: the :class:`statekit.CheckpointManager` (as a :class:`ManagerView`).

    Returns:
        A list of :class:`statekit.plugin_api.Storage` (each carries its fsspec options),
        or None.

    Raises:
        PluginError: anything the plugin raises, or a result that is not such pairs,
            becomes a :class:`statekit.PluginError` and ``resume()`` raises it before
            loading anything.
    """


@hookspec
def statekit_manager_wait(manager: ManagerView, timeout: float | None) -> None:
    """Wait for a plugin's background work for this manager (uploads in flight...).

    Called on every rank by ``CheckpointManager.wait()`` (and on leaving its ``with``
    block), after the pending async save finished. An implementation waits at most
    ``timeout`` seconds and warns (:class:`statekit.StatekitWarning`) about each piece of
    work that did not finish, naming its URL; it does not raise for unfinished work.

    Args:
        manager: the :class:`statekit.CheckpointManager` (as a :class:`ManagerView`).
        timeout: seconds to wait at most, or None to wait until done.

    Returns:
        Nothing; return values are ignored.

    Raises:
        PluginError: anything the plugin raises becomes a :class:`statekit.PluginError`.
    """
