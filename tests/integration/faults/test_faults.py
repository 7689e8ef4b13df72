"""Fault injection: SIGKILL at every write, rename and fsync; a frozen S3 server; a full
disk; corrupted files; two savers racing for one step."""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import statekit
from statekit.manager.manager import checkpoint_name
from statekit.testing import assert_state_equal

from fault_helpers import make_state

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


# --------------------------------------------------------------------------- SIGKILL trials


from repo_paths import SCRIPTS  # noqa: E402

ZYGOTE = SCRIPTS / "kill_zygote.py"


class Zygote:
    """Runs trials in children forked from a clean process (see scripts/kill_zygote.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def trial(self, root: str, kill_on: int) -> tuple[int, int]:
        self.proc.stdin.write(f"{root} {kill_on}\n")
        self.proc.stdin.flush()
        status, events = self.proc.stdout.readline().split()
        return int(status), int(events)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _check_resume(root: str) -> int:
    state = make_state(99)
    manager = statekit.CheckpointManager(state, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", statekit.StatekitWarning)
        step = manager.resume()
    expected = make_state(step)
    assert_state_equal(state["model"].state_dict(), expected["model"].state_dict())
    assert_state_equal(state["optim"].state_dict(), expected["optim"].state_dict())
    assert state["extra"] == expected["extra"]
    assert torch.equal(state["t"], expected["t"])
    statekit.verify(manager.latest())
    return step


def test_sigkill_at_every_point_of_the_write_sequence(tmp_path, plugin_manager):
    zygote = Zygote()
    try:
        probe = str(tmp_path / "probe")
        statekit.CheckpointManager(make_state(1), probe).save(1)
        status, total = zygote.trial(probe, 0)
        assert status == 0 and total >= 15, (status, total)
        outcomes: dict[int, set[int]] = {}
        trials = 0
        for repeat in range(3):  # every point three times: at least 50 trials in all
            for kill_on in range(1, total + 1):
                root = str(tmp_path / f"r{repeat}-{kill_on}")
                statekit.CheckpointManager(make_state(1), root).save(1)
                status, _ = zygote.trial(root, kill_on)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (kill_on, status)
                outcomes.setdefault(kill_on, set()).add(_check_resume(root))
                trials += 1
    finally:
        zygote.close()
    assert trials >= 50
    # each point always gives the same outcome: before the manifest commit step 1, after it step 2
    steps = [outcomes[k] for k in sorted(outcomes)]
    assert all(len(s) == 1 for s in steps), steps
    flat = [next(iter(s)) for s in steps]
    assert flat == sorted(flat) and set(flat) == {1, 2}, flat
    print(f"{trials} SIGKILL trials over {total} write/fsync/rename points; commit at point {flat.index(2) + 1}")


# --------------------------------------------------------------------------- S3 outages


def test_s3_outage_during_save_is_a_storage_error(frozen_s3, plugin_manager):
    server, options = frozen_s3
    root = f"s3://frozen/run-{uuid.uuid4().hex[:6]}"
    state = {"model": torch.nn.Linear(256, 256)}
    manager = statekit.CheckpointManager(state, root, storage_options=options)
    manager.save(1)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with torch.no_grad():
        state["model"].weight.add_(1)
    timer = threading.Timer(0.05, server.send_signal, (signal.SIGSTOP,))
    timer.start()
    started = time.monotonic()
    with pytest.raises(statekit.StorageError, match=root) as info:
        for step in range(2, 200):  # keep saving until the freeze lands mid-save
            manager.save(step)
    elapsed = time.monotonic() - started
    server.send_signal(signal.SIGCONT)
    assert info.value.url and info.value.url.startswith(root)
    assert elapsed < 60, f"bounded timeouts: took {elapsed:.1f} s"
    # the previous checkpoints are intact, and the next save succeeds
    for info_ in manager.list():
        if info_.committed:
            statekit.verify(info_.url, storage_options=options)
    first = statekit.CheckpointManager({"model": torch.nn.Linear(256, 256)}, root, storage_options=options)
    assert first.resume() >= 1
    manager.save(500)
    assert manager.latest().endswith(checkpoint_name(500))
    del expected


# --------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def _small_disk(path, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted at ``path`` if this machine lets us mount;
    otherwise None (the caller then uses the ENOSPC-injecting wrapper)."""
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                            capture_output=True)
    if result.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_disk_full_during_save(tmp_path, plugin_manager, monkeypatch):
    with _small_disk(tmp_path / "small", 3 * 1024 * 1024) as mounted:
        root = tmp_path / "small" / "run"
        model = torch.nn.Linear(256, 256)  # ~257 KiB of weights per checkpoint
        manager = statekit.CheckpointManager({"model": model}, str(root))
        how = "tmpfs"
        if mounted is None:  # no mount permission: inject ENOSPC after 3 MiB of writes
            how = "ENOSPC injection"
            real_open = builtins.open
            written = {"bytes": 0}

            class Full:
                def __init__(self, f):
                    self._f = f

                def write(self, data):
                    written["bytes"] += len(memoryview(data).cast("B"))
                    if written["bytes"] > 3 * 1024 * 1024:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return self._f.write(data)

                def __getattr__(self, name):
                    return getattr(self._f, name)

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    return self._f.__exit__(*exc)

            def fake_open(file, mode="r", *args, **kwargs):
                f = real_open(file, mode, *args, **kwargs)
                return Full(f) if "w" in mode and str(file).startswith(str(root)) else f

            monkeypatch.setattr(builtins, "open", fake_open)
        committed = []
        with pytest.raises(statekit.StorageError, match=r"No space left|ENOSPC|Errno 28") as info:
            for step in range(1, 100):
                with torch.no_grad():
                    model.weight.add_(1.0)  # a training step: every save writes the model again (no unchanged file to link)
                manager.save(step)
                committed.append(step)
        print(f"disk full via {how} after {len(committed)} checkpoints")
        assert committed, "at least one checkpoint fits"
        assert str(root) in str(info.value)
        failed = root / checkpoint_name(len(committed) + 1)
        assert not (failed / "statekit.json").exists()  # no committed-looking partial checkpoint
        monkeypatch.undo()
        for step in committed:
            statekit.verify(str(root / checkpoint_name(step)))


