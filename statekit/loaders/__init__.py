"""Data-loader position: exact mid-epoch resume of ``DataLoader`` s (below the engine).

``tracking`` (a tracked loader's iteration), ``data`` (position as saved state, restore),
``samplers`` (sampler lookup, batch-sampler wrappers), ``iterable`` and ``hf_iterable``
(iterable datasets and workers), ``fetch_rng`` and ``epoch_rng`` (random states of read-ahead
batches and of the epoch start), ``elastic`` and ``elastic_layouts`` (another world size),
``index_log`` (what the resume audit compares). Positions only: the checks are
:mod:`statekit.checks`'; nothing here reads or writes a file.
Call sequences: docs/design-notes.md, "Call sequences through each package" (loaders).
"""
