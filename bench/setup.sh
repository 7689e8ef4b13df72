#!/usr/bin/env bash
# Benchmark setup: installs fio (the Debian package), which bench/run.py uses to measure
# the disk's write and read limits. Idempotent: does nothing when fio is already on PATH.
# Run as root (or with sudo available); bench/run.py calls this script when fio is missing.
set -euo pipefail
if command -v fio >/dev/null 2>&1; then
    echo "fio already installed: $(fio --version)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
        echo "bench/setup.sh: fio is missing and this user cannot install Debian packages (not root, no sudo)" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "bench/setup.sh: fio is missing and apt-get is not available; install fio with this system's package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends fio
echo "installed $(fio --version)"
