"""statekit-fsdp unit level: DCP metadata as JSON, the state split into skeleton and
tensors, and DCP failures turned into statekit errors naming the ranks. No processes, no
torchrun (the end-to-end cases are test_fsdp.py)."""

from __future__ import annotations

import json

import pytest
import torch

from statekit import CorruptCheckpointError, StatekitError, StateMismatchError


def test_metadata_json_round_trip() -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from statekit_fsdp.dcp_metadata import metadata_from_json, metadata_to_json

    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([5, 3]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 3])), ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 3]))],
            ),
            "b": BytesStorageMetadata(),
        },
        planner_data={"w": ("w",)},
        storage_data={
            MetadataIndex("w", [0, 0]): {"file": "rank-00000.safetensors", "name": "w", "size_bytes": 18},
            MetadataIndex("w", [3, 0]): {"file": "rank-00001.safetensors", "name": "w@3,0", "size_bytes": 12},
        },
    )
    doc = json.loads(json.dumps(metadata_to_json(md)))
    back = metadata_from_json(doc, "memory://x/metadata.json")
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_data == md.storage_data
    assert back.planner_data == md.planner_data
    doc["storage_data"].pop()
    with pytest.raises(CorruptCheckpointError, match="offsets \\[3, 0\\] has no storage entry"):
        metadata_from_json(doc, "memory://x/metadata.json")


def test_split_and_fill_state_round_trip() -> None:
    from statekit_fsdp.state import fill_state, refs_of, split_state

    a, b = torch.ones(2), torch.zeros(3)
    state = {"model": {"w": a}, "optim": {"state": {"w": {"step": b, "m": None}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}}
    skeleton, tensors = split_state(state)
    assert tensors == {"model.w": a, "optim.state.w.step": b}
    assert refs_of(skeleton) == ["model.w", "optim.state.w.step"]
    from statekit.format import codec

    codec.encode(skeleton)  # JSON-able through the codec, no tensors left
    assert fill_state(skeleton, tensors)["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    with pytest.raises(StatekitError, match="same key"):
        split_state({"a.b": a, "a": {"b": b}})


def test_dcp_failures_become_statekit_errors_naming_ranks() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from statekit_fsdp.plugin import _run_dcp

    def failing(*failures: tuple[int, BaseException]) -> object:
        def fn() -> None:
            raise CheckpointException("write", {rank: (exc, None) for rank, exc in failures})

        return fn

    with pytest.raises(StatekitError, match=r"rank\(s\) \[1\].*rank 1: ValueError: disk full") as info:
        _run_dcp(failing((1, ValueError("disk full"))), "sharded save of 'model'")
    assert type(info.value) is StatekitError
    with pytest.raises(CorruptCheckpointError, match="rank 1: CorruptCheckpointError: x/rank-00001.safetensors"):
        _run_dcp(failing((1, CorruptCheckpointError("x/rank-00001.safetensors: checksum"))), "sharded load")
    own = StateMismatchError("model 'm'", missing=["model.w"])
    with pytest.raises(StateMismatchError) as raised:  # this rank's (rank 0's) own statekit error, as it is
        _run_dcp(failing((0, own), (1, ValueError("other"))), "sharded load")
    assert raised.value is own
