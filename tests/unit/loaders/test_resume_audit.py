"""Issue 27: every resume proves itself (the resume audit), and the data-position cases a new
user hits without a word: a loop left with ``break``, ``accelerate.skip_first_batches`` (the
function), attaching that changed the run. Every test is written as a user writes the code:
Accelerate's API or ``statekit.CheckpointManager`` over plain loaders, a reference run
against a resumed one."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import statekit
from statekit.cli import main as cli

accelerate = pytest.importorskip("accelerate")


def _accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


def _ids(batch) -> list[int]:
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


# --------------------------------------------------------------------------- break


def _broken_passes(loader, passes: int, per_pass: int) -> list[list[int]]:
    seen = []
    for _ in range(passes):
        for i, batch in enumerate(loader):
            seen.append(_ids(batch))
            if i + 1 == per_pass:
                break
    return seen


def test_loop_left_with_break_resumes_as_the_uninterrupted_run(tmp_path, installed_plugin_manager):
    """Issue 27's minimal case: 24 samples, batch 4, two passes each broken after 2 batches,
    save, resume: the next passes start at the first batch, as the uninterrupted run's do."""
    reference = _broken_passes(DataLoader(list(range(24)), batch_size=4), 4, 2)
    loader = DataLoader(list(range(24)), batch_size=4)
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    first = _broken_passes(loader, 2, 2)
    manager.save(4)
    resumed_loader = DataLoader(list(range(24)), batch_size=4)
    assert statekit.CheckpointManager({"loader": resumed_loader}, str(tmp_path / "run")).resume() == 4
    assert first + _broken_passes(resumed_loader, 2, 2) == reference
    assert reference == [[0, 1, 2, 3], [4, 5, 6, 7]] * 4


def test_break_with_accelerate_and_a_shuffled_loader(tmp_path, installed_plugin_manager):
    """The same with a prepared, shuffled loader ("N batches per epoch" loops), and a global
    draw between passes: batches and the global stream continue as uninterrupted."""

    def run(passes: int, save: bool = False, resume: bool = False) -> list:
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        loader = accelerator.prepare(DataLoader(list(range(24)), batch_size=4, shuffle=True))
        manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
        if resume:
            assert manager.resume() == 2
        seen: list = []
        for _ in range(passes):
            seen += _broken_passes(loader, 1, 2)
            seen.append(torch.rand(()).item())  # a draw between passes
        if save:
            manager.save(2)
        return seen

    reference = run(4)
    assert run(2, save=True) + run(2, resume=True) == reference


# --------------------------------------------------------------------------- attach changes nothing


def test_attaching_right_after_accelerator_changes_no_batch_and_no_loss(installed_plugin_manager):
    """Issue 27: attach() after Accelerator() changed the shuffle order from the first batch."""

    def run(attach: bool):
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        if attach:
            statekit.attach(accelerator)
        model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = DataLoader(torch.arange(16.0).unsqueeze(1) / 16, batch_size=4, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, data)
        seen = []
        for _ in range(2):
            for x in loader:
                loss = model(x).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                seen.append((x.squeeze(1).tolist(), loss.item()))
        return seen

    assert run(attach=True) == run(attach=False)


# --------------------------------------------------------------------------- the audit


class OwnRandomSampler(Sampler):
    """Shuffles with a random.Random of its own that no plugin knows about."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = random.Random(0)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


def _train(loader, steps: int, manager=None, save_at: int | None = None, start: int = 0) -> list[list[int]]:
    seen, step = [], start
    while step < start + steps:
        for batch in loader:
            seen.append(_ids(batch))
            step += 1
            if manager is not None and step == save_at:
                manager.save(step)
            if step >= start + steps:
                break
    return seen


def test_audit_names_a_sampler_with_private_random_state(tmp_path, installed_plugin_manager):
    """Issue 27: 32 samples, batch 4, saved 3 batches into epoch 1: the resumed run's first
    batch is not the uninterrupted run's; the audit names loader, step and both batches."""
    reference = _train(DataLoader(list(range(32)), batch_size=4, sampler=OwnRandomSampler(32)), 16)
    loader = DataLoader(list(range(32)), batch_size=4, sampler=OwnRandomSampler(32))
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    assert _train(loader, 11, manager, save_at=11) == reference[:11]
    resumed = DataLoader(list(range(32)), batch_size=4, sampler=OwnRandomSampler(32))
    manager = statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "run"))
    assert manager.resume() == 11
    expected = ", ".join(str(i) for i in reference[11])
    with pytest.warns(statekit.ResumeAuditWarning) as record:
        got = _train(resumed, 5, start=11)
    assert got != reference[11:]
    message = str(record[0].message)
    assert "loader" in message and "step 11" in message
    assert f"expected indices [{expected}]" in message and f"got [{', '.join(str(i) for i in got[0])}]" in message
    assert record[0].filename == __file__  # points at the user's for loop
    manager.save(16)
    listed = json.loads(CliRunner().invoke(cli, ["ls", str(tmp_path / "run"), "--json"]).output)
    newest = [c for c in listed if c["step"] == 16][0]
    assert newest["resume_audit"]["verdict"] == "diverged"
    assert "expected indices" in newest["resume_audit"]["detail"]


