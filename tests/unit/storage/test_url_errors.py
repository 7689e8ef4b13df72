"""Storage URLs a save or a manager refuses, naming the URL (docs/bad-input.md): an unknown
scheme, a scheme with one slash, S3 without credentials, ``memory://`` with several ranks."""

from __future__ import annotations

import pytest
import torch

import statekit


def test_wrong_url_scheme():
    with pytest.raises(statekit.StorageError, match="nosuch://x") as info:
        statekit.save("nosuch://x/ckpt", {"t": torch.zeros(1)})
    assert info.value.url == "nosuch://x/ckpt"


@pytest.mark.parametrize("url, fixed", [("s3:/bucket/run", "s3://bucket/run"), ("memory:run", "memory://run")])
def test_a_scheme_with_one_slash_is_refused_not_taken_for_a_local_directory(tmp_path, monkeypatch, url, fixed):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(statekit.StorageError, match=f"did you mean '{fixed}'") as info:
        statekit.CheckpointManager({"t": torch.zeros(1)}, str(tmp_path / "local"), replicate_to=url)
    assert info.value.url == url
    with pytest.raises(statekit.StorageError, match="needs '://'"):
        statekit.save(url, {"t": torch.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no ./s3: directory, no local root


def test_missing_credentials(s3_server, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"client_kwargs": {"endpoint_url": s3_server.endpoint_url}, "skip_instance_cache": True}
    with pytest.raises(statekit.StorageError, match=r"s3://nocreds/ckpt.*(?i:credential)"):
        statekit.save("s3://nocreds/ckpt", {"t": torch.zeros(1)}, storage_options=options)


def test_memory_url_with_many_ranks(monkeypatch):
    monkeypatch.setattr(statekit.distributed, "rank_and_world_size", lambda: (0, 2))
    with pytest.raises(statekit.StorageError, match="memory:// is private to each process"):
        statekit.save("memory://x/c", {"t": torch.zeros(1)})
