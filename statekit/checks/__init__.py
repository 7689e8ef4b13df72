"""Is it the same? Every identity and verdict of statekit, in one layer above the format.

Modules:

- :mod:`~statekit.checks.digest`: the keyed-sum digest, the one primitive: the state digest
  of live tensors (shard-invariant, sampled or full) and the file digest of one tensor file.
- :mod:`~statekit.checks.files`: is a would-be tensor file the committed one (incremental saves).
- :mod:`~statekit.checks.state_check`: the live state after a load against the saved digest.
- :mod:`~statekit.checks.random_check`: the random generators after a load against the save's.
- :mod:`~statekit.checks.fingerprint`: the resume fingerprint's differences and their effects.

Not here: the checksum of bytes as they move (:mod:`statekit.storage.hashing`: computed in the
same pass by the streams, below the format that records it); the live objects' side of each
check (:mod:`statekit.engine.live_state`, :mod:`statekit.api.fingerprint`), which reads objects
of the layers above. Layers and reasons: ``docs/design-notes.md``, "The map".
"""
