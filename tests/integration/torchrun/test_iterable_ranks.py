"""Exact mid-epoch resume of an IterableDataset loader on two real torchrun ranks (the
in-process cases are in ``unit/loaders/test_iterable_resume.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")


# Two real torchrun ranks (``tests/scripts/iterable_ranks.py``): Accelerate's IterableDatasetShard
# makes every rank read the whole stream and keep its slice; DataLoaderDispatcher reads on
# rank 0 and sends each rank its part. A Stateful dataset inside the shard must restart its
# epoch from the saved epoch-start state (it once started over at epoch 0: a silent wrong
# resume from step 12 on).
RANK_SETUPS = [("shard", "stateful", "0"), ("shard", "stateful", "1"), ("shard", "stream", "0"), ("dispatch", "stateful", "0")]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "dataset", "stateful"), RANK_SETUPS, ids=["-".join(s) for s in RANK_SETUPS])
def test_two_ranks_resume_an_iterable_loader_exactly(tmp_path, mode, dataset, stateful):
    import json

    from accelerate_helpers import torchrun

    torchrun("iterable_ranks.py", mode, stateful, dataset, str(tmp_path / "root"), str(tmp_path / "out"))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert result["got"] == result["expected"], f"rank {rank}"
        assert result["same_state"], f"rank {rank}"
