"""``statekit plugins``: the installed plugins, where they come from, their hooks and converters."""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Any

import click

from statekit.cli.output import emit, fail, table
from statekit.errors import StatekitError, StatekitWarning
from statekit.hooks.registry import ENTRY_POINT_GROUP, get_plugin_manager


def _loaded(pm: Any) -> list[dict[str, Any]]:
    """The registered plugins, sorted by name."""
    rows = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0] or ""):
        if plugin is None:
            continue
        source = pm.sources.get(name)
        rows.append({
            "name": name,
            "distribution": source.distribution if source else None,
            "version": source.version if source else None,
            "origin": source.origin if source else "code",
            "entry_point": source.entry_point if source else None,
            "hooks": sorted(h.name for h in pm.get_hookcallers(plugin) or []),
            "blocked": False,
            "converters": sorted(getattr(plugin, "STATEKIT_CONVERTERS", {}) or {}),
        })
    return rows


def _blocked(pm: Any) -> list[dict[str, Any]]:
    """The installed entry-point plugins that were blocked (``STATEKIT_DISABLE_PLUGINS``)."""
    rows = []
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and pm.is_blocked(ep.name):
                rows.append({"name": ep.name, "distribution": dist.metadata["name"], "version": dist.version,
                             "origin": "entry point", "entry_point": ep.value, "hooks": [], "blocked": True, "converters": []})
    return rows


def _broken(pm: Any) -> list[dict[str, Any]]:
    """The installed entry-point plugins that failed to import (skipped; ``pm.broken``)."""
    return [{"name": name, "distribution": b.source.distribution, "version": b.source.version, "origin": "entry point",
             "entry_point": b.source.entry_point, "hooks": [], "blocked": False, "converters": [], "broken": b.error}
            for name, b in sorted(pm.broken.items())]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plugins(as_json: bool) -> None:
    """List plugins: name, distribution, version, origin and hooks (blocked ones marked;
    one that fails to import is listed as broken, with its error, and the others still are)."""
    try:
        with warnings.catch_warnings():  # a broken plugin is shown in the table, not warned about
            warnings.simplefilter("ignore", StatekitWarning)
            pm = get_plugin_manager()
    except StatekitError as exc:
        fail(exc)
    rows = [{**r, "broken": None} for r in _loaded(pm) + _blocked(pm)] + _broken(pm)
    text = table(
        [[r["name"] + (" (blocked)" if r["blocked"] else " (broken)" if r["broken"] else ""), r["distribution"] or "-",
          r["version"] or "-", r["origin"] + (f" {r['entry_point']}" if r["entry_point"] else ""),
          ", ".join(r["hooks"]) or "-"] for r in rows],
        ["plugin", "distribution", "version", "from", "hooks"],
    ) if rows else "no plugins installed"
    for r in rows:
        if r["broken"]:
            text += (f"\nbroken: {r['name']} failed to import: {r['broken']} (its hooks do not run; fix or reinstall "
                     f"{r['distribution']}, or set STATEKIT_DISABLE_PLUGINS={r['name']})")
    emit(as_json, rows, text)
