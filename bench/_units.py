"""The one size parser of the bench scripts (``--size 256MiB``)."""

from __future__ import annotations

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
"""Binary size suffixes and their factors."""


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"1.5GiB"`` or a plain byte count -> bytes.

    Raises:
        ValueError: not a number with an optional KiB/MiB/GiB suffix.
    """
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)
