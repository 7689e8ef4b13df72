"""The state digest (statekit.checks.digest, issue 38): one number per tensor that
does not depend on how the tensor is split, full or sampled, with what sampling can miss
exactly as documented."""

from __future__ import annotations

import itertools

import pytest
import torch

from statekit.checks.digest import Sampling, box_sum, digests, format_sum, partial_sum, tensor_digest

SAMPLED = Sampling(block=4, stride=64, full_below=0)  # small numbers: the same arithmetic, small tensors
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64, torch.complex128]


def sample(dtype, shape=(37, 29)):
    torch.manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return (torch.randn(shape) * 50).to(dtype)


def split_sum(t, cuts, sampling):
    flat = t.reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    return format_sum(sum(partial_sum(flat[a:b], a, flat.numel(), sampling) for a, b in zip(bounds, bounds[1:])))


@pytest.mark.parametrize("sampling", [Sampling.FULL, SAMPLED], ids=["full", "sampled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_digest_of_the_pieces_is_the_digest_of_the_whole_however_it_is_split(dtype, sampling):
    t = sample(dtype)
    whole = tensor_digest(t, sampling)
    for cuts in ([1], [500], [29, 58, 87], [3, 4, 5, 1000], list(range(100, 1000, 100))):
        assert split_sum(t, cuts, sampling) == whole
    assert tensor_digest(t.t().contiguous().t(), sampling) == whole  # a non-contiguous view: its row-major values


def grid_sum(t, cuts, sampling):
    """The digest of ``t`` from the blocks of a grid: ``cuts[d]`` are the cut points of dimension d."""
    bounds = [[0, *c, n] for c, n in zip(cuts, t.shape)]
    total = 0
    for corner in itertools.product(*[range(len(b) - 1) for b in bounds]):
        block = tuple(slice(b[i], b[i + 1]) for b, i in zip(bounds, corner))
        total += box_sum(t[block], [b[i] for b, i in zip(bounds, corner)], t.shape, sampling)
    return format_sum(total)


@pytest.mark.parametrize("sampling", [Sampling.FULL, SAMPLED, Sampling(block=3, stride=11, full_below=0)],
                         ids=["full", "sampled", "small-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128, torch.bool], ids=str)
def test_the_blocks_of_any_grid_add_up_to_the_digest_of_the_whole(dtype, sampling):
    """A shard of any dimension or several (a DTensor's Shard(1), a 2-D mesh) is a block: not
    one contiguous run of the tensor, keyed element by element by its global position."""
    t = sample(dtype, (6, 9, 5))
    whole = tensor_digest(t, sampling)
    for cuts in ([[], [4], []], [[3], [], []], [[], [], [2]], [[1, 5], [2, 7], [3]], [[2], [9 - 1], [1, 2, 3, 4]]):
        assert grid_sum(t, cuts, sampling) == whole, cuts
    assert box_sum(t[2:4, :, :], (2, 0, 0), t.shape, sampling) == partial_sum(t[2:4], 2 * 45, t.numel(), sampling)
    assert box_sum(t[:, 3:3], (0, 3, 0), t.shape, sampling) == 0  # an empty shard


def test_a_block_outside_the_tensor_is_refused():
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"block of shape \[2, 4\] at \[3, 0\] is not inside a tensor of shape \[4, 4\]"):
        box_sum(t[:2], (3, 0), t.shape)
    with pytest.raises(ValueError, match="not inside"):
        box_sum(t, (0,), t.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_changed_element_always_changes_the_full_digest(dtype):
    t = sample(dtype)
    whole = tensor_digest(t)
    for index in (0, 17, t.numel() - 1):
        changed = t.clone().reshape(-1)
        changed[index] = (not changed[index]) if dtype == torch.bool else changed[index] + 1
        assert tensor_digest(changed) != whole


def test_swapped_shards_and_shifted_values_change_the_digest():
    t = torch.randn(64, 16)
    swapped = torch.cat([t[32:], t[:32]])
    shifted = torch.roll(t.reshape(-1), 1).reshape(64, 16)
    for sampling in (Sampling.FULL, SAMPLED):
        assert tensor_digest(swapped, sampling) != tensor_digest(t, sampling)
        assert tensor_digest(shifted, sampling) != tensor_digest(t, sampling)


def test_a_sampled_digest_sees_every_run_of_the_documented_length_and_may_miss_a_shorter_one():
    t = torch.randn(4096) + 10  # no zero anywhere
    whole = tensor_digest(t, SAMPLED)
    run = SAMPLED.stride - SAMPLED.block + 1  # the documented length (missable_run + 1)
    assert SAMPLED.missable_run == run - 1
    for start in range(0, t.numel() - run, 7):
        zeroed = t.clone()
        zeroed[start:start + run] = 0
        assert tensor_digest(zeroed, SAMPLED) != whole, start
    gap = t.clone()
    gap[SAMPLED.block:SAMPLED.stride] = 0  # exactly the positions between two blocks
    assert tensor_digest(gap, SAMPLED) == whole  # missed, as documented
    assert tensor_digest(gap) != tensor_digest(t)  # the full digest sees it


def test_small_tensors_are_digested_whole_under_a_sampling():
    sampling = Sampling(block=4, stride=64, full_below=1000)
    t = torch.randn(999) + 10
    changed = t.clone()
    changed[10] = 0  # between two blocks
    assert tensor_digest(changed, sampling) != tensor_digest(t, sampling)


@pytest.mark.parametrize("sampling", [Sampling.FULL, Sampling()], ids=["full", "default"])
def test_digests_of_many_tensors_equal_their_digests_one_by_one(sampling):
    tensors = {f"t{i}": sample(DTYPES[i % len(DTYPES)], (i + 1, 7)) for i in range(40)}
    tensors["empty"] = torch.zeros(0)
    tensors["large"] = torch.randn(300_000)
    assert digests(tensors, sampling) == {name: tensor_digest(t, sampling) for name, t in tensors.items()}
    assert list(digests(tensors, sampling)) == list(tensors)


def test_sampling_round_trips_through_its_json():
    assert Sampling.from_json(Sampling().to_json()) == Sampling()
    assert Sampling.FULL.is_full and not Sampling().is_full and Sampling().missable_run == 4080
