"""A clean process that forks one child per fault-injection trial.

The test process cannot fork safely (its OpenMP pool and fsspec's I/O thread hold locks a
forked child may need), so this zygote imports torch and statekit, never runs a parallel
op itself, and forks children that do. Protocol on stdin/stdout, one line each:
``ROOT KILL_ON`` -> ``STATUS EVENTS`` (KILL_ON 0: never kill, just count events).
In each child: step 1 is committed under ROOT already; the child saves step 2 and
SIGKILLs itself at the KILL_ON-th write-open, fsync, rename, link or remove.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["STATEKIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # a fixed write sequence

import statekit  # noqa: E402
from fault_helpers import make_state  # noqa: E402


def child(root: str, kill_on: int, report_fd: int) -> None:
    events = 0

    def event() -> None:
        nonlocal events
        events += 1
        if events == kill_on:
            os.kill(os.getpid(), signal.SIGKILL)

    def audit(name, args):
        if name == "open" and isinstance(args[0], str) and args[0].startswith(root):
            mode, flags = args[1], args[2]
            if (mode and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            ):
                event()
        elif name in ("os.rename", "os.link", "os.remove", "shutil.rmtree"):
            event()

    real_fsync = os.fsync

    def fsync(fd):
        event()
        return real_fsync(fd)

    os.fsync = fsync
    sys.addaudithook(audit)
    statekit.CheckpointManager(make_state(2), root).save(2)
    os.write(report_fd, str(events).encode())


for line in sys.stdin:
    root, kill_on = line.split()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            child(root, int(kill_on), write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        seen = f.read()
    _, status = os.waitpid(pid, 0)
    print(status, seen or 0, flush=True)
