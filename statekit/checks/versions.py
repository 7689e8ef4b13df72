"""Is a live tensor unchanged since a moment? Its version counter says so.

Every in-place operation on a tensor (an optimizer step, ``add_``, ``copy_``, ``zero_``,
a BatchNorm forward updating its running statistics) bumps ``tensor._version``, which the
tensor shares with its views and ``detach()`` (PyTorch's autograd version counter:
https://pytorch.org/docs/stable/notes/autograd.html#in-place-correctness-checks). Equal
versions prove nothing wrote the tensor in between. The one blind spot is torch's own:
writes through ``tensor.data`` use a separate counter (docs/design-notes.md, "Async saves").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def versions(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The version counter of each tensor.

    Args:
        tensors: ``name -> tensor`` (values that are not tensors are skipped).

    Returns:
        ``name -> tensor._version``.
    """
    return {name: t._version for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def changed_since(tensors: Mapping[str, torch.Tensor], before: Mapping[str, int]) -> list[str]:
    """The names whose tensor was written (in place) since :func:`versions` returned ``before``.

    Args:
        tensors: ``name -> tensor``, the same objects ``before`` was taken of.
        before: ``name -> version`` from :func:`versions`.

    Returns:
        The changed names, in ``before``'s order (a name missing from ``tensors`` counts as
        changed: the object was replaced).
    """
    changed = []
    for name, version in before.items():
        t = tensors.get(name)
        if not isinstance(t, torch.Tensor) or t._version != version:
            changed.append(name)
    return changed