def test_strict_resume_raises_from_the_for_loop(tmp_path, installed_plugin_manager):
    loader = DataLoader(list(range(32)), batch_size=4, sampler=OwnRandomSampler(32))
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    _train(loader, 11, manager, save_at=11)
    resumed = DataLoader(list(range(32)), batch_size=4, sampler=OwnRandomSampler(32))
    assert statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "run")).resume(strict_resume=True) == 11
    with pytest.raises(statekit.ResumeAuditError, match=r"expected indices \[.*\] as batch 3 of epoch 1, got \["):
        next(iter(resumed))


class Augmented(Dataset):
    """Augments with a NumPy generator of its own that no plugin knows about."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i) + self.rng.normal()])


def test_audit_names_content_a_dataset_draws_from_private_state(tmp_path, installed_plugin_manager):
    """Same indices, other values (issue 27: 12.637 vs 12.392): only the content shows it.
    Accelerate's DataLoaderShard holds the next batch at save time, so its digest is saved."""

    def run(resume: bool):
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        loader = accelerator.prepare(DataLoader(Augmented(), batch_size=4, shuffle=True))
        manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
        if resume:
            assert manager.resume() == 11
            with pytest.warns(statekit.ResumeAuditWarning, match=r"has the recorded indices .* but other content"):
                return [b.squeeze(1).tolist() for b in _take(loader, 5)]
        seen = []
        for step, batch in enumerate(_take(loader, 11), start=1):
            seen.append(batch.squeeze(1).tolist())
            if step == 11:
                manager.save(11)
        return seen

    run(False)
    run(True)


def _take(loader, count: int):
    taken = 0
    while taken < count:
        for batch in loader:
            yield batch
            taken += 1
            if taken == count:
                return


def test_an_exact_resume_is_verified_and_recorded_in_the_next_checkpoint(tmp_path, installed_plugin_manager):
    def run(resume: bool):
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        loader = accelerator.prepare(DataLoader(list(range(32)), batch_size=4, shuffle=True))
        manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
        start = manager.resume() or 0
        seen = []
        for step, batch in enumerate(_take(loader, 11 if not resume else 5), start=start + 1):
            seen.append(batch.tolist())
            if step in (11, 16):
                manager.save(step)
        return seen

    reference = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.ResumeAuditWarning)
        run(True)
    assert reference
    result = CliRunner().invoke(cli, ["ls", str(tmp_path / "run")])
    assert result.exit_code == 0
    line = [row for row in result.output.splitlines() if "checkpoint-00000016" in row or row.lstrip().startswith("16")]
    assert line and "verified" in line[0], result.output
    inspected = CliRunner().invoke(cli, ["inspect", str(tmp_path / "run" / "checkpoint-00000016")])
    assert "resume audit" in inspected.output and "verified" in inspected.output and "step 11" in inspected.output


def test_audit_names_a_loader_replaced_after_the_load(tmp_path, installed_plugin_manager):
    loader = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    _train(loader, 3, manager, save_at=3)
    restored = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    manager = statekit.CheckpointManager({"loader": restored}, str(tmp_path / "run"))
    assert manager.resume() == 3
    replacement = DataLoader(list(range(32)), batch_size=4, shuffle=True)  # the mistake
    _train(replacement, 2, start=3)
    with pytest.warns(statekit.ResumeAuditWarning, match=r"loader .*restored position \(epoch 0, batch 3\) was never consumed"):
        manifest = manager.save(5)
    assert manifest is not None
    listed = json.loads(CliRunner().invoke(cli, ["ls", str(tmp_path / "run"), "--json"]).output)
    assert [c for c in listed if c["step"] == 5][0]["resume_audit"]["verdict"] == "diverged"


