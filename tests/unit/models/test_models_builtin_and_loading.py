"""The built-in policies, the model cache, and loading from a folder or an s3:// prefix."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spotrl_runtime.models import (
    DEFAULT_RECIPE,
    PolicyError,
    arithmetic_problems,
    build_char_tokenizer,
    load_policy,
    model_cache_dir,
    resolve_model_dir,
    tiny_arith_dir,
)
from spotrl_runtime.models.cache import build_once
from spotrl_runtime.models.random_policy import RandomPolicyShape, random_policy_dir
from spotrl_runtime.storage import download_prefix

QUICK_RECIPE = dataclasses.replace(DEFAULT_RECIPE, pretrain_steps=3, batch_size=8)


def test_char_tokenizer_round_trip_with_bos_and_eos() -> None:
    tok = build_char_tokenizer()
    ids = tok("3+4= 7")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 7  # bos + one id per character
    assert tok.decode(ids, skip_special_tokens=True) == "3+4= 7"
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "3+4= 7"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("3?")["input_ids"][-1] == tok.unk_token_id


def test_padded_char_tokenizer_decodes_every_id() -> None:
    tok = build_char_tokenizer(pad_to=100)
    assert len(tok) == 100
    assert isinstance(tok.decode(list(range(100))), str)


def test_model_cache_dir_follows_spotrl_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPOTRL_CACHE", str(tmp_path))
    assert model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("SPOTRL_CACHE")
    assert model_cache_dir() == Path.home() / ".cache" / "spotrl" / "models"


def test_build_once_builds_once_under_concurrency(tmp_path: Path) -> None:
    calls: list[int] = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.2)
        (out / "weights").write_text("w")

    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build_once(tmp_path / "m", build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "m"] * 4
    assert (tmp_path / "m" / "weights").read_text() == "w"


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path / "m", broken)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_tiny_arith_builds_a_plain_hf_folder_cached_by_recipe(tmp_path: Path) -> None:
    folder = tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json", "spotrl-recipe.json"} <= {
        p.name for p in folder.iterdir()
    }
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = tiny_arith_dir(dataclasses.replace(QUICK_RECIPE, seed=99), cache_dir=tmp_path)
    assert other != folder
    # Loadable with transformers alone.
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tok)
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000


def test_the_tiny_arith_build_is_deterministic(tmp_path: Path) -> None:
    a = tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path / "a")
    b = tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path / "b")
    wa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_demo_policy_knows_most_sums_but_rambles_past_them() -> None:
    """The property the demo rests on: exact answers well below what the model knows."""
    from spotrl_runtime.generation import GenerationRequest
    from spotrl_runtime.generation.transformers_backend import TransformersBackend

    model, tok = load_policy("builtin:tiny-arith")
    backend = TransformersBackend(model, tok)
    problems = arithmetic_problems()
    results = backend.generate(
        [GenerationRequest(str(i), tuple(tok(p)["input_ids"]), 8, 8, seed=i) for i, (_, p, _) in enumerate(problems)]
    )
    texts = [(s.text, answer) for r, (_, _, answer) in zip(results, problems, strict=True) for s in r.samples]
    exact = sum(t.strip() == a for t, a in texts) / len(texts)
    knows = sum(t.split(" ")[0] == a for t, a in texts) / len(texts)
    assert 0.2 < exact < 0.6
    assert knows > 0.7
    assert knows - exact > 0.25


def test_load_policy_builtin_local_and_dtype(tmp_path: Path) -> None:
    folder = tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path)
    model, tok = load_policy(str(folder))
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert tok.pad_token_id == 0

    class Policy:
        model = str(folder)
        dtype = "bfloat16"

    half, _ = load_policy(Policy())
    assert next(half.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("builtin:gpt-17", "unknown built-in model 'builtin:gpt-17'.*builtin:tiny-arith"),
        ("/nonexistent/model/dir", "does not exist"),
        ("./relative/missing", "does not exist"),
    ],
)
def test_policy_errors_name_the_field(ref: str, message: str) -> None:
    with pytest.raises(PolicyError, match=f"policy.model: .*{message}"):
        resolve_model_dir(ref)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"no config\.json"):
        load_policy(str(tmp_path))


def test_a_bad_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"policy\.dtype"):
        load_policy(str(tmp_path), dtype="int8")


def test_s3_models_are_downloaded_once_through_the_given_downloader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotrl_runtime.storage import LocalStorage

    monkeypatch.setenv("SPOTRL_CACHE", str(tmp_path / "cache"))
    source = tiny_arith_dir(QUICK_RECIPE, cache_dir=tmp_path / "src")
    fetched: list[str] = []

    def downloader(uri: str, dest: Path) -> None:
        fetched.append(uri)
        download_prefix(LocalStorage(source), dest)

    model, tok = load_policy("s3://models-bucket/tiny/", downloader=downloader)
    assert fetched == ["s3://models-bucket/tiny"]
    local = resolve_model_dir("s3://models-bucket/tiny", downloader=downloader)
    assert fetched == ["s3://models-bucket/tiny"]  # cached: not fetched again
    assert isinstance(local, Path)
    assert local.is_relative_to(tmp_path / "cache" / "models")
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in source.iterdir())
    assert tok("1+1=")["input_ids"][0] == tok.bos_token_id
    assert model.config.vocab_size == len(tok)


def test_random_policy_shape_counts_its_parameters(tmp_path: Path) -> None:
    shape = RandomPolicyShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2)
    folder = random_policy_dir(shape, cache_dir=tmp_path)
    model, tok = load_policy(str(folder))
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()
    assert len(tok) == 64
    assert RandomPolicyShape().num_parameters() == pytest.approx(100e6, rel=0.05)


def test_the_qwen_shapes_count_their_parameters_and_keep_the_100m_key(tmp_path: Path) -> None:
    """A small Qwen2 (grouped-query attention, q/k/v biases) as built and counted; the published
    sizes of Qwen2.5-0.5B (494M) and 1.5B (1.54B); random-100m's cache key as before Qwen shapes."""
    from spotrl_runtime.models.random_policy import RANDOM_0_5B, RANDOM_1_5B, RANDOM_100M

    shape = RandomPolicyShape(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        architecture="qwen2",
    )  # fmt: skip
    model, tok = load_policy(str(random_policy_dir(shape, cache_dir=tmp_path)))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.num_key_value_heads == 2
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()
    assert len(tok) == 64
    assert RANDOM_0_5B.num_parameters() == pytest.approx(494e6, rel=0.01)
    assert RANDOM_1_5B.num_parameters() == pytest.approx(1.54e9, rel=0.01)
    assert RANDOM_100M.key() == "a9f2cc809294fc01"


