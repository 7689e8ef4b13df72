"""Data-loader position: exact mid-epoch resume of ``DataLoader`` s (below the engine).

Owns: tracking a loader's position while it is iterated, its saved state and its restore
(:mod:`~statekit.loaders.data`), the sampler and generator lookup and the batch-sampler
wrappers that replay an epoch (:mod:`~statekit.loaders.samplers`), iterable datasets and
workers (:mod:`~statekit.loaders.iterable`: a Stateful dataset's state, or re-read and
discard; :mod:`~statekit.loaders.hf_iterable`: what a Hugging Face ``IterableDataset``'s
own state can restore), the random states of batches fetched ahead (:mod:`~statekit.loaders.fetch_rng`)
and of the epoch's start (:mod:`~statekit.loaders.epoch_rng`), elastic resume on another
world size (:mod:`~statekit.loaders.elastic`, :mod:`~statekit.loaders.elastic_layouts`),
the resume audit (:mod:`~statekit.loaders.audit`: the next-batch record a save writes and
the check of the first batch after a resume; :mod:`~statekit.loaders.next_batch`: the record of
the batch yielded right after a save). The global random states these modules
keep are snapshot and restored by :mod:`statekit.devices` (``snapshot_random_states``,
``restore_random_states``, ``rng_guard``), their one owner.

Imports only :mod:`statekit.errors`, :mod:`statekit.devices` and the checksum of
:mod:`statekit.storage.hashing`; nothing here reads or writes a file: the engine stores
the state these functions return.

Call sequence: :func:`~statekit.loaders.data.track` (attach, or the first restore) patches
the loader's ``__iter__``; each epoch's iterator is built through ``_tracked_iter``, which
puts the batch-sampler wrappers on (:func:`~statekit.loaders.samplers.wrap_batch_sampler`:
skip, :func:`~statekit.loaders.iterable.recorder`, :func:`~statekit.loaders.fetch_rng.recorder`,
:func:`~statekit.loaders.epoch_rng.wrapper`, :class:`~statekit.loaders.audit.IndexLog`).
At a save the engine calls :func:`~statekit.loaders.data.loader_state` (position, the
iterable and fetch-ahead fields, :func:`~statekit.loaders.elastic.saved_fields`, the
:class:`~statekit.loaders.audit.NextBatch` record) and
:func:`~statekit.loaders.audit.summary` for the manifest. At a load the API calls
:func:`~statekit.loaders.audit.begin`, then the engine calls
:func:`~statekit.loaders.data.restore_loader` (another world size:
:func:`~statekit.loaders.elastic.plan` and ``install``); the next ``iter(loader)`` replays
the epoch and skips the consumed batches, and its first batch is checked
(:func:`~statekit.loaders.audit.check_first_batch`).
"""