def test_audit_names_a_position_consumed_an_epoch_late(tmp_path, installed_plugin_manager):
    """A DistributedSampler's epoch comes from the user's own counter: resumed one too far."""

    def loader():
        dataset = list(range(32))
        return DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=3))

    first = loader()
    manager = statekit.CheckpointManager({"loader": first}, str(tmp_path / "run"))
    first.sampler.set_epoch(0)
    list(first)
    first.sampler.set_epoch(1)
    it = iter(first)
    next(it), next(it), next(it)
    manager.save(11)
    again = loader()
    assert statekit.CheckpointManager({"loader": again}, str(tmp_path / "run")).resume() == 11
    again.sampler.set_epoch(2)  # the user's epoch counter, off by one
    with pytest.warns(statekit.ResumeAuditWarning, match=r"restored position of epoch 1 \(batch 3\) was consumed in epoch 2"):
        next(iter(again))


def test_audit_names_a_position_shifted_by_one_batch(tmp_path, installed_plugin_manager):
    """accelerate.skip_first_batches (the function) with one batch too many after a resume
    that already continues at the saved batch is refused by name, as the method is."""
    from accelerate import skip_first_batches

    def build():
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        return accelerator, accelerator.prepare(DataLoader(list(range(32)), batch_size=4, shuffle=True))

    accelerator, loader = build()
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    list(_take(loader, 11))
    it = iter(loader)
    next(it), next(it), next(it)
    manager.save(11)
    accelerator, loader = build()
    assert statekit.CheckpointManager(accelerator, str(tmp_path / "run")).resume() == 11
    with pytest.raises(statekit.StateMismatchError, match=r"skip_first_batches\(4\) after a statekit resume that already continues epoch 1 at batch 3"):
        skip_first_batches(loader, 4)


# --------------------------------------------------------------------------- skip_first_batches, the function


def test_skip_first_batches_function_after_a_resume_continues_exactly(tmp_path, installed_plugin_manager):
    """Issue 27: with the function the rest of the epoch came in a new order and the next
    epoch replayed the interrupted one (10 batches instead of 13)."""
    from accelerate import skip_first_batches  # imported before statekit is attached, as scripts do

    def build():
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        return accelerator, accelerator.prepare(DataLoader(list(range(32)), batch_size=4, shuffle=True))

    accelerator, loader = build()
    reference = [b.tolist() for _ in range(3) for b in loader]  # 24 batches
    accelerator, loader = build()
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    seen = [b.tolist() for b in loader]
    it = iter(loader)
    seen += [next(it).tolist() for _ in range(3)]
    manager.save(11)

    accelerator, loader = build()
    manager = statekit.CheckpointManager(accelerator, str(tmp_path / "run"))
    assert manager.resume() == 11
    with warnings.catch_warnings():  # the script's resume idiom, served exactly: no warning
        warnings.simplefilter("error", statekit.StatekitWarning)
        rest = skip_first_batches(loader, 3)
    seen += [b.tolist() for b in rest]
    seen += [b.tolist() for b in loader]
    assert len(seen) - 11 == 13
    assert seen == reference


