"""statekit-transformers: transformers' ``Trainer`` checkpoints as statekit checkpoints.

Three lines for a Trainer user (``docs/plugins/transformers.md``)::

    from statekit_transformers import StatekitTrainer   # instead of transformers.Trainer
    trainer = StatekitTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)          # or a checkpoint's path

Names: :class:`StatekitTrainer` (``Trainer`` with the mixin), :class:`StatekitTrainerMixin`
(for a ``Trainer`` subclass: ``class MyTrainer(StatekitTrainerMixin, SFTTrainer)``),
:func:`statekit_trainer_class`. The plugin hooks (:mod:`statekit_transformers.plugin`) are
registered by the ``statekit`` entry point. Importing this package imports neither
transformers nor peft: ``StatekitTrainer`` is built on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StatekitTrainer", "StatekitTrainerMixin", "statekit_trainer_class"]


def __getattr__(name: str) -> Any:
    if name == "StatekitTrainerMixin" or name == "statekit_trainer_class":
        from statekit_transformers import trainer

        return getattr(trainer, name)
    if name == "StatekitTrainer":
        import transformers

        from statekit_transformers import trainer

        cls = trainer.statekit_trainer_class(transformers.Trainer)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module 'statekit_transformers' has no attribute {name!r}")