_RANK_BUILD = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from spotrl_runtime.models.random_policy import RandomPolicyShape, random_policy_dir

rank, cache = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[3]}", rank=rank, world_size=2)
shape = RandomPolicyShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2)
try:
    out = {"built": str(random_policy_dir(shape, cache_dir=cache))}
except RuntimeError as err:
    out = {"error": str(err)}
out["left"] = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
dist.barrier()
print(json.dumps(out))
"""


@pytest.mark.slow  # a child process that imports torch and starts a process group
def test_a_model_built_inside_a_process_group_on_rank_1_is_refused_not_cached(tmp_path: Path) -> None:
    """transformers' save_pretrained writes no weights on a torch.distributed rank other than 0:
    such a build must fail loudly and cache nothing (a trainer pod once cached a folder without
    weights, and every later load failed)."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for rank in (0, 1):
        (tmp_path / f"cache-{rank}").mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_BUILD, str(rank), str(tmp_path / f"cache-{rank}"), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err0, err1)
    rank0, rank1 = json.loads(out0), json.loads(out1)
    assert "built" in rank0, rank0
    assert len(rank0["left"]) == 1, rank0
    assert "save_pretrained wrote no config.json, model.safetensors" in rank1["error"], rank1
    assert rank1["left"] == [], "nothing cached on rank 1"


def test_a_prebuilt_model_is_used_as_is_and_nothing_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime image ships the demo policy (SPOTRL_PREBUILT_MODELS): a fresh controller
    must take it rather than build it again into its own cache."""
    from spotrl_runtime.models.cache import PREBUILT_ENV
    from spotrl_runtime.models.prebuild import main as prebuild
    from spotrl_runtime.models.tiny_arith import DEFAULT_RECIPE, NAME

    shipped = tmp_path / "image" / "models"
    built = build_once(shipped / f"{NAME}-{DEFAULT_RECIPE.key()}", lambda d: (d / "config.json").write_text("{}"))
    monkeypatch.setenv(PREBUILT_ENV, f"{tmp_path / 'elsewhere'}:{shipped}")
    monkeypatch.setenv("SPOTRL_CACHE", str(tmp_path / "home-cache"))
    calls: list[Path] = []
    assert build_once(tmp_path / "home-cache" / "models" / built.name, calls.append) == built
    assert calls == [], "nothing is built when the image has it"
    assert tiny_arith_dir() == built
    assert not (tmp_path / "home-cache").exists()
    # Another name (another recipe) is not in the image: it is built into the cache as before.
    other = build_once(tmp_path / "home-cache" / "models" / "other-0", lambda d: (d / "x").write_text("1"))
    assert other == tmp_path / "home-cache" / "models" / "other-0"
    assert (other / "x").read_text() == "1"
    assert prebuild([]) == 2, "the folder is required"
