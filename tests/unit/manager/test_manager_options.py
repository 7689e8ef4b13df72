"""Manager options that are wrong (docs/bad-input.md): a remote-tier option without
``replicate_to`` is refused, a misspelled option warns with the right name."""

from __future__ import annotations

import pytest
import torch

import statekit


@pytest.mark.parametrize("option", ["remote_keep_last", "replicate_options", "delete_unreplicated"])
def test_a_remote_tier_option_without_replicate_to(tmp_path, option):
    value = {"remote_keep_last": 3, "replicate_options": {"anon": True}, "delete_unreplicated": True}[option]
    with pytest.raises(statekit.InvalidOptionError, match=f"{option}=.*needs replicate_to="):
        statekit.CheckpointManager({"t": torch.zeros(1)}, str(tmp_path / "run"), **{option: value})


def test_a_misspelled_manager_option_warns_with_the_right_name(tmp_path, plugin_manager):
    with pytest.warns(statekit.StatekitWarning, match=r"option 'keep_lats' is read by no registered plugin.*did you mean 'keep_last'"):
        statekit.CheckpointManager({"t": torch.zeros(1)}, str(tmp_path / "run"), keep_lats=2)