# --------------------------------------------------------------------------- corruption


def _committed(tmp_path):
    url = str(tmp_path / "c")
    statekit.save(url, make_state(3))
    return url


CORRUPTIONS = {
    "truncated": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-7]),
    "flipped": lambda d: (d / "optim.safetensors").write_bytes(_flip((d / "optim.safetensors").read_bytes())),
    "deleted": lambda d: (d / "t.safetensors").unlink(),
    "edited manifest": lambda d: (d / "statekit.json").write_text(
        (d / "statekit.json").read_text().replace('"size_bytes": ', '"size_bytes": 1', 1)),
}


def _flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_named(tmp_path, plugin_manager, kind):
    url = _committed(tmp_path)
    CORRUPTIONS[kind](tmp_path / "c")
    with pytest.raises(statekit.CorruptCheckpointError) as verified:
        statekit.verify(url)
    assert verified.value.path and verified.value.path.startswith(url)
    assert os.path.basename(verified.value.path) in str(verified.value)
    with pytest.raises(statekit.CorruptCheckpointError) as loaded:
        statekit.load(url, make_state(4), verify=True)
    assert loaded.value.path


# --------------------------------------------------------------------------- racing savers


RACE = """
import sys, time, torch, statekit
root, step, tag, start = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
model = torch.nn.Linear(512, 512)
manager = statekit.CheckpointManager({"model": model, "tag": {"who": tag}}, root)
while time.time() < start:
    time.sleep(0.001)
try:
    manager.save(step)
    print("committed")
except statekit.CheckpointExistsError as exc:
    print("exists:", exc)
"""


