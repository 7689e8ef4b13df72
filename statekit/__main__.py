"""``python -m statekit``: runs the ``statekit`` command (as ``python -m statekit.cli``)."""

from statekit.cli.group import main

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="statekit")
