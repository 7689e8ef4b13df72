"""Is it the same? Every identity and verdict of statekit, in one layer above the format.

Modules:

- :mod:`~statekit.checks.digest`: the keyed-sum digest, the one primitive: the state digest
  of live tensors (shard-invariant, sampled or full) and the file digest of one tensor file.
- :mod:`~statekit.checks.files`: is a would-be tensor file the committed one (incremental saves).
- :mod:`~statekit.checks.state_check`: the live state after a load against the saved digest.
- :mod:`~statekit.checks.random_check`: the random generators after a load against the save's.
- :mod:`~statekit.checks.fingerprint`: the resume fingerprint's differences and their effects.
- :mod:`~statekit.checks.audit`: the resume audit: the first batch each restored loader yields
  against the save's record of it, and the resume's verdict.
- :mod:`~statekit.checks.next_batch`: the record of the batch a loader yielded right after a save.
- :mod:`~statekit.checks.versions`: is a live tensor unchanged since a moment (its version counter).

Not here: the checksum of bytes as they move (:mod:`statekit.storage.hashing`: computed in the
same pass by the streams, below the format that records it); the live objects' side of each
check (:mod:`statekit.engine.live_state`, :mod:`statekit.api.fingerprint`), which reads objects
of the layers above. Layers and reasons: ``docs/design-notes.md``, "The map".
"""