class Stream(torch.utils.data.IterableDataset):
    """A stream without state whose length depends on where it is read (not reproducible)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_audit_names_a_resumed_epoch_that_ends_before_the_saved_position(tmp_path, installed_plugin_manager):
    loader = DataLoader(Stream(24), batch_size=4)
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    it = iter(loader)
    next(it), next(it), next(it)
    manager.save(3)
    shorter = DataLoader(Stream(8), batch_size=4)  # the stream came back shorter
    assert statekit.CheckpointManager({"loader": shorter}, str(tmp_path / "run")).resume() == 3
    with pytest.warns(statekit.ResumeAuditWarning, match=r"the resumed epoch 0 ended without yielding batch 3"):
        assert list(shorter) == []


def test_a_plain_loader_is_verified_by_its_indices_and_says_so(tmp_path, installed_plugin_manager):
    """A plain DataLoader does not hold the next batch at save time: the verdict says the
    content was not checked, rather than claiming more than was checked."""
    loader = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    _train(loader, 3, manager, save_at=3)
    resumed = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    manager = statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "run"))
    assert manager.resume() == 3
    _train(resumed, 2, start=3)
    manager.save(5)
    listed = json.loads(CliRunner().invoke(cli, ["ls", str(tmp_path / "run"), "--json"]).output)
    audit = [c for c in listed if c["step"] == 5][0]["resume_audit"]
    assert audit["verdict"] == "verified"
    assert audit["detail"].startswith("indices only: content not recorded")


def test_attach_mode_resumes_are_audited_too(tmp_path, installed_plugin_manager):
    """Code that keeps calling accelerator.save_state / load_state with statekit attached."""

    def build(sampler: bool):
        from accelerate.utils import set_seed

        set_seed(0)
        accelerator = _accelerator()
        statekit.attach(accelerator)
        kwargs = {"sampler": OwnRandomSampler(32)} if sampler else {"shuffle": True}
        return accelerator, accelerator.prepare(DataLoader(list(range(32)), batch_size=4, **kwargs))

    for sampler, verdict in ((False, "verified"), (True, "diverged")):
        accelerator, loader = build(sampler)
        list(loader)  # epoch 0: the private sampler's next shuffle is not its first any more
        it = iter(loader)
        next(it), next(it), next(it)
        accelerator.save_state(str(tmp_path / f"a{sampler}"))
        accelerator, loader = build(sampler)
        accelerator.load_state(str(tmp_path / f"a{sampler}"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        named = [w for w in caught if issubclass(w.category, statekit.ResumeAuditWarning)]
        assert bool(named) == sampler, [str(w.message) for w in caught]
        accelerator.save_state(str(tmp_path / f"b{sampler}"))
        manifest = json.loads((tmp_path / f"b{sampler}" / "statekit.json").read_text())
        assert manifest["resume_audit"]["verdict"] == verdict


def test_audit_names_a_saved_position_shifted_by_one_batch(tmp_path, installed_plugin_manager):
    """A checkpoint whose loader position is one batch off (edited here, with valid
    checksums, as a buggy position mechanism would write it): the audit names it."""
    from statekit.storage.hashing import checksum_bytes
    from statekit.testing import rewrite_manifest

    torch.manual_seed(0)
    expected = [b.tolist() for b in DataLoader(list(range(32)), batch_size=4, shuffle=True)][3]  # uninterrupted
    torch.manual_seed(0)
    loader = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    manager = statekit.CheckpointManager({"loader": loader}, str(tmp_path / "run"))
    it = iter(loader)
    next(it), next(it), next(it)
    manager.save(3)
    checkpoint = tmp_path / "run" / "checkpoint-00000003"
    position = checkpoint / "loader" / "rank-00000.json"
    data = position.read_bytes().replace(b'"batches": 3,', b'"batches": 4,', 1)
    position.write_bytes(data)

    def fix(manifest):
        manifest["files"]["loader/rank-00000.json"].update(size_bytes=len(data), checksum=checksum_bytes(data))

    rewrite_manifest(checkpoint, fix)
    resumed = DataLoader(list(range(32)), batch_size=4, shuffle=True)
    assert statekit.CheckpointManager({"loader": resumed}, str(tmp_path / "run")).resume() == 3
    with pytest.warns(statekit.ResumeAuditWarning, match=r"expected indices \[(\d+, ){3}\d+\] as batch 3 of epoch 0, got \[") as record:
        next(iter(resumed))
    assert str(expected)[1:-1] in str(record[0].message)


class _OwnEpochSampler(Sampler):
    """A correct sampler that counts its own epochs: a new permutation each pass, its epoch
    raised when a pass runs out, saved and restored with the run."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __iter__(self):
        yield from torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        self.epoch += 1

    def __len__(self) -> int:
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def test_a_sampler_counting_its_own_epoch_saved_before_the_last_batch_is_verified(tmp_path, installed_plugin_manager):
    """Issue 35's false alarm: saved with only the epoch's last batch left, the resume is
    exact; the audit's read-ahead runs the sampler out (its epoch counts one more) before the
    check, which must not be taken as a divergence."""

    def build():
        sampler = _OwnEpochSampler(16)
        loader = DataLoader(list(range(16)), batch_size=4, sampler=sampler)
        return loader, statekit.CheckpointManager({"loader": loader, "sampler": sampler}, str(tmp_path / "run"))

    reference, _ = build()
    expected = [b.tolist() for _ in range(3) for b in reference]
    loader, manager = build()
    seen = [b.tolist() for b in loader]  # epoch 0
    it = iter(loader)
    seen += [next(it).tolist() for _ in range(3)]  # epoch 1, the last batch left
    manager.save(7)
    loader, manager = build()
    assert manager.resume() == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error", statekit.ResumeAuditWarning)
        seen += [b.tolist() for b in loader]
        seen += [b.tolist() for b in loader]
    assert seen == expected
    assert manager.save(12) is not None
    listed = json.loads(CliRunner().invoke(cli, ["ls", str(tmp_path / "run"), "--json"]).output)
    assert [c for c in listed if c["step"] == 12][0]["resume_audit"]["verdict"] == "verified"
