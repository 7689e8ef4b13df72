"""``python -m statekit.cli``: runs the ``statekit`` command."""

from statekit.cli.group import main

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="statekit")
