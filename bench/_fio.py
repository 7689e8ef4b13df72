"""Disk limits measured with fio, for ``bench/run.py``.

fio (https://fio.readthedocs.io/, the Debian package ``fio``) writes and reads one file of
the state's size sequentially with ``direct=1`` (no page cache), 16 MiB blocks and 8
requests in flight, once per I/O engine (``io_uring`` and ``libaio``) and per kind of
buffer memory (``malloc``, and hugetlb pages where they can be reserved: an ``O_DIRECT``
request moves 2-3x more per second from huge pages on a virtio disk); the write ends
with an fsync (``end_fsync=1``). Its ``--output-format=json`` report is parsed here
(the report's layout: https://fio.readthedocs.io/en/latest/fio_doc.html#json-output).

``bench/run.py`` takes the best of these and of its in-process methods as the limit. fio
is installed by ``bench/setup.sh`` (``make bench-setup``); :func:`ensure_fio` runs that
script when fio is not on ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = os.path.join(HERE, "setup.sh")
ENGINES = ("io_uring", "libaio")
BLOCK = "16M"
BLOCK_BYTES = 16 * 1024 * 1024
IODEPTH = 8
ALIGN = 4096
HUGETLB_SYSCTL = "/proc/sys/vm/nr_hugepages"
HUGE_PAGE = 2 * 1024 * 1024


def ensure_fio(setup: str = SETUP) -> str:
    """Path of the ``fio`` executable; runs ``setup`` (``bench/setup.sh``) first if missing.

    Args:
        setup: path of the setup script (bash) that installs fio.

    Returns:
        str: the absolute path of ``fio``.

    Raises:
        RuntimeError: fio is still not on ``PATH`` after the setup script (its exit status
            and the tail of its output are in the message).
    """
    found = shutil.which("fio")
    if found:
        return found
    proc = subprocess.run(["bash", setup], capture_output=True, text=True)
    found = shutil.which("fio")
    if not found:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"fio is not installed and {setup} could not install it (rc {proc.returncode}):\n{tail}")
    return found


def fio_args(
    rw: str, path: str, size_bytes: int, engine: str, iodepth: int = IODEPTH, block: str = BLOCK, iomem: str = "malloc"
) -> list[str]:
    """fio's command-line arguments (without the executable) for one sequential job.

    Args:
        rw: ``"write"`` or ``"read"``.
        path: the file fio writes or reads.
        size_bytes: bytes to move; rounded up to 4 KiB (``direct=1`` needs aligned sizes).
        engine: fio ``ioengine`` (``"io_uring"``, ``"libaio"``, ...).
        iodepth: requests in flight.
        block: block size, fio syntax (``"16M"``).
        iomem: where fio's I/O buffers live: ``"malloc"`` (4 KiB pages) or ``"mmaphuge"``
            (hugetlb pages: :func:`hugetlb_pages` must have reserved them).

    Raises:
        ValueError: ``rw`` is neither ``"write"`` nor ``"read"``, or ``size_bytes`` < 1.
    """
    if rw not in ("write", "read"):
        raise ValueError(f"fio job kind must be 'write' or 'read', got {rw!r}")
    if size_bytes < 1:
        raise ValueError(f"fio job size must be at least 1 byte, got {size_bytes}")
    size = (size_bytes + ALIGN - 1) // ALIGN * ALIGN
    args = [
        f"--name=statekit-limit-{rw}", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
        f"--size={size}", "--direct=1", f"--ioengine={engine}", f"--iodepth={iodepth}",
        f"--iomem={iomem}", "--output-format=json",
    ]
    if rw == "write":
        args.append("--end_fsync=1")
    return args


def parse_fio_json(text: str, rw: str) -> dict:
    """Throughput of the first job of one fio ``--output-format=json`` report.

    fio may print warning lines before the JSON document; they are skipped.

    Args:
        text: fio's standard output.
        rw: ``"write"`` or ``"read"``: which side of the job to read.

    Returns:
        dict: ``{"bw_bytes": bytes/s, "io_bytes": bytes moved, "runtime_s": seconds,
        "engine": the job's ioengine or None, "fio_version": str or None}``.

    Raises:
        ValueError: no JSON document in ``text``, no job, a job with a non-zero
            ``error``, or no bytes moved on the ``rw`` side (the message says which).
    """
    start = text.find("{")
    if start < 0:
        raise ValueError(f"fio output holds no JSON report: {text[:200]!r}")
    try:
        report, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as exc:
        raise ValueError(f"fio output is not valid JSON: {exc}") from exc
    jobs = report.get("jobs") or []
    if not jobs:
        raise ValueError("fio JSON report has no jobs")
    job = jobs[0]
    if job.get("error"):
        raise ValueError(f"fio job {job.get('jobname')!r} failed with error {job['error']}")
    side = job.get(rw) or {}
    io_bytes, bw_bytes = int(side.get("io_bytes", 0)), float(side.get("bw_bytes", 0))
    if io_bytes <= 0 or bw_bytes <= 0:
        raise ValueError(f"fio job {job.get('jobname')!r} moved no {rw} bytes")
    return {
        "bw_bytes": bw_bytes,
        "io_bytes": io_bytes,
        "runtime_s": float(side.get("runtime", 0)) / 1000.0,
        "engine": (job.get("job options") or {}).get("ioengine"),
        "fio_version": report.get("fio version"),
    }


def run_fio(fio: str, rw: str, path: str, size_bytes: int, engine: str, iomem: str = "malloc") -> dict:
    """Run one fio job and parse it (:func:`fio_args`, :func:`parse_fio_json`).

    Raises:
        RuntimeError: fio exited non-zero (its stderr tail and the file are in the message).
        ValueError: as :func:`parse_fio_json`.
    """
    proc = subprocess.run([fio, *fio_args(rw, path, size_bytes, engine, iomem=iomem)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio {rw} of {path} with {engine} failed (rc {proc.returncode}): {proc.stderr[-1000:]}")
    return parse_fio_json(proc.stdout, rw)


@contextlib.contextmanager
def hugetlb_pages(count: int) -> Iterator[bool]:
    """Reserve ``count`` more hugetlb pages (``/proc/sys/vm/nr_hugepages``, root only) for
    the block, for fio's ``iomem=mmaphuge`` buffers, and give them back after it.

    Why: on a virtio disk an ``O_DIRECT`` request moves 2-3x more per second to or from
    huge pages than 4 KiB pages (statekit's own buffers use transparent huge pages), so
    fio with ``malloc`` buffers alone understates the disk.
    (https://docs.kernel.org/admin-guide/mm/hugetlbpage.html)

    Yields:
        bool: whether all ``count`` pages are reserved (False: not root, no hugetlb
        support, or not enough contiguous memory; nothing is left changed).
    """
    try:
        with open(HUGETLB_SYSCTL) as f:
            before = int(f.read())
    except (OSError, ValueError):
        yield False
        return
    try:
        with open(HUGETLB_SYSCTL, "w") as f:
            f.write(str(before + count))
        with open(HUGETLB_SYSCTL) as f:
            reserved = int(f.read()) >= before + count
    except (OSError, ValueError):
        reserved = False
    try:
        yield reserved
    finally:
        with contextlib.suppress(OSError), open(HUGETLB_SYSCTL, "w") as f:
            f.write(str(before))


def best_of(candidates: dict[str, float]) -> tuple[str, float]:
    """The fastest ``(method, seconds)`` of ``{method: seconds}`` (ties: first listed).

    Raises:
        ValueError: ``candidates`` is empty.
    """
    if not candidates:
        raise ValueError("no limit measurement to choose from")
    method = min(candidates, key=lambda m: candidates[m])
    return method, candidates[method]


def measure_limits(fio: str, directory: str, size_bytes: int, engines: tuple[str, ...] = ENGINES) -> dict:
    """Sequential write then read limits of ``directory``'s disk for ``size_bytes``.

    One file ``fio-limit.bin`` in ``directory`` is written once per engine and buffer kind
    (``malloc``; ``mmaphuge`` where :func:`hugetlb_pages` can reserve huge pages), each
    time as a new file (a save never overwrites a file: on the benchmark VM overwriting
    the file of the job before ran 2x faster, 0.14 s against 0.25-0.31 s per GiB, which
    would make the limit one no save can reach), then read the same way, then removed.
    Seconds are ``size_bytes / bw_bytes`` (fio's own
    throughput, so fio's start-up and file layout are not charged).

    Args:
        fio: path of the fio executable (:func:`ensure_fio`).
        directory: where the benchmark writes its checkpoints.
        size_bytes: the state's bytes.
        engines: fio I/O engines to try; one that fails is skipped and noted.

    Returns:
        dict: ``{"write": {...}, "read": {...}, "notes": [str]}``; each side is
        ``{"seconds", "method" ("fio-<engine>"), "candidates": {method: seconds}}`` or
        ``None`` when every engine failed.
    """
    path = os.path.join(directory, "fio-limit.bin")
    out: dict = {"notes": []}
    pages = IODEPTH * BLOCK_BYTES // HUGE_PAGE + 2  # fio's buffers: iodepth x block, plus alignment
    try:
        with hugetlb_pages(pages) as huge:
            if not huge:
                out["notes"].append("no hugetlb pages (not root?): fio ran with malloc buffers only")
            for rw in ("write", "read"):
                cands = {}
                for engine in engines:
                    for iomem in ("malloc", "mmaphuge") if huge else ("malloc",):
                        if rw == "write" and os.path.exists(path):
                            os.unlink(path)  # a save writes new files: overwriting this one ran 2x faster
                        try:
                            res = run_fio(fio, rw, path, size_bytes, engine, iomem)
                        except (RuntimeError, ValueError) as exc:
                            out["notes"].append(str(exc))
                            continue
                        cands[f"fio-{engine}" + ("-huge" if iomem == "mmaphuge" else "")] = size_bytes / res["bw_bytes"]
                if cands:
                    method, seconds = best_of(cands)
                    out[rw] = {"seconds": seconds, "method": method, "candidates": cands}
                else:
                    out[rw] = None
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out
