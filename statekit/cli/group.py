"""The ``statekit`` click group (:func:`main`), with one command per module of :mod:`statekit.cli`."""

from __future__ import annotations

import click

from statekit.cli.converting import convert
from statekit.cli.diffing import diff
from statekit.cli.inspecting import inspect
from statekit.cli.plugins import plugins
from statekit.cli.root import gc, ls
from statekit.cli.verifying import verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="statekit")
def main() -> None:
    """statekit: inspect, compare, verify and convert PyTorch training checkpoints."""


for _command in (plugins, ls, inspect, diff, verify, convert, gc):
    main.add_command(_command)
