"""The exception hierarchy: one base, public module name, the builtin each leaf refines, messages."""

from __future__ import annotations

import pickle

import pytest

import statekit
from statekit import errors

LEAVES = {
    # class: the builtin it refines (None: only StatekitError)
    "CheckpointNotFoundError": FileNotFoundError,
    "IncompleteCheckpointError": None,
    "CollectiveTimeoutError": TimeoutError,
    "CorruptCheckpointError": ValueError,
    "BaseReferenceError": None,
    "MissingBaseError": FileNotFoundError,
    "ChangedBaseError": ValueError,
    "FormatVersionError": ValueError,
    "StateMismatchError": ValueError,
    "PluginError": None,
    "PluginMissingError": None,
    "PickleNotAllowedError": PermissionError,
    "CheckpointExistsError": FileExistsError,
    "CheckpointInUseError": PermissionError,
    "AsyncSaveError": None,
    "UnsupportedValueError": TypeError,
    "UnsupportedDtypeError": TypeError,
    "InvalidOptionError": ValueError,
    "StorageError": OSError,
    "ResumeMismatchError": ValueError,
}


def test_every_error_is_listed():
    exported = {name for name in errors.__all__ if name != "StatekitError" and not name.endswith("Warning")}
    assert exported == set(LEAVES)


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_error_class(name):
    cls = getattr(statekit, name)
    assert cls is getattr(errors, name)
    assert issubclass(cls, statekit.StatekitError)
    assert issubclass(cls, Exception)
    assert cls.__module__ == "statekit"
    builtin = LEAVES[name]
    if builtin is not None:
        assert issubclass(cls, builtin)
    assert cls.__doc__, f"{name} has no docstring"


def test_base_and_warning():
    assert statekit.StatekitError.__module__ == "statekit"
    assert issubclass(statekit.StatekitError, Exception)
    assert statekit.StatekitWarning.__module__ == "statekit"
    assert issubclass(statekit.StatekitWarning, UserWarning)
    assert not issubclass(statekit.StatekitWarning, statekit.StatekitError)
    assert issubclass(statekit.ResumeFingerprintWarning, statekit.StatekitWarning)
    assert statekit.ResumeFingerprintWarning.__module__ == "statekit"
    assert repr(statekit.StatekitError("x")) == "StatekitError('x')"


def test_not_found_is_caught_as_file_not_found():
    with pytest.raises(FileNotFoundError, match="no checkpoint at s3://b/x"):
        raise statekit.CheckpointNotFoundError("no checkpoint at s3://b/x")


def test_corrupt_carries_path():
    exc = statekit.CorruptCheckpointError("/ckpt/model.safetensors: checksum differs", path="/ckpt/model.safetensors")
    assert exc.path == "/ckpt/model.safetensors"
    assert str(exc) == "/ckpt/model.safetensors: checksum differs"
    assert statekit.CorruptCheckpointError("no path").path is None


def test_state_mismatch_lists_keys():
    exc = statekit.StateMismatchError(
        "model 'model'",
        missing=["b.weight", "a.weight"],
        unexpected=["c.bias"],
        mismatched={"d.weight": "saved [2, 3] vs model [3, 3]"},
    )
    assert exc.missing == ["a.weight", "b.weight"]
    assert exc.unexpected == ["c.bias"]
    assert exc.mismatched == {"d.weight": "saved [2, 3] vs model [3, 3]"}
    message = str(exc)
    assert message.startswith("state of model 'model' does not match the checkpoint")
    assert "missing keys: a.weight, b.weight" in message
    assert "unexpected keys: c.bias" in message
    assert "shape/dtype differences: d.weight (saved [2, 3] vs model [3, 3])" in message


def test_state_mismatch_long_lists_are_previewed():
    exc = statekit.StateMismatchError("model 'm'", missing=[f"k{i:03d}" for i in range(25)])
    assert len(exc.missing) == 25
    assert "k019" in str(exc) and "k020" not in str(exc)
    assert "(5 more)" in str(exc)


def test_state_mismatch_without_details():
    exc = statekit.StateMismatchError("optimizer 'optim'")
    assert str(exc) == "state of optimizer 'optim' does not match the checkpoint"
    assert exc.missing == [] and exc.unexpected == [] and exc.mismatched == {}


def test_plugin_error_attributes():
    exc = statekit.PluginError("plugin 'x' failed in statekit_save_state_pre", plugin_name="x", hook_name="statekit_save_state_pre")
    assert exc.plugin_name == "x"
    assert exc.hook_name == "statekit_save_state_pre"
    assert "plugin 'x' failed" in str(exc)
    bare = statekit.PluginError("boom")
    assert bare.plugin_name is None and bare.hook_name is None


def test_plugin_missing_error():
    exc = statekit.PluginMissingError("pip install statekit-fsdp", plugin_name="fsdp", distribution="statekit-fsdp")
    assert isinstance(exc, statekit.PluginError)
    assert exc.plugin_name == "fsdp"
    assert exc.distribution == "statekit-fsdp"
    assert exc.hook_name is None
    assert "statekit-fsdp" in str(exc)


def test_storage_error_carries_url():
    exc = statekit.StorageError("writing s3://b/x failed", url="s3://b/x")
    assert exc.url == "s3://b/x"
    assert isinstance(exc, OSError)
    assert str(exc) == "writing s3://b/x failed"


def test_unsupported_dtype_is_an_unsupported_value():
    assert issubclass(statekit.UnsupportedDtypeError, statekit.UnsupportedValueError)
    with pytest.raises(TypeError, match="cannot store"):
        raise statekit.UnsupportedDtypeError("tensor 'x' has dtype torch.foo, which statekit cannot store")


@pytest.mark.parametrize(
    "exc",
    [
        statekit.CheckpointNotFoundError("no checkpoint at /x"),
        statekit.CheckpointExistsError("/x already holds a committed checkpoint"),
        statekit.FormatVersionError("format 'statekit/9'"),
        statekit.UnsupportedValueError("cannot store state['f']"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_simple_errors_pickle(exc):
    # errors cross process boundaries (multiprocessing, torch.distributed gather)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc)
    assert str(again) == str(exc)


@pytest.mark.parametrize(
    "exc",
    [
        statekit.CorruptCheckpointError("/x/m.safetensors: checksum", path="/x/m.safetensors"),
        statekit.PluginError("plugin 'p' failed", plugin_name="p", hook_name="statekit_save_state_pre"),
        statekit.StorageError("writing s3://b/x failed", url="s3://b/x"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_with_attributes_pickle(exc):
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and vars(again) == vars(exc)


@pytest.mark.parametrize(
    "exc",
    [
        statekit.PluginMissingError("pip install statekit-x", plugin_name="x", distribution="statekit-x"),
        statekit.StateMismatchError("model 'm'", missing=["a"]),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_with_required_arguments_pickle(exc):
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and vars(again) == vars(exc)
