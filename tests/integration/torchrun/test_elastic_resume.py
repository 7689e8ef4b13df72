"""Elastic data position with real gloo processes: an epoch saved mid-way by torchrun ranks
continues on another number of ranks through ``CheckpointManager.resume()`` with no sample
skipped or seen twice (``scripts/elastic_resume.py``; the layout model and the in-process
ranks are in ``unit/loaders/test_elastic.py``)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from accelerate_helpers import torchrun

pytest.importorskip("accelerate.data_loader")
from repo_paths import SCRIPTS  # noqa: E402

SCRIPT = SCRIPTS / "elastic_resume.py"


def _torchrun(nproc: int, *args: str) -> None:
    torchrun(SCRIPT.name, *args, nproc=nproc)


def _runs(prefix: Path, nproc: int) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(nproc)]


def _orders(start_state: list[int]) -> list[list[int]]:
    """Epochs 1 and 2 of a RandomSampler whose generator starts epoch 1 at ``start_state``."""
    g = torch.Generator()
    g.set_state(torch.tensor(start_state, dtype=torch.uint8))
    return [list(torch.utils.data.RandomSampler(range(SCRIPT_L), generator=g)) for _ in range(2)]


SCRIPT_L, SCRIPT_B = 48, 4  # as in tests/scripts/elastic_resume.py


def _check_elastic_run(saved: list[dict], resumed: list[dict]) -> None:
    """The invariant of issue 13 item 4 for the three loaders of one N -> M resume."""
    m = len(resumed)
    for kind in ("shard", "dispatch", "torch"):
        before = [b for run in saved for b in run["before"][kind]]
        rest = [rank["rest"][kind] for rank in resumed]
        if kind == "torch":
            g = torch.Generator().manual_seed(7 + 1)
            order = torch.randperm(SCRIPT_L, generator=g).tolist()
        else:
            order, following = _orders(saved[0]["start"][kind])
        consumed = {i for b in before for i in b}
        remaining = [i for i in order if i not in consumed]
        if kind == "shard":  # BatchSamplerShard (even_batches): whole steps of M batches, from the epoch's start
            pad = order[: math.ceil(math.ceil(len(remaining) / SCRIPT_B) / m) * m * SCRIPT_B - len(remaining)] if m > 1 else []
        elif kind == "dispatch":  # the dispatcher pads its last step with the first samples it yielded after the resume
            last = len(remaining) % (m * SCRIPT_B) or m * SCRIPT_B
            pad = remaining[: (-last) % m]
        else:  # DistributedSampler pads the remainder to a multiple of M from the epoch's start
            pad = order[: math.ceil(len(remaining) / m) * m - len(remaining)]
        seen = Counter(i for b in before for i in b) + Counter(i for r in rest for b in r for i in b)
        assert seen == Counter(order) + Counter(pad), (kind, len(saved), m)
        assert len({len(r) for r in rest}) == 1, kind  # every rank the same number of steps
        for r in range(m):  # the next epoch: what an uninterrupted M-rank run yields
            following_r = resumed[r]["next"][kind]
            if kind == "torch":
                sampler = DistributedSampler(range(SCRIPT_L), m, r, shuffle=True, seed=7)
                sampler.set_epoch(2)
                assert following_r == list(BatchSampler(sampler, SCRIPT_B, False)), (kind, r)
            elif kind == "dispatch":
                # the dispatcher's RandomSampler has no generator (Accelerate gives none, and
                # attaching statekit must not change the run): each epoch's order is drawn from
                # the global generator, whose stream another world size does not continue
                continue
            else:  # 12 batches divide by 1, 2 and 3: no padding; rank r gets batches r, r + M, ...
                assert following_r == list(BatchSampler(following, SCRIPT_B, False))[r::m], (kind, r)
        if kind == "dispatch":  # the next epoch: every sample once over the M ranks
            assert Counter(i for rank in resumed for b in rank["next"][kind] for i in b) == Counter(range(SCRIPT_L))


@pytest.mark.slow
def test_torchrun_resume_with_another_world_size(tmp_path):
    """Real gloo processes: saved with 2 ranks, resumed 2 -> 1 (fewer), 2 -> 3 (more, uneven)
    and 2 -> 2 (the dispatcher skipped N times too few batches on a same-size resume before
    the layout was saved). Every other N -> M pair, 1 -> 2 included, runs its ranks in one
    process in ``unit/loaders/test_elastic.py``: the same loaders, samplers and plan."""
    n = 2
    _torchrun(n, "save", str(tmp_path / f"root{n}"), str(tmp_path / f"save{n}"))
    for m in (1, 3, 2):
        _torchrun(m, "resume", str(tmp_path / f"root{n}"), str(tmp_path / f"resume{n}{m}"))
        _check_elastic_run(_runs(tmp_path / f"save{n}", n), _runs(tmp_path / f"resume{n}{m}", m))
