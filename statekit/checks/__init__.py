"""Is it the same? Every identity and verdict of statekit, in one layer above the format.

``digest`` (the keyed-sum digest, the one primitive), ``files`` (is a would-be tensor file the
committed one), ``state_check`` and ``random_check`` (the live state and generators after a
load), ``fingerprint`` (the resume fingerprint's differences), ``audit`` and ``next_batch``
(the resume audit and the next-batch record), ``versions`` (is a live tensor unchanged since a
moment: its version counter). The checksum of moving bytes is :mod:`statekit.storage.hashing`'s;
the live objects' side is :mod:`statekit.engine.live_state`'s and :mod:`statekit.api.fingerprint`'s.
Layers: docs/design-notes.md, "The map".
"""
