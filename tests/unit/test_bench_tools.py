"""The benchmark's own tools (bench/_fio.py, bench/_targets.py, bench/run.py's limit
choice): fio's JSON report is parsed, and targets are marked met/missed from synthetic
records. No timing is asserted here."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from repo_paths import ROOT  # noqa: E402

BENCH = str(ROOT / "bench")
sys.path.insert(0, BENCH)

import _fio  # noqa: E402
import _targets  # noqa: E402
import run as bench_run  # noqa: E402

# Trimmed from a real `fio --output-format=json` (fio-3.33) write job; fio may print a
# warning line before the document.
SAMPLE = "fio: some warning\n" + json.dumps({
    "fio version": "fio-3.33",
    "jobs": [{
        "jobname": "statekit-limit-write", "error": 0,
        "job options": {"rw": "write", "bs": "16M", "direct": "1", "ioengine": "libaio", "iodepth": "8"},
        "read": {"io_bytes": 0, "bw_bytes": 0, "runtime": 0},
        "write": {"io_bytes": 268435456, "bw_bytes": 455747803, "runtime": 589},
    }],
})


def test_parse_fio_json_reads_throughput_engine_and_version():
    res = _fio.parse_fio_json(SAMPLE, "write")
    assert res == {"bw_bytes": 455747803.0, "io_bytes": 268435456, "runtime_s": 0.589,
                   "engine": "libaio", "fio_version": "fio-3.33"}


def test_parse_fio_json_errors_name_the_fault():
    with pytest.raises(ValueError, match="no JSON report"):
        _fio.parse_fio_json("fio: engine io_uring not loadable", "write")
    failed = json.loads(SAMPLE.split("\n", 1)[1])
    failed["jobs"][0]["error"] = 22
    with pytest.raises(ValueError, match="'statekit-limit-write' failed with error 22"):
        _fio.parse_fio_json(json.dumps(failed), "write")
    with pytest.raises(ValueError, match="moved no read bytes"):
        _fio.parse_fio_json(SAMPLE, "read")
    with pytest.raises(ValueError, match="no jobs"):
        _fio.parse_fio_json('{"jobs": []}', "read")


def test_fio_args_align_size_and_fsync_writes_only():
    w = _fio.fio_args("write", "/d/f.bin", 4097, "io_uring")
    assert "--size=8192" in w and "--direct=1" in w and "--end_fsync=1" in w and "--output-format=json" in w
    assert "--iodepth=8" in w and "--bs=16M" in w
    assert "--end_fsync=1" not in _fio.fio_args("read", "/d/f.bin", 4096, "libaio")
    assert "--iomem=malloc" in w and "--iomem=mmaphuge" in _fio.fio_args("read", "/d/f.bin", 4096, "libaio", iomem="mmaphuge")
    with pytest.raises(ValueError, match="'randwrite'"):
        _fio.fio_args("randwrite", "/d/f.bin", 4096, "libaio")
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        _fio.fio_args("read", "/d/f.bin", 0, "libaio")


def test_hugetlb_pages_are_reserved_for_the_block_and_given_back(tmp_path, monkeypatch):
    sysctl = tmp_path / "nr_hugepages"
    sysctl.write_text("3\n")
    monkeypatch.setattr(_fio, "HUGETLB_SYSCTL", str(sysctl))
    with _fio.hugetlb_pages(66) as reserved:
        assert reserved and sysctl.read_text() == "69"
    assert sysctl.read_text() == "3"
    with pytest.raises(RuntimeError, match="inside"), _fio.hugetlb_pages(2):
        raise RuntimeError("inside")
    assert sysctl.read_text() == "3"  # given back on an error too


def test_hugetlb_pages_without_the_sysctl_change_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_fio, "HUGETLB_SYSCTL", str(tmp_path / "missing" / "nr_hugepages"))
    with _fio.hugetlb_pages(66) as reserved:
        assert reserved is False
    assert not (tmp_path / "missing").exists()


def test_limit_is_the_fastest_method_and_says_which():
    inproc = {"seconds": 2.0, "state_bytes": 100, "peak_rss_bytes": 5, "method": "o_direct"}
    fio = {"seconds": 1.5, "method": "fio-libaio", "candidates": {"fio-io_uring": 1.6, "fio-libaio": 1.5}}
    recs = bench_run.limit_records("write", inproc, fio, run=0)
    assert [r["system"] for r in recs] == ["limit", "limit-inproc", "limit-fio"]
    assert recs[0]["seconds"] == 1.5 and recs[0]["method"] == "fio-libaio"
    assert bench_run.limit_records("read", {**inproc, "seconds": 1.0}, fio, 0)[0]["method"] == "o_direct"
    assert bench_run.limit_records("read", inproc, None, 0)[0]["method"] == "o_direct"
    several = {**inproc, "candidates": {"buffered": 2.5, "o_direct": 2.0, "o_direct_huge": 1.2}, "seconds": 1.2, "method": "o_direct_huge"}
    recs = bench_run.limit_records("write", several, fio, 0)
    assert recs[0]["method"] == "o_direct_huge" and set(recs[0]["candidates"]) == {"buffered", "o_direct", "o_direct_huge", "fio-io_uring", "fio-libaio"}
    assert recs[1]["candidates"] == several["candidates"]
    with pytest.raises(ValueError, match="no limit measurement"):
        _fio.best_of({})


def rec(system, op, seconds, run=0, storage="local", **extra):
    return {"system": system, "op": op, "storage": storage, "seconds": seconds, "run": run,
            "state_bytes": 1000, "peak_rss_bytes": extra.pop("peak", 0), **extra}


def synthetic(run: int, sk_load: float) -> list[dict]:
    return [
        rec("limit", "write", 1.0, run), rec("limit", "read", 1.0, run), rec("limit", "memcpy", 0.1, run),
        rec("statekit", "save", 1.2, run, peak=40), rec("statekit", "load", sk_load, run),
        rec("statekit", "async_block", 0.2, run), rec("statekit", "async_total", 1.1, run),
        rec("accelerate", "save", 3.0, run), rec("accelerate", "load", 1.3, run),
        rec("torch", "save", 2.0, run), rec("torch", "load", 1.4, run),
        rec("dcp", "save", 2.5, run), rec("dcp", "load", 1.5, run),
        rec("statekit", "save", 0.5, run, "small"), rec("torch", "save", 0.4, run, "small"),
        rec("statekit", "load", 0.1, run, "small"), rec("torch", "load", 0.3, run, "small"),
        rec("statekit", "train_async_overlap", 9.0, run, "training", overlap_ratio=1.05),
        rec("dcp_thread", "train_async_overlap", 9.0, run, "training", overlap_ratio=1.8),
        rec("limit", "memcpy", 5.0, run, "training"),  # the training run's own memcpy: not the local limit
    ]


def test_targets_met_missed_reported_and_min_median_max():
    records = synthetic(0, 1.2) + synthetic(1, 2.0) + synthetic(2, 1.1)
    t = {x["name"]: x for x in _targets.compute_targets(records)}
    assert t["load_vs_read_limit"]["met"] is True  # runs 1.2, 2.0, 1.1: median 1.2 <= 1.25 is met
    assert (t["load_vs_read_limit"]["min"], t["load_vs_read_limit"]["median"], t["load_vs_read_limit"]["max"]) == (1.1, 1.2, 2.0)
    assert t["save_vs_write_limit"]["met"] is True and t["save_vs_write_limit"]["median"] == pytest.approx(1.2)
    assert t["save_vs_fastest"]["median"] == pytest.approx(0.6) and t["save_vs_fastest"]["met"] is True
    assert t["load_vs_fastest"]["median"] == pytest.approx(1.2 / 1.3) and t["load_vs_fastest"]["met"] is True
    assert t["accelerate_over_statekit"]["met"] is None
    assert t["accelerate_over_statekit"]["median"] == pytest.approx(4.3 / 2.4)
    assert t["sync_save_peak_rss"]["median"] == pytest.approx(0.04) and t["sync_save_peak_rss"]["met"] is True
    assert t["async_block_vs_memcpy"]["median"] == pytest.approx(2.0) and t["async_block_vs_memcpy"]["met"] is False
    assert t["train_during_save"]["median"] == pytest.approx(1.05) and t["train_during_save"]["met"] is True
    assert t["train_during_dcp_thread_save"]["met"] is None and t["train_during_dcp_thread_save"]["median"] == 1.8
    assert t["train_during_dcp_process_save"]["runs"] == 0 and t["train_during_dcp_process_save"]["met"] is None
    assert t["small_save_vs_torch"]["met"] is False and t["small_load_vs_torch"]["met"] is True
    assert t["limit_sanity"]["met"] is True and t["limit_sanity"]["rows"] == []
    text = _targets.format_targets(list(t.values()))
    assert "MET    load_vs_read_limit" in text and "MISSED async_block_vs_memcpy" in text and "1.100-1.200-2.000" in text and "not measured" in text


def test_a_row_faster_than_its_limit_is_flagged():
    records = synthetic(0, 0.8)
    t = {x["name"]: x for x in _targets.compute_targets(records)}
    assert t["limit_sanity"]["met"] is False
    assert t["limit_sanity"]["rows"] == [{"system": "statekit", "op": "load", "run": 0, "ratio": pytest.approx(0.8)}]
    assert "statekit load run 0 0.80x" in _targets.format_targets([t["limit_sanity"]])
    assert "!0.80" in bench_run.table(records)


def test_training_ratio_from_undisturbed_and_during_records():
    records = [rec("statekit", "train_undisturbed", 10.0, 0, "training"), rec("statekit", "train_during_save", 12.0, 0, "training")]
    assert _targets.target_ratios(records)["train_during_save"] == [pytest.approx(1.2)]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (bash bench/setup.sh)")
def test_measure_limits_runs_fio_and_cleans_up(tmp_path):
    res = _fio.measure_limits(shutil.which("fio"), str(tmp_path), 1 << 20)
    for side in ("write", "read"):
        if res[side] is None:  # a file system without O_DIRECT: every engine failed, and says why
            assert res["notes"]
            continue
        assert res[side]["method"] in res[side]["candidates"] and res[side]["seconds"] > 0
    assert os.listdir(tmp_path) == []


def test_table_shows_rows_without_peak_memory():
    """The training rows (bench/async_training.py) carry no peak RSS: the table leaves
    that cell empty instead of failing at the end of a whole benchmark run."""
    records = synthetic(0, 1.2) + [
        {"storage": "training", "system": "statekit", "op": "train_async_total", "seconds": 2.5, "state_bytes": 1 << 30, "run": 0}
    ]
    line = next(x for x in bench_run.table(records).splitlines() if "train_async_total" in x)
    assert line.startswith("training") and "2.500" in line
