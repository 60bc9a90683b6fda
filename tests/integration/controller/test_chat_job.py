"""The chat example (`examples/cpu-chat-gsm8k.yaml`) as a newcomer runs it: a Qwen2-shaped
instruct policy, Parquet word problems through the ChatML template with a system turn, the
strict GSM8K verifier. Its accuracy on the held-out split rises (`spotrl ckpt export`, then
`spotrl eval` before and after); a SIGTERM and a resume train the same prompts as the
uninterrupted run, and TensorBoard shows each step once; a cut whose rollouts carry the raw,
untemplated prompt tokens of the same prompts (consistent in every other way) is refused by
name."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from controller_runs import ROOT, Runs, accuracy_before_and_after, run_example, spotrl, stop, stream, wait_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.core.cut_format import decode_rollouts, encode_rollouts
from spotrl_runtime.data.word_problems import split_rows

pytestmark = pytest.mark.slow

TEST_SPLIT = ROOT / "examples" / "data" / "word-problems" / "test.parquet"
RISE = 0.06
"""Held-out accuracy (mean@4) must rise at least this much over the example's 60 steps
(measured: 0.111 before, 0.209 after)."""


def _cli(runs: Runs, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return spotrl(*args, timeout=timeout, env=runs.env(), cwd=runs.base)


@pytest.fixture(scope="module")
def example(runs: Runs) -> tuple[Path, Path, int]:
    """(job file, store, steps) of the example run once to its end, never stopped."""
    from spotrl_runtime.models.tiny_chat import tiny_chat_dir

    tiny_chat_dir()  # built once into the shared cache (the runs find it prebuilt)
    return run_example(runs, "cpu-chat-gsm8k.yaml", "chat-example")


def test_held_out_accuracy_rises(example: tuple[Path, Path, int], runs: Runs) -> None:
    prompts = len(split_rows("test"))
    before, after = accuracy_before_and_after(runs, example, "builtin:tiny-chat", TEST_SPLIT, prompts)
    assert after >= before + RISE, (before, after)


def test_the_run_reports_its_validation_accuracy(example: tuple[Path, Path, int]) -> None:
    """The example's spec.validation: the held-out split scored greedily on the weights of
    steps 0, 20 and 40 (each in a later step's record)."""
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.storage import open_storage

    _, store, _ = example
    passes = [d for d in AuditStore(open_storage(str(store))).documents() if "val_step" in d]
    assert {0, 20} <= {int(d["val_step"]) for d in passes} <= {0, 20, 40}, passes
    assert all(d["val_prompts"] == min(32, len(split_rows("test"))) for d in passes)
    print("validation accuracy by step:", {int(d["val_step"]): d["val_accuracy"] for d in passes})


RESUMED_TO = 14
"""The interrupted run resumes to this step: seven steps past its cut at step 7."""


@pytest.fixture(scope="module")
def interrupted(
    example: tuple[Path, Path, int], runs: Runs, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """(store, barrier cut id): the example stopped by SIGTERM while step 7 trains (generation
    runs ahead meanwhile, so the cut holds finished rollouts), then resumed to step RESUMED_TO
    (the steps after it would prove again what these prove, at a second a step)."""
    job, _, _ = example
    store = runs.base / "chat-interrupted"
    marks = tmp_path_factory.mktemp("chat-marks")
    proc = runs.start(job, store, SPOTRL_FAILPOINTS="train.step@7=4", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "the run to reach step 7", proc)
    time.sleep(2)
    assert stop(proc) == 143, runs.log_of(proc)
    cuts = sorted(p for p in (store / "cuts").iterdir() if (p / "manifest.json").exists())
    barrier = CutSurgery(cuts[-1])
    assert barrier.m["kind"] == "barrier", runs.log_of(proc)
    assert decode_rollouts(barrier.path("rollouts").read_bytes()), "the barrier cut holds finished rollouts"
    saved = runs.base / "chat-barrier"
    shutil.copytree(store, saved)
    rc, log = runs.run(job, store, "--max-steps", str(RESUMED_TO))
    assert rc == 0, log
    assert f"resumed from cut {cuts[-1].name}" in log
    return saved, cuts[-1].name


def test_sigterm_and_resume_train_the_same_prompts_and_tensorboard_shows_each_step_once(
    example: tuple[Path, Path, int], interrupted: tuple[Path, str], runs: Runs
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, reference, steps = example
    store = runs.base / "chat-interrupted"
    assert steps > RESUMED_TO
    assert stream(store) == stream(reference)[:RESUMED_TO]
    assert len(list((store / "tensorboard").glob("events.out.tfevents.*"))) == 2, "one file per attempt"
    events = EventAccumulator(str(store / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/accuracy")] == list(range(RESUMED_TO))


def test_a_cut_with_untemplated_prompt_tokens_is_refused_by_name(
    example: tuple[Path, Path, int], interrupted: tuple[Path, str], runs: Runs
) -> None:
    """The rollouts' prompt tokens replaced by the raw encoding of the same prompts (what a
    run with ``promptFormat: raw`` stores): digests and counts recomputed, so only the
    template differs. Verify has no tokenizer; the restore refuses it before training."""
    from transformers import AutoTokenizer

    from spotrl_runtime.models.tiny_chat import tiny_chat_dir

    job, _, _ = example
    saved, cut_id = interrupted
    root = runs.base / "chat-forged"
    shutil.copytree(saved, root)
    cut = CutSurgery(root / "cuts" / cut_id)
    tok = AutoTokenizer.from_pretrained(tiny_chat_dir())
    questions = {i: r["question"] for i, r in enumerate(split_rows("train"))}
    rows = decode_rollouts(cut.path("rollouts").read_bytes())
    idx_of = {g["group_id"]: g["idx"] for g in cut.json("replay_index")["groups"]}
    idx_of |= {r["group_id"]: r["idx"] for r in cut.json("ledger")["records"]}
    forged = {}
    for group, samples in rows.items():
        idx = idx_of[group]
        raw = tuple(tok(questions[idx], add_special_tokens=False)["input_ids"])
        assert raw != samples[0].prompt_token_ids
        forged[group] = tuple(replace(s, prompt_token_ids=raw) for s in samples)
    cut.replace("rollouts", encode_rollouts(list(forged.items())), fix_counts=True)
    assert _cli(runs, "ckpt", "verify", str(root), "-f", str(job), "--json").returncode == 0

    rc, log = runs.run(job, root, "--resume", "auto", timeout=180)
    assert rc == 3, log
    assert "[rollout_prompt_tokens]" in log
    assert cut_id in log
