"""`spotrl run` of a LoRA job (policy.lora): SIGTERMed mid-step, SIGKILLed at a random point,
then finished, it ends with the uninterrupted run's stream and adapter, bit for bit; its barrier
cut is a full cut of the adapter and its optimizer alone; a resume with another rank is refused
by check ``policy_identity``. On vLLM's CPU build in bf16, every step's adapter reaches the engine
(the gap check) and travels alone."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from controller_runs import (
    TINY_JOB,
    Runs,
    assert_same_weights,
    audit,
    audit_summary,
    chat_example,
    final_weights,
    fsdp,
    kill_rng,
    killed_in_step,
    newest_cut,
    spotrl,
    stop,
    stream,
    wait_for,
)

from spotrl_e2e.checks import assert_adapter_alone
from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.api.rljob import EXIT_REFUSED
from spotrl_runtime.core.validation import INDEX_ROLE, SHARD_ROLE
from spotrl_runtime.vllm_build import vllm_build

pytestmark = pytest.mark.slow

LORA = {
    "policy.lora": {"rank": 8},
    "training.totalSteps": 8,
    "training.learningRate": 0.003,
    "checkpoint.everySteps": 2,
}


def _cut_bytes(storage: Path, cut_id: str) -> tuple[str, int, set[str]]:
    """(form, bytes of the trainer's files, the roles under trainer/) of a committed cut."""
    cut = CutSurgery(storage / "cuts" / cut_id)
    trainer = [f for f in cut.m["files"] if "/trainer/" in f["path"]]
    return cut.m["form"], sum(f["size"] for f in trainer), {f["role"] for f in trainer}


LORA_STORE = "lora-baseline"


@pytest.fixture(scope="module")
def lora_baseline(runs: Runs) -> tuple[list[tuple[int, list[int]]], dict[str, Any]]:
    """The LoRA job run once, never stopped (in ``runs.base / LORA_STORE``): its stream and final adapter."""
    storage = runs.base / LORA_STORE
    rc, log = runs.run(runs.job(LORA), storage)
    assert rc == 0, log
    return stream(storage), final_weights(storage)


def test_a_lora_run_stopped_then_killed_ends_with_the_uninterrupted_stream_and_adapter(
    runs: Runs, lora_baseline: tuple[list[tuple[int, list[int]]], dict[str, Any]], tmp_path: Path
) -> None:
    baseline_stream, baseline_adapter = lora_baseline
    assert baseline_adapter
    assert all(".lora_" in name for name in baseline_adapter), "the cut holds the adapter alone"
    storage, job = tmp_path / "cuts", runs.job(LORA)

    marks = tmp_path / "marks-term"
    marks.mkdir()
    proc = runs.start(job, storage, SPOTRL_FAILPOINTS="train.step@3=4", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 3", proc)
    assert stop(proc, signal.SIGTERM) == 143, runs.log_of(proc)
    cut_id, kind, cut_step = newest_cut(storage)
    assert kind == "barrier"
    form, trainer_bytes, roles = _cut_bytes(storage, cut_id)
    assert form == "full", "an adapter's cut always fits: the barrier is a full cut"
    adapter_bytes = sum(t.numel() * 4 for t in baseline_adapter.values())
    assert trainer_bytes < 4 * adapter_bytes + (64 << 10), "weights, AdamW's two moments and small files: no base"
    assert {"weights", "optimizer"} <= roles
    print(f"LoRA barrier cut {cut_id}: {trainer_bytes} trainer bytes (adapter {adapter_bytes} bytes in float32)")

    _, rng = kill_rng()
    proc = killed_in_step(runs, job, storage, tmp_path / "marks-kill", rng.randrange(cut_step + 1, 7), rng)
    assert f"resumed from cut {cut_id} (barrier) at step {cut_step}" in runs.log_of(proc)

    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert stream(storage) == baseline_stream
    assert_same_weights(final_weights(storage), baseline_adapter)

    # The same storage, resumed with another rank: refused by name before anything trains.
    other = runs.job({**LORA, "policy.lora": {"rank": 4}, "training.totalSteps": 10})
    trained = len(audit(storage, "--all"))
    rc, log = runs.run(other, storage)
    assert rc == EXIT_REFUSED, log  # a configuration error to the operator: no crash counted
    assert "policy_identity" in log, log
    assert "policy.lora.rank" in log, log
    assert len(audit(storage, "--all")) == trained


@pytest.mark.skipif(
    vllm_build() == "cuda" or platform.machine() != "x86_64",
    reason="vLLM's CPU build is for x86-64 machines without its CUDA build",
)
def test_the_chat_example_with_lora_trains_on_vllm_in_bf16_and_only_the_adapter_travels(
    runs: Runs, tmp_path: Path
) -> None:
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.storage import open_storage

    storage = tmp_path / "cuts"
    example = chat_example("cpu-chat-gsm8k-lora.yaml")  # its adapter and rate, as a newcomer copies it
    assert example["spec"]["policy"]["lora"] == {"rank": 16}
    overrides = {
        "policy.dtype": "bfloat16",
        "generation.backend": "vllm",
        "generation.lookahead": 0,
        "generation.kvCacheMemory": "64Mi",
        "training.totalSteps": 4,
        "checkpoint.everySteps": 2,
    }
    rc, log = runs.run(runs.job(overrides, base=example), storage)
    assert rc == 0, log
    gap = audit_summary(storage)["rollout_gap"]
    assert gap["steps"] == 4, gap
    assert 0 <= gap["max"] < 0.25, gap
    records = AuditStore(open_storage(str(storage))).documents()
    adapter = final_weights(storage)
    adapter_bf16_bytes = sum(t.numel() * 2 for t in adapter.values())
    assert {r["weight_sync_bytes"] for r in records} == {adapter_bf16_bytes}, "the adapter alone, in bf16"
    print(f"tiny-chat + rank-16 LoRA on vLLM CPU bf16: rollout gap max {gap['max']:.2e}, sync {adapter_bf16_bytes} B")


def test_a_lora_run_resharded_2_to_3_ranks_trains_the_uninterrupted_prompts(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """A LoRA run of two attempts on 2 then 3 FSDP ranks (a count the first does not divide), the
    second resuming from the first one's sharded cut: the prompts of the uninterrupted run, and
    every cut holds the adapter's shards alone (no shard of the frozen base), with its identity."""
    storage = tmp_path / "cuts"
    steps = 4
    cut_id = None
    for ranks, until in ((2, 2), (3, None)):
        job = runs.job({**LORA, **fsdp(ranks), "training.totalSteps": steps})
        rc, log = runs.run(job, storage, *(["--max-steps", str(until)] if until else []))
        assert rc == 0, log
        assert f"trainer group: {ranks} FSDP2 ranks" in log, log
        if cut_id is not None:
            assert f"resumed from cut {cut_id}" in log, log
        cut_id, _, step = newest_cut(storage)
        assert step == (until or steps)
        cut = CutSurgery(storage / "cuts" / cut_id)
        assert cut.m["trainer_format"] == "dcp/v1"
        meta = json.loads(cut.path("trainer_meta").read_bytes())
        assert meta["adapter"]["rank"] == 8
        shards = [f for f in cut.m["files"] if f["role"] == SHARD_ROLE]
        index = cut.path(INDEX_ROLE).read_bytes()
        assert_adapter_alone(index, sum(f["size"] for f in shards), TINY_JOB["spec"]["policy"]["model"], 8)
    assert stream(storage) == baseline[:steps]


def test_a_lora_cut_exports_as_a_peft_folder_or_merged_and_eval_scores_either(
    runs: Runs, lora_baseline: tuple[list[tuple[int, list[int]]], dict[str, Any]], tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel

    from spotrl_runtime.models import load_policy

    _, adapter = lora_baseline
    storage = runs.base / LORA_STORE

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return spotrl(*args, env=runs.env(), cwd=tmp_path)

    peft_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert cli("ckpt", "export", str(storage), "--base", "builtin:tiny-arith", "--out", str(peft_dir)).returncode == 0
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["base_model_name_or_path"]) == (8, "builtin:tiny-arith")
    assert not (peft_dir / "config.json").exists(), "the adapter alone, not the base"
    from safetensors.torch import load_file

    exported = load_file(str(peft_dir / "adapter_model.safetensors"))
    assert len(exported) == len(adapter)
    assert sum(t.numel() for t in exported.values()) == sum(t.numel() for t in adapter.values())
    out = cli("ckpt", "export", str(storage), "--base", "builtin:tiny-arith", "--merge", "--out", str(merged_dir))
    assert out.returncode == 0, out.stderr
    refused = cli("ckpt", "export", str(storage), "--base", "builtin:tiny-chat", "--out", str(tmp_path / "no"))
    assert refused.returncode == 1
    assert "trained on another base" in refused.stderr
    assert not (tmp_path / "no").exists()

    base, tok = load_policy("builtin:tiny-arith")
    served = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    merged, _ = load_policy(str(merged_dir))
    plain, _ = load_policy("builtin:tiny-arith")
    ids = torch.tensor([tok("3+4=")["input_ids"]])
    with torch.no_grad():
        a, m, p = served(ids).logits, merged(ids).logits, plain(ids).logits
    torch.testing.assert_close(m, a, rtol=1e-4, atol=1e-5)
    assert float((a - p).abs().max()) > 1e-3, "the adapter changed the policy"

    job = runs.job({**LORA, "dataset.split": "test"})
    scores = []
    for model in (peft_dir, merged_dir):
        out = cli("eval", "-f", str(job), "--model", str(model), "--limit", "16", "--json")
        assert out.returncode == 0, out.stderr
        scores.append(json.loads(out.stdout)["accuracy"])
    assert scores[0] == scores[1], "an adapter folder is scored as the base with the adapter merged in"
