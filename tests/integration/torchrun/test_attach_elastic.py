"""An attach-mode checkpoint saved mid-epoch by two ranks and loaded by one: the loader's
position is planned from every saved rank (as for a native checkpoint), not taken as rank
0's batch count (which re-yielded samples rank 1 had consumed)."""

import json

import pytest
from accelerate_helpers import torchrun


@pytest.mark.parametrize("mode", ["attach", "attachacc", "native"])
def test_attach_mode_world_size_change_does_not_replay_consumed_samples(tmp_path, mode):
    out = str(tmp_path / "out")
    torchrun("attach_elastic.py", "save", str(tmp_path), out, mode, nproc=2)
    torchrun("attach_elastic.py", "load", str(tmp_path), out, mode, nproc=1)
    saved = [json.loads((tmp_path / f"out.save.rank{r}.json").read_text()) for r in (0, 1)]
    consumed = sorted(i for s in saved for b in s["before"] for i in b)
    remaining = sorted(i for s in saved for b in s["after"] for i in b)
    rest = sorted(i for b in json.loads((tmp_path / "out.load.rank0.json").read_text())["rest"] for i in b)
    assert rest == remaining and not set(rest) & set(consumed)
