"""``save_total_limit`` as transformers' Trainer applies it, as a statekit retention policy.

Trainer (``transformers.trainer_utils.rotate_checkpoints``, called after every save, and the
end of ``Trainer.train``) keeps, of its ``checkpoint-<step>`` folders sorted oldest first:

* all of them while there are at most ``save_total_limit``;
* otherwise the newest and the best (``state.best_model_checkpoint``: set whenever
  ``metric_for_best_model`` is, with or without ``load_best_model_at_end``), which are
  never deleted, plus the newest others up to ``save_total_limit`` folders in all (two
  when the limit is 1 and the best is not the newest);
* at the end of ``train()`` with ``save_total_limit=1`` and a best, the best alone (Trainer
  deletes the other folders itself, also under :class:`~statekit_transformers.StatekitTrainer`).

statekit's ``RetentionPolicy(keep_last=N, keep_best=1)`` keeps their union instead (N newest *and* the
best: one folder more than Trainer whenever the best is older than the N newest).
:class:`TrainerRetention` is Trainer's rule, so a ``StatekitTrainer`` run leaves the folders a
``Trainer`` run leaves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import statekit

__all__ = ["TrainerRetention", "trainer_keeps"]

RETENTION_KEYWORDS = ("keep_last", "keep_best", "monitor", "mode", "keep_every_n_steps")
"""The :class:`statekit.RetentionPolicy` fields a user may give in ``statekit_options``: the
trainer builds the manager's ``retention=`` of them (with Trainer's rotation, if any)."""


def trainer_keeps(names: Sequence[str], save_total_limit: int, best: str | None) -> set[str]:
    """The checkpoints Trainer's rotation keeps (``rotate_checkpoints`` of transformers 5.x).

    Args:
        names: the checkpoints' folder names, oldest first.
        save_total_limit: ``TrainingArguments.save_total_limit`` (> 0).
        best: the folder name of ``TrainerState.best_model_checkpoint``, or None.

    Returns:
        The names kept.
    """
    if len(names) <= save_total_limit:
        return set(names)
    protected = {names[-1]} | ({best} if best else set())  # the newest, for resuming, and the best
    keep_count = max(save_total_limit, len(protected))
    kept, remaining = set(names), len(names)
    for name in names:  # the oldest unprotected first, until keep_count are left
        if remaining <= keep_count:
            break
        if name not in protected:
            kept.discard(name)
            remaining -= 1
    return kept


@dataclass(frozen=True)
class TrainerRetention(statekit.RetentionPolicy):
    """Trainer's ``save_total_limit`` rotation (:func:`trainer_keeps`), plus whatever the
    inherited policies (``keep_last``, ``keep_best``, ``keep_every_n_steps``, from
    ``statekit_options``) keep besides.

    Args:
        save_total_limit: Trainer's limit (a positive int).
        trainer: the ``Trainer`` whose ``state.best_model_checkpoint`` is the best at
            each retention.
        keep_last, keep_best, monitor, mode, keep_every_n_steps: as
            :class:`statekit.RetentionPolicy` (None by default: Trainer's rule alone).

    Raises:
        InvalidOptionError: ``save_total_limit`` is not a positive integer, or an inherited
            value is invalid.
    """

    save_total_limit: int = 1
    trainer: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        limit = self.save_total_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise statekit.InvalidOptionError(f"save_total_limit must be a positive integer, got {limit!r}")

    @property
    def keeps_all(self) -> bool:
        """Never: Trainer's rotation deletes past the limit."""
        return False

    @property
    def keeps_resumed(self) -> bool:
        """False: Trainer's rotation deletes the checkpoint a run resumed from like any other
        old one, and so does this policy."""
        return False

    def kept(self, committed: list[Any]) -> set[str]:
        """The URLs Trainer's rotation keeps of ``committed`` (oldest first) and those the
        inherited policies keep."""
        keep = super().kept(committed)
        best = getattr(getattr(self.trainer, "state", None), "best_model_checkpoint", None)
        best_name = os.path.basename(str(best).rstrip("/\\")) if best else None
        names = trainer_keeps([i.name for i in committed], self.save_total_limit, best_name)
        return keep | {i.url for i in committed if i.name in names}