@pytest.mark.parametrize("same_step", [True, False], ids=["same-step", "different-steps"])
def test_two_savers_racing(tmp_path, same_step):
    script = tmp_path / "race.py"
    script.write_text(RACE)
    root = str(tmp_path / "run")
    start = time.time() + 8  # both processes have imported torch by then
    env = {**os.environ, "STATEKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), root, "5" if same_step else str(5 + i), f"p{i}", str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    results = [out.strip().splitlines()[-1] for out, _ in outputs]
    infos = statekit.manager.manager.list_checkpoints(root)
    if same_step:
        assert sorted(r.split(":")[0] for r in results) == ["committed", "exists"], results
        assert [(i.step, i.committed) for i in infos] == [(5, True)]
        statekit.verify(infos[0].url)
    else:
        assert results == ["committed", "committed"]
        assert [(i.step, i.committed) for i in infos] == [(5, True), (6, True)]


def test_frozen_remote_tier_never_stops_training_and_replication_catches_up(frozen_s3, plugin_manager, tmp_path):
    """Replication to a frozen S3 endpoint (SIGSTOP): local saves commit, wait(timeout)
    names what is not replicated, no committed partial remote copy exists; once the
    server runs again the retries finish the copies."""
    server, options = frozen_s3
    remote = f"s3://frozen/replica-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(256, 256)
    manager = statekit.CheckpointManager({"model": model}, str(tmp_path / "local"), replicate_to=remote,
                                         replicate_options=options)
    manager.plugin_state["replicate"].backoff_seconds = 0.2
    server.send_signal(signal.SIGSTOP)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(1)
            manager.save(2)
            assert set(manager.plugin_state["replicate"].wait(timeout=2)) >= {checkpoint_name(2)}
        statekit.verify(str(tmp_path / "local" / checkpoint_name(2)))  # local saves went on
        assert any(f"{remote}/{checkpoint_name(2)}: not replicated yet" in str(w.message) for w in caught)
    finally:
        server.send_signal(signal.SIGCONT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the retry warnings of the frozen period
        missing = manager.plugin_state["replicate"].wait(timeout=120)
    assert missing == []
    for step in (1, 2):
        statekit.verify(f"{remote}/{checkpoint_name(step)}", storage_options=options)


@pytest.mark.parametrize("holder", ["this process", "another process"])
def test_a_live_save_lock_names_who_holds_it(tmp_path, plugin_manager, holder):
    """A second save of a directory another live save holds is refused, naming the holder:
    this very process (a second thread, an async save still writing) or another one."""
    import json
    import socket

    from statekit.engine.locking import LOCK_NAME

    target = tmp_path / "ckpt"
    target.mkdir()
    pid = os.getpid() if holder == "this process" else os.getppid()  # the parent: alive, same host
    (target / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "created": time.time()}))
    with pytest.raises(statekit.CheckpointExistsError) as info:
        statekit.save(str(target), {"w": torch.ones(2)})
    message = str(info.value)
    if holder == "this process":
        assert "another save of this process (a second thread, or an async save still writing)" in message
    else:
        assert f"another process ({socket.gethostname()} pid {pid}), started 0 s ago" in message
    assert (target / LOCK_NAME).exists() and not (target / "statekit.json").exists()


def test_a_lock_left_by_an_earlier_process_with_this_pid_is_stale(tmp_path, plugin_manager):
    """A restarted container (a new PID namespace) gives the resumed run the pid of the
    run that was killed mid-save on the same host: that lock names another process's
    token and is stale, not "another save of this process"."""
    import json
    import socket

    from statekit.engine.locking import LOCK_NAME

    target = tmp_path / "ckpt"
    target.mkdir()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": "a-process-that-is-gone", "created": time.time()}
    (target / LOCK_NAME).write_text(json.dumps(record))
    (target / "model.safetensors").write_bytes(b"half written")
    statekit.save(str(target), {"w": torch.ones(2)})
    assert (target / "statekit.json").exists() and not (target / "model.safetensors").exists()


def test_a_live_save_of_this_process_is_named_so(tmp_path, plugin_manager):
    """A save still holding the lock in this very process (its own token) is refused."""
    from statekit.engine.locking import LOCK_NAME, _lock_record

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / LOCK_NAME).write_bytes(_lock_record())
    with pytest.raises(statekit.CheckpointExistsError, match="another save of this process"):
        statekit.save(str(target), {"w": torch.ones(2)})
