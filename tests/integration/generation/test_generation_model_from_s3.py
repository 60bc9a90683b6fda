"""A policy stored under an s3:// prefix loads through the storage interface (real S3 server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotrl_runtime.models import load_policy, resolve_model_dir, tiny_arith_dir
from spotrl_runtime.models.tiny_arith import DEFAULT_RECIPE
from spotrl_runtime.storage import open_storage


@pytest.mark.s3
def test_load_policy_from_an_s3_prefix(s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tiny_arith_dir(DEFAULT_RECIPE)  # the demo model, from the usual cache
    for key, value in s3_bucket.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPOTRL_CACHE", str(tmp_path / "cache"))  # downloads land here
    uri = f"s3://{s3_bucket.bucket}/models/tiny-arith"
    store = open_storage(uri)
    for path in source.iterdir():
        store.put_file(path.name, path)

    model, tokenizer = load_policy(uri)
    local = resolve_model_dir(uri)
    assert isinstance(local, Path)
    assert local.is_relative_to(tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in source.iterdir())
    assert (local / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.s3
def test_an_empty_s3_prefix_is_a_named_error(s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotrl_runtime.models import PolicyError

    for key, value in s3_bucket.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPOTRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(PolicyError, match="holds no objects"):
        load_policy(f"s3://{s3_bucket.bucket}/models/nothing-here")
    assert not any((tmp_path / "cache" / "models" / "s3").glob("[!.]*"))
