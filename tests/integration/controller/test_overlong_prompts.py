"""`spotrl run` of the chat example on vLLM's CPU build with ``maxModelLen: 128`` and four
problems too long for it among the first steps' rows: each is filtered when admitted (never
sent to the engine), its place taken by a spare (``onDroppedPrompt: replace``), no group of
another prompt fails, and the audit keeps each with its reason. SIGKILLed in step 1 and
resumed, the run filters the same prompts and trains the same stream, exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from controller_runs import Runs, audit, audit_summary, chat_example, kill_rng, killed_in_step
from test_controller_vllm import pytestmark  # noqa: F401 - slow, and only where vLLM's CPU build runs

LONG = (1, 9, 10, 20)
"""Rows made too long. Unshuffled, 8 prompts a step, the spares taken before the first
admission: step 0 is rows 0-7 (row 1 filtered, spare 8 takes its place), the pool holds 9-15,
step 1 is rows 16-23 (row 20 filtered; spares 9 and 10 filtered on the way, 11 takes it)."""
STREAM = [(0, [0, 2, 3, 4, 5, 6, 7, 8]), (1, [11, 16, 17, 18, 19, 21, 22, 23]), (2, list(range(24, 32)))]


def _dataset(tmp: Path) -> Path:
    """The example's training problems, rows ``LONG`` each made five problems long (~150 tokens
    through the chat template, the others ~45)."""
    table = pq.read_table(Path(chat_example()["spec"]["dataset"]["uri"]))
    questions = table.column("question").to_pylist()
    for i in LONG:
        questions[i] = " ".join([questions[i]] * 5)
    path = tmp / "train-with-long-problems.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("question"), "question", [questions]), path)
    return path


def test_overlong_prompts_are_filtered_at_admission_exactly_once_across_a_kill(runs: Runs, tmp_path: Path) -> None:
    from spotrl_runtime.models.tiny_chat import tiny_chat_dir

    tiny_chat_dir()  # built once into the shared cache
    base = chat_example()
    del base["spec"]["validation"]
    job = runs.job(
        {
            "dataset.uri": str(_dataset(tmp_path)),
            "dataset.shuffle": False,
            "generation.backend": "vllm",
            "generation.lookahead": 0,
            "generation.kvCacheMemory": "64Mi",
            "generation.maxModelLen": 128,
            "generation.groupSize": 4,
            "generation.promptsPerStep": 8,
            "training.totalSteps": 3,
            "training.microBatchSize": 32,
            "checkpoint.everySteps": 1,
        },
        base=base,
    )
    storage = tmp_path / "cuts"
    seed, rng = kill_rng()
    killed = killed_in_step(runs, job, storage, tmp_path / "marks", 1, rng, hold=30)
    assert "are filtered at admission" in runs.log_of(killed)

    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert "resumed from cut" in log, log
    docs = audit(storage)
    assert [(d["step"], d["prompts"]) for d in docs] == STREAM, seed
    filtered = [(f["idx"], f["reason"]) for d in docs for f in d.get("filtered", [])]
    assert sorted(i for i, _ in filtered) == sorted(LONG), filtered
    for _, reason in filtered:
        assert reason.startswith("prompt_too_long: "), reason
        assert reason.endswith(" + maxNewTokens 32 > maxModelLen 128"), reason
    assert not any("dropped" in d for d in docs), "no group of another prompt failed"
    for text in (runs.log_of(killed), log):
        assert "dropping group" not in text, "no group failed"
    summary = audit_summary(storage)
    assert summary["prompts_filtered"] == len(LONG), summary
    assert (summary["prompts_dropped"], summary["prompts_lost"], summary["prompts_trained_twice"]) == (0, 0, 0)
    assert (summary["steps_missing"], summary["restores"]) == (0, 1), summary
