"""Save on a preemption signal in a Trainer run: ``statekit_options={"save_on_signal": True}``.

The :class:`statekit.CheckpointManager` installs the signal handlers (they only record the
signal) and owns the save: :meth:`~statekit.CheckpointManager.step_boundary`, called after
every optimizer step, saves that step on every rank once any rank got a signal, then exits
with ``128 + signal number`` (143 for SIGTERM) or, with ``PreemptionPolicy(on_signal="return")``, stops the
training loop (``control.should_training_stop``). ``docs/clusters.md`` has the protocol.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class SaveOnSignal(TrainerCallback):
    """The Trainer callback behind ``save_on_signal``: the manager's safe point at each step end.

    Args:
        trainer: the :class:`statekit_transformers.StatekitTrainerMixin` trainer.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the handlers are in place from the first step (train() puts the previous back when it ends)
        self.trainer.statekit_manager().signal_save.install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.statekit_manager().step_boundary(state.global_step):
            control.should_training_stop = True
