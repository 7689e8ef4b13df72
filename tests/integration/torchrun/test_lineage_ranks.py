"""Lineage with two real torchrun ranks (gloo): a rollback's branch, its checkpoint names
and the resume after it agree on every rank, with one shared root and with a root per rank
(node-local disks) replicated to one remote tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelerate_helpers import torchrun


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared", "local"])
def test_every_rank_saves_the_new_branch_under_one_name_and_resumes_it(tmp_path, layout):
    torchrun("lineage_ranks.py", str(tmp_path / "root"), str(tmp_path / "out"), layout)
    ranks = [json.loads(Path(f"{tmp_path / 'out'}.rank{r}.json").read_text()) for r in range(2)]
    names = [r["saved"] for r in ranks]
    assert names[0] == names[1], names  # one folder per save, whatever root each rank has
    branch = names[0][2].split(".", 1)[1]
    assert names[0] == ["checkpoint-00000001", "checkpoint-00000002", f"checkpoint-00000002.{branch}",
                        "checkpoint-00000003", f"checkpoint-00000003.{branch}"]
    for r in ranks:
        assert r["resumed"] == 3
        assert r["resumed_from"].endswith(f"checkpoint-00000003.{branch}")
        assert r["weight"] == 13.0  # the new branch's step 3, not the abandoned one's
    assert ranks[0]["run"] == ranks[1]["run"]
    committed = tmp_path / "root" / ("" if layout == "shared" else "remote") / f"checkpoint-00000003.{branch}"
    assert (committed / "statekit.json").exists()
