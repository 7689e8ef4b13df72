"""Tied-parameter groups: merging groups from several sources (union-find)."""

from __future__ import annotations

from collections.abc import Iterable


def merge_groups(groups: Iterable[Iterable[str]], names: set[str] | None = None) -> list[list[str]]:
    """Merge overlapping groups of names into disjoint groups.

    Args:
        groups: groups of names that are tied together (any overlap joins two groups).
        names: keep only these names (None: keep all).

    Returns:
        The disjoint groups with at least two members, each sorted, in order of their
        first member.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in groups:
        members = [n for n in group if names is None or n in names]
        for member in members:
            find(member)
        for other in members[1:]:
            a, b = find(members[0]), find(other)
            if a != b:
                parent[b] = a
    merged: dict[str, list[str]] = {}
    for n in parent:
        merged.setdefault(find(n), []).append(n)
    return sorted((sorted(g) for g in merged.values() if len(g) > 1), key=lambda g: g[0])
