"""statekit's collectives time out well under the NCCL watchdog and fail by name (issue 30
item 3): two real torchrun ranks, one of which never reaches the save."""

from __future__ import annotations

import json

import pytest

from accelerate_helpers import torchrun


@pytest.mark.parametrize("mode", ["first", "later"])
def test_a_rank_that_never_reaches_the_save_fails_the_others_by_name(tmp_path, mode):
    torchrun("collective_timeout.py", str(tmp_path / "root"), str(tmp_path), mode,
             env={"STATEKIT_COLLECTIVE_TIMEOUT": "3"}, timeout=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] == "CollectiveTimeoutError"
    # the save's first collective: the ranks' agreement that the previous save finished (back-pressure)
    assert result["collective"] == "max_over_ranks" and result["timeout_s"] == 3.0 and result["ranks"] == [1]
    assert result["message"].startswith(
        "statekit collective max_over_ranks on rank 0 of 2 failed or did not complete within 3 s "
        "(STATEKIT_COLLECTIVE_TIMEOUT) (gloo: "
    )
    assert "rank(s) [1] did not answer; a rank never reached this save or load" in result["message"]
    assert 3.0 <= result["seconds"] < 60
    # the stuck save committed nothing; the one both ranks made stays
    assert result["committed"] == ([] if mode == "first" else [[1, True]])


def test_a_bad_collective_timeout_is_refused_by_name(monkeypatch):
    import statekit
    from statekit.distributed import collective_timeout_seconds

    monkeypatch.setenv("STATEKIT_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(statekit.InvalidOptionError) as info:
        collective_timeout_seconds()
    assert str(info.value) == (
        "STATEKIT_COLLECTIVE_TIMEOUT='soon' is not a number of seconds > 0 (the timeout of statekit's collectives; "
        "unset it for the default 300 s)"
    )


def test_training_thread_agreements_do_not_cross_an_async_saves_collectives(tmp_path):
    """save_on_signal's flag and back-pressure agree on statekit's control group while the
    async saves' writer threads run the saves' collectives on its main group: with one
    group the two threads interleave differently on each rank (a hang, or a gather's bytes
    read as the flag)."""
    torchrun("async_control.py", str(tmp_path / "root"), str(tmp_path), env={"STATEKIT_COLLECTIVE_TIMEOUT": "60"},
             timeout=240)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["outcomes"] == results[1]["outcomes"]  # the ranks agreed on every skip
    assert results[0]["committed"] == results[1]["committed"] and results[0]["committed"][-1] >= 2
    saved = [s for s, ok in enumerate(results[0]["outcomes"], 1) if ok]
    assert set(results[0]["committed"]) <= set(saved)
