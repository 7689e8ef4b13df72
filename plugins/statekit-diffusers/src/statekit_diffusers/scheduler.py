"""``NoiseScheduler``: a diffusers noise scheduler made checkpointable.

A diffusers scheduler has a ``config`` but no ``state_dict()``; the wrapper's state is its
configuration (docs/plugins/diffusers.md#the-noise-scheduler).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statekit.plugin_api import StatekitError, StatekitWarning, warn_user

from statekit_diffusers import layout


class NoiseScheduler:
    """Stateful wrapper around a diffusers noise scheduler (its state is its configuration).

    Args:
        scheduler: a diffusers scheduler (anything with a ``config`` mapping, such as a
            ``SchedulerMixin``). The wrapper keeps a reference; keep using the scheduler
            itself for ``add_noise``/``step``.

    Attributes:
        scheduler: the wrapped scheduler.

    Raises:
        StatekitError: ``scheduler`` has no ``config`` mapping.
    """

    def __init__(self, scheduler: Any) -> None:
        if not isinstance(getattr(scheduler, "config", None), Mapping):
            raise StatekitError(
                f"NoiseScheduler needs a diffusers scheduler with a .config mapping, got {type(scheduler).__name__}"
            )
        self.scheduler = scheduler

    @property
    def class_name(self) -> str:
        """The wrapped scheduler's class name (``"DDPMScheduler"``)."""
        return type(self.scheduler).__name__

    def config_json(self) -> dict[str, Any]:
        """The ``scheduler_config.json`` content, as diffusers writes it (``_class_name`` and
        ``_diffusers_version`` included)."""
        return layout.diffusers_config(self.scheduler.config, self.class_name)

    def state_dict(self) -> dict[str, Any]:
        """Returns:
        ``{"class": <class name>, "config": <scheduler_config.json content>}`` (JSON values).
        """
        return {"class": self.class_name, "config": self.config_json()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Compare a saved configuration with the live scheduler; the scheduler is not changed.

        Its tables (betas, alphas) are built from its configuration, so a different one
        cannot be applied in place: build it with ``DDPMScheduler.from_config(...)``.

        Args:
            state: what :meth:`state_dict` returned at save time.

        Warns:
            StatekitWarning: the class or public configuration entries differ (listed).

        Raises:
            StatekitError: ``state`` is not a saved scheduler state.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("config"), Mapping):
            raise StatekitError(f"NoiseScheduler: not a saved scheduler state: {type(state).__name__}")
        saved_class = state.get("class") or state["config"].get("_class_name")
        differences = []
        if saved_class != self.class_name:
            differences.append(f"class saved {saved_class} vs live {self.class_name}")
        changes = layout.config_changes(self.scheduler.config, state["config"])
        differences += [f"{k} saved {v!r} vs live {self.scheduler.config.get(k)!r}" for k, v in sorted(changes.items())]
        if differences:
            warn_user(
                "the noise scheduler differs from the checkpoint's (not changed; training will not resume exactly): "
                + "; ".join(differences),
                StatekitWarning,
            )

    def __repr__(self) -> str:
        return f"NoiseScheduler({self.class_name})"
