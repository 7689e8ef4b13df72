"""The targets of issue 14, computed from ``bench/run.py``'s records of one run.

Every target is a ratio computed per run (``run`` index: the numerator and denominator
measured in the same pass over the systems), summarised as min-median-max over runs; the
verdict compares the median with the threshold. A row that is faster than the disk
limit of its own run is flagged: a system that beats the limit means the limit is wrong.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

#: ``(name, description, threshold, direction)``; ``"<="``: met when ratio <= threshold;
#: threshold ``None``: reported only.
TARGETS = (
    ("load_vs_read_limit", "statekit load / disk read limit", 1.25, "<="),
    ("save_vs_write_limit", "statekit save / disk write limit", 1.25, "<="),
    ("save_vs_fastest", "statekit save / fastest save of accelerate, torch, dcp", 1.0, "<="),
    ("load_vs_fastest", "statekit load / fastest load of accelerate, torch, dcp", 1.0, "<="),
    ("accelerate_over_statekit", "(accelerate save + load) / (statekit save + load)", None, ">="),
    ("sync_save_peak_rss", "statekit sync save extra peak RSS / state bytes", 0.05, "<="),
    ("async_block_vs_memcpy", "statekit async save blocking time / one memcpy of the state", 1.5, "<="),
    ("train_during_save", "training steps overlapping a statekit async save / undisturbed", 1.10, "<="),
    ("train_during_dcp_thread_save", "training steps overlapping DCP async_save (thread) / undisturbed", None, "<="),
    ("train_during_dcp_process_save", "training steps overlapping DCP async_save (process) / undisturbed", None, "<="),
    ("accel_block_vs_pinned_copy", "accelerator: statekit async save blocking time / one plain pinned device-to-host copy", 1.5, "<="),
    ("accel_stage_vs_pinned_copy", "accelerator: statekit staging of the state / one plain pinned device-to-host copy", None, "<="),
    ("accel_load_vs_torch", "accelerator: statekit load onto the GPU / torch.load(map_location) + load_state_dict", None, "<="),
    ("small_save_vs_torch", "2,500 Linear(8, 8) + AdamW: statekit save / torch.save", 1.0, "<="),
    ("small_load_vs_torch", "2,500 Linear(8, 8) + AdamW: statekit load / torch.load", 1.0, "<="),
)
COMPETITORS = ("accelerate", "torch", "dcp")
LIMITED_OPS = {"save": "write", "load": "read", "async_total": "write"}


def _by_run(records: list[dict], storage: str, system: str, op: str, field: str = "seconds") -> dict[int, float]:
    return {r.get("run", 0): r[field] for r in records
            if r.get("storage", "local") == storage and r["system"] == system and r["op"] == op and r.get(field) is not None}


def _per_run(parts: list[dict[int, float]], fn: Callable[..., Optional[float]]) -> list[float]:
    runs = set.intersection(*(set(p) for p in parts)) if parts else set()
    out = []
    for run in sorted(runs):
        value = fn(*(p[run] for p in parts))
        if value is not None:
            out.append(value)
    return out


def _fastest(records: list[dict], op: str) -> dict[int, float]:
    runs: dict[int, float] = {}
    for system in COMPETITORS:
        for run, sec in _by_run(records, "local", system, op).items():
            runs[run] = min(sec, runs.get(run, sec))
    return runs


def _train_ratios(records: list[dict], system: str) -> list[float]:
    """Per-run ratios of the training benchmark (``bench/async_training.py``): records with
    op ``train_async_overlap`` and ``overlap_ratio`` (or op ``train_overlap`` and
    ``ratio``), else ``train_during_save`` over ``train_undisturbed`` seconds."""
    direct = [r.get("overlap_ratio", r.get("ratio")) for r in records if r["system"] == system
              and r["op"] in ("train_async_overlap", "train_overlap")]
    direct = [v for v in direct if v is not None]
    if direct:
        return direct
    during = {r.get("run", 0): r["seconds"] for r in records if r["system"] == system and r["op"] == "train_during_save"}
    calm = {r.get("run", 0): r["seconds"] for r in records if r["system"] == system and r["op"] == "train_undisturbed"}
    return _per_run([during, calm], lambda a, b: a / b if b > 0 else None)


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b > 0 else None


def target_ratios(records: list[dict]) -> dict[str, list[float]]:
    """Per-run ratios of every target in :data:`TARGETS` (empty list: not measured).

    Args:
        records: ``bench/run.py`` records (``system``, ``op``, ``storage``, ``seconds``,
            ``peak_rss_bytes``, ``state_bytes``, ``run``; training records may carry
            ``ratio`` instead of ``seconds``).
    """
    sk = lambda op, field="seconds": _by_run(records, "local", "statekit", op, field)  # noqa: E731
    acc = lambda op: _by_run(records, "local", "accelerate", op)  # noqa: E731
    small = lambda system, op: _by_run(records, "small", system, op)  # noqa: E731
    gpu = lambda system, op: _by_run(records, "accelerator", system, op)  # noqa: E731
    return {
        "load_vs_read_limit": _per_run([sk("load"), _by_run(records, "local", "limit", "read")], _ratio),
        "save_vs_write_limit": _per_run([sk("save"), _by_run(records, "local", "limit", "write")], _ratio),
        "save_vs_fastest": _per_run([sk("save"), _fastest(records, "save")], _ratio),
        "load_vs_fastest": _per_run([sk("load"), _fastest(records, "load")], _ratio),
        "accelerate_over_statekit": _per_run(
            [acc("save"), acc("load"), sk("save"), sk("load")], lambda a, b, c, d: _ratio(a + b, c + d)),
        "sync_save_peak_rss": _per_run([sk("save", "peak_rss_bytes"), sk("save", "state_bytes")], _ratio),
        "async_block_vs_memcpy": _per_run([sk("async_block"), _by_run(records, "local", "limit", "memcpy")], _ratio),
        "train_during_save": _train_ratios(records, "statekit"),
        "train_during_dcp_thread_save": _train_ratios(records, "dcp_thread"),
        "train_during_dcp_process_save": _train_ratios(records, "dcp_process"),
        "accel_block_vs_pinned_copy": _per_run([gpu("statekit", "async_block"), gpu("pinned-copy", "d2h")], _ratio),
        "accel_stage_vs_pinned_copy": _per_run([gpu("statekit", "stage"), gpu("pinned-copy", "d2h")], _ratio),
        "accel_load_vs_torch": _per_run([gpu("statekit", "load"), gpu("torch", "load")], _ratio),
        "small_save_vs_torch": _per_run([small("statekit", "save"), small("torch", "save")], _ratio),
        "small_load_vs_torch": _per_run([small("statekit", "load"), small("torch", "load")], _ratio),
    }


def below_limit(records: list[dict]) -> list[dict]:
    """Rows faster than the disk limit of the same run (ratio < 1.0): the limit is wrong.

    Local saves, async totals and loads of every system are compared with the run's
    ``limit`` write or read; returns ``[{"system", "op", "run", "ratio"}]``.
    """
    flagged = []
    for r in records:
        kind = LIMITED_OPS.get(r["op"])
        if r.get("storage", "local") != "local" or kind is None or r["system"].startswith("limit") or r.get("seconds") is None:
            continue
        limit = _by_run(records, "local", "limit", kind).get(r.get("run", 0))
        if limit and r["seconds"] / limit < 1.0:
            flagged.append({"system": r["system"], "op": r["op"], "run": r.get("run", 0), "ratio": r["seconds"] / limit})
    return flagged


def compute_targets(records: list[dict]) -> list[dict]:
    """The targets section: one dict per :data:`TARGETS` entry, plus a ``limit_sanity`` one.

    Each is ``{"name", "description", "threshold", "direction", "runs", "min", "median",
    "max", "met"}``; ``met`` is ``True``/``False`` from the median ratio, ``None`` when the
    target is reported only or was not measured (``runs`` = 0). ``limit_sanity`` is met
    when no row beats its run's disk limit and lists the rows that do under ``"rows"``.
    """
    ratios = target_ratios(records)
    out = []
    for name, description, threshold, direction in TARGETS:
        vals = ratios.get(name, [])
        entry = {"name": name, "description": description, "threshold": threshold, "direction": direction,
                 "runs": len(vals), "min": None, "median": None, "max": None, "met": None}
        if vals:
            med = statistics.median(vals)
            entry.update(min=min(vals), median=med, max=max(vals))
            if threshold is not None:
                entry["met"] = med <= threshold if direction == "<=" else med >= threshold
        out.append(entry)
    flagged = below_limit(records)
    out.append({"name": "limit_sanity", "description": "no row faster than its run's disk limit (< 1.0x limit)",
                "threshold": 1.0, "direction": ">=", "runs": len({r.get("run", 0) for r in records}),
                "min": min((f["ratio"] for f in flagged), default=None), "median": None, "max": None,
                "met": not flagged, "rows": flagged})
    return out


def format_targets(targets: list[dict]) -> str:
    """The targets as text lines: verdict, ratio min-median-max, threshold, description."""
    lines = ["targets (ratio per run: min-median-max; verdict on the median):"]
    for t in targets:
        verdict = {True: "MET   ", False: "MISSED", None: "report"}[t["met"]]
        if t["name"] == "limit_sanity":
            rows = ", ".join(f"{f['system']} {f['op']} run {f['run']} {f['ratio']:.2f}x" for f in t["rows"])
            lines.append(f"  {verdict} {t['name']:26s} {'rows below 1.0x limit: ' + rows if rows else 'no row beats the limit'}")
            continue
        nums = f"{t['min']:.3f}-{t['median']:.3f}-{t['max']:.3f}" if t["runs"] else "not measured"
        thr = f"{t['direction']} {t['threshold']}" if t["threshold"] is not None else "reported"
        lines.append(f"  {verdict} {t['name']:26s} {nums:>20s} {thr:>9s}  {t['description']}")
    return "\n".join(lines)
