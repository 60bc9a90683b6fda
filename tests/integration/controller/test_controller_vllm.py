"""`spotrl run` with ``generation.backend: vllm`` on vLLM's CPU build: the production engine in
the generation worker, stopped mid-generation, mid-weight-sync and at a random point, then
resumed. The resumed run's effective stream equals the uninterrupted run's, and every step
reports the generator's mismatch with the trainer (``lookahead: 0``: every group is generated
with the weights the step starts from), within the float32 bound. One chain of four attempts,
not a test per stop: each vLLM start costs about a minute here.
"""

from __future__ import annotations

import platform
import signal
from pathlib import Path

import pytest
from controller_runs import (
    Runs,
    audit,
    audit_summary,
    chat_example,
    kill_rng,
    killed_in_step,
    newest_cut,
    stop,
    stream,
    wait_for,
)

from spotrl_runtime.vllm_build import vllm_build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        vllm_build() == "cuda" or platform.machine() != "x86_64",
        # Not skipped where the CPU build is missing but belongs: there the backend's install message fails the test.
        reason="vLLM's CPU build is for x86-64 machines without its CUDA build (test_generation_gpu.py covers that)",
    ),
]

VLLM = {"generation.backend": "vllm", "generation.lookahead": 0, "generation.kvCacheMemory": "64Mi"}
PROBS_DIFF_BOUND = 1e-4
"""float32 on the CPU; measured per step: mean ~1e-7, max under 1e-6."""


def _assert_the_weights_arrived(storage: Path) -> None:
    """Every step of the effective stream measured the gap, and it is float32 rounding."""
    docs = audit(storage)
    gap = audit_summary(storage)["rollout_gap"]
    assert gap["steps"] == len(docs) == 16, gap
    assert 0 <= gap["max"] < PROBS_DIFF_BOUND, gap
    print(f"vLLM CPU run: rollout_probs_diff mean {gap['mean']:.2e}, max {gap['max']:.2e} over {gap['tokens']} tokens")


def _sigterm_at(runs: Runs, job: Path, storage: Path, marks: Path, failpoint: str) -> tuple[str, int, str]:
    """A run held at ``failpoint`` (``name@step=seconds``) and SIGTERMed there: exit 143, nothing
    left running, a barrier cut committed; (its id, its step, the run's log)."""
    marks.mkdir()
    name = failpoint.partition("@")[0]
    proc = runs.start(job, storage, SPOTRL_FAILPOINTS=failpoint, SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / name).exists(), 300, f"the run to reach {failpoint}", proc)
    assert stop(proc, signal.SIGTERM) == 143, runs.log_of(proc)
    runs.assert_nothing_left(proc)
    cut_id, kind, cut_step = newest_cut(storage)
    assert kind == "barrier"
    return cut_id, cut_step, runs.log_of(proc)


def test_stopped_mid_generation_mid_weight_sync_and_killed_it_trains_the_uninterrupted_prompts(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """One run of the job, stopped three times: SIGTERM while a group is generated (step 4), SIGTERM
    while the worker holds new weights it has not loaded (4 steps after the first resume), SIGKILL
    at a random step after that; the fourth attempt finishes. The effective stream is the
    session's uninterrupted run's, which the transformers backend trained: the batches are the
    loader's, whatever engine generates them. Every step's gap says the weights arrived."""
    storage, job = tmp_path / "cuts", runs.job(VLLM)
    first_cut, first_step, _ = _sigterm_at(runs, job, storage, tmp_path / "marks-1", "dispatch.finish@4=4")

    second_cut, second_step, log = _sigterm_at(
        runs, job, storage, tmp_path / "marks-2", f"worker.load_weights@{first_step + 4}=4"
    )
    assert f"resumed from cut {first_cut} (barrier) at step {first_step}" in log, log
    assert second_step > first_step

    seed, rng = kill_rng()
    target = rng.randrange(second_step + 2, 14)
    proc = killed_in_step(runs, job, storage, tmp_path / "kill-marks", target, rng, hold=0.3)
    assert f"resumed from cut {second_cut} (barrier) at step {second_step}" in runs.log_of(proc)

    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert "probs diff" in log, "the run log reports the gap each step"
    assert stream(storage) == baseline
    summary = audit_summary(storage)
    assert (summary["prompts_lost"], summary["prompts_trained_twice"], summary["restores"]) == (0, 0, 3), seed
    assert summary["steps_retrained"] <= 1, f"a kill costs at most the step in progress (seed {seed}): {summary}"
    _assert_the_weights_arrived(storage)


def test_the_chat_example_trains_on_vllm_and_its_weights_arrive(runs: Runs, tmp_path: Path) -> None:
    """``builtin:tiny-chat`` (Qwen2: q/k/v biases, grouped-query attention, a BPE tokenizer,
    two EOS ids) through vLLM's CPU build: four steps of the chat example with ``lookahead:
    0``. Every step's gap to the trainer is float32 rounding, so every weight sync reached the
    engine, and the verifier scores some completions right (templated prompts the model
    understands, completions stopped at its EOS and decoded)."""
    from spotrl_runtime.models.tiny_chat import tiny_chat_dir

    tiny_chat_dir()  # built once into the shared cache
    storage = tmp_path / "cuts"
    job = runs.job({**VLLM, "training.totalSteps": 4, "checkpoint.everySteps": 2}, base=chat_example())
    rc, log = runs.run(job, storage)
    assert rc == 0, log
    docs = audit(storage)
    assert [d["step"] for d in docs] == [0, 1, 2, 3]
    gap = audit_summary(storage)["rollout_gap"]
    assert gap["steps"] == 4, gap
    assert 0 <= gap["max"] < PROBS_DIFF_BOUND, gap
    assert sum(d["reward"] for d in docs) > 0, docs
    # Every step's weights came over the channel: the policy's unique tensors in float32, once.
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.generation.weights import unique_tensors
    from spotrl_runtime.models import load_policy
    from spotrl_runtime.storage import open_storage

    model, _ = load_policy("builtin:tiny-chat")
    policy_bytes = sum(t.numel() * 4 for _, t in unique_tensors(model.state_dict(keep_vars=True)))
    records = AuditStore(open_storage(str(storage))).documents()
    assert {r["weight_sync_bytes"] for r in records} == {policy_bytes}, records
    assert all(r["weight_sync_seconds"] > 0 for r in records)
    print(f"tiny-chat on vLLM CPU: rollout_probs_diff max {gap['max']:.2e} over {gap['tokens']} tokens")
