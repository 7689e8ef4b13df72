"""Data-loader position: exact mid-epoch resume of ``DataLoader`` s (below the engine).

Modules:

- :mod:`~statekit.loaders.tracking`: a tracked loader's iteration (its position, the replay of an epoch).
- :mod:`~statekit.loaders.data`: a loader's position as saved state, its restore.
- :mod:`~statekit.loaders.samplers`: the sampler and generator lookup; the batch-sampler
  wrappers that replay an epoch.
- :mod:`~statekit.loaders.iterable`: iterable datasets and workers (a Stateful dataset's
  state, or re-read and discard).
- :mod:`~statekit.loaders.hf_iterable`: what a Hugging Face ``IterableDataset``'s own state restores.
- :mod:`~statekit.loaders.fetch_rng`: the random states of batches fetched ahead.
- :mod:`~statekit.loaders.epoch_rng`: the random states of the epoch's start.
- :mod:`~statekit.loaders.elastic`: resume on another world size: a layout, a plan, its install.
- :mod:`~statekit.loaders.elastic_layouts`: the layout models' index arithmetic.
- :mod:`~statekit.loaders.index_log`: what a tracked loader draws and holds, for the resume audit
  (:mod:`statekit.checks.audit`).

Positions only: what each check concludes from them is :mod:`statekit.checks`' (the resume
audit, the next-batch record). Nothing here reads or
writes a file: the engine stores the state these functions return.

Call sequences: docs/design-notes.md, "Call sequences through each package" (loaders).
"""
