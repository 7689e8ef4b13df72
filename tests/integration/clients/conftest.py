"""The client scripts' fixtures: one zygote and one asset folder per test class (a family's
scripts), and the ``case`` / ``placement`` parameters from the class's ``CASES``
(``client_helpers.ScriptChecks``)."""

from __future__ import annotations

import json

import pytest

pytest.register_assert_rewrite("client_helpers")  # the checks live there: show their values on failure

from client_helpers import ClientRuns, Zygote  # noqa: E402


def pytest_generate_tests(metafunc):
    cases = getattr(metafunc.cls, "CASES", None)
    if not cases or "case" not in metafunc.fixturenames:
        return
    if "placement" in metafunc.fixturenames:
        pairs = [(case, placement) for case in cases.values() for placement in case.placements]
        metafunc.parametrize(("case", "placement"), pairs, ids=[f"{c.name}-{p}" for c, p in pairs])
    else:
        metafunc.parametrize("case", list(cases.values()), ids=list(cases))


@pytest.fixture(scope="class")
def runs(request, tmp_path_factory):
    """A :class:`client_helpers.ClientRuns` with the class's assets built (through the zygote);
    the seconds of every run are written to ``seconds.json`` beside them."""
    root = tmp_path_factory.mktemp(request.cls.__name__)
    zygote = Zygote(root / "zygote")
    try:
        assets = root / "assets"
        result = zygote.run("make_assets.py", ["--out", str(assets), "--what", request.cls.ASSETS], root / "assets.log")
        assert result["returncode"] == 0, (root / "assets.log").read_text()[-4000:]
        client_runs = ClientRuns(root, zygote, assets)
        yield client_runs
        (root / "seconds.json").write_text(json.dumps(client_runs.seconds, indent=1))
    finally:
        zygote.close()
