"""Cuts made by the real controller, forged so that exactly one invariant between owners
breaks: every file keeps a size and sha256 that match its manifest, every count matches,
and every check before the broken one passes. `spotrl ckpt verify -f` refuses each with
that check's name, and `spotrl run --resume auto` refuses it too: it exits 3 naming the
check, trains nothing and writes no audit record; where the precheck sees the forgery, before
Ray starts."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from controller_runs import Runs, audit, stop, stream, verify, wait_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.core.cut_format import (
    decode_rollouts,
    encode_rollouts,
)
from spotrl_runtime.data import reopen_dataset

JOB = {
    "generation.lookahead": 2,
    "preemption.onDroppedPrompt": "replace",
    "preemption.sparePoolBatches": 1,
    "training.totalSteps": 10,
    "checkpoint.everySteps": 2,
    "checkpoint.keep": 10,
}


def _suitable(cut: CutSurgery) -> bool:
    sampler, ledger = cut.json("sampler"), cut.json("ledger")["records"]
    return (
        sampler["trainer_step"] > 0
        and sampler["dispatch_index"] > sampler["trainer_step"]
        and any(r["phase"] == "RESERVED" for r in ledger)
        and len(cut.json("replay_index")["groups"]) > 0
    )


@pytest.fixture(scope="module")
def made(runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(job file, store, id of a barrier cut with trained, finished, in-flight and reserved groups).

    The controller sleeps 6 s inside step 5 while generation runs ahead (lookahead 2); 3 s in,
    a SIGTERM takes the barrier cut as soon as the step commits. The run then resumes to its end.
    """
    job = runs.job(JOB)
    store = runs.base / "forgery-source"
    marks = tmp_path_factory.mktemp("marks")
    proc = runs.start(job, store, SPOTRL_FAILPOINTS="train.step@5=6", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "the run to reach step 5", proc)
    time.sleep(3)
    assert stop(proc) == 143, runs.log_of(proc)
    cuts = sorted(p for p in (store / "cuts").iterdir() if (p / "manifest.json").exists())
    barrier = cuts[-1]
    assert CutSurgery(barrier).m["kind"] == "barrier", runs.log_of(proc)
    assert _suitable(CutSurgery(barrier)), f"cut {barrier.name} lacks trained, finished, ADMITTED or RESERVED groups"
    rc, log = runs.run(job, store)
    assert rc == 0, log
    return job, store, barrier.name


def forge_one_config(c: CutSurgery) -> None:
    c.m["config"]["min_step_fraction"] = 0.25
    c.save_manifest()


def forge_counters(c: CutSurgery) -> None:
    def change(doc: Any) -> None:
        reserved = next(r["admission_id"] for r in doc["records"] if r["phase"] == "RESERVED")
        for r in doc["records"]:
            if r["admission_id"] == reserved:
                r["admission_id"] = "a9999"

    c.edit_json("ledger", change, fix_counts=True)


def forge_gate(c: CutSurgery) -> None:
    sampler = c.json("sampler")
    lookahead = sampler["dispatch_index"] - sampler["trainer_step"] - 1  # one less than the cursor needs
    c.edit_json("sampler", lambda d: d["config"].update(lookahead=lookahead), fix_counts=True)
    c.m["config"]["lookahead"] = lookahead
    c.save_manifest()


def forge_coverage(c: CutSurgery) -> None:
    c.edit_json("sampler", lambda d: d.update(retired=[]), fix_counts=True)


def forge_census(c: CutSurgery) -> None:
    # A finished group vanishes, its order moved to the retired set: every order still has
    # one owner, but its step holds one group too few.
    index = c.json("replay_index")
    gone = index["groups"].pop(0)
    rows = decode_rollouts(c.path("rollouts").read_bytes())
    del rows[gone["group_id"]]
    c.replace("rollouts", encode_rollouts(list(rows.items())), fix_counts=True)
    c.replace("replay_index", json.dumps(index).encode(), fix_counts=True)
    retired = [tuple(x) for x in c.json("sampler")["retired"]] + [(gone["order"], gone["order"] + 1)]
    merged: list[list[int]] = []
    for start, end in sorted(retired):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    c.edit_json("sampler", lambda d: d.update(retired=merged), fix_counts=True)


def forge_fingerprints(c: CutSurgery) -> None:
    c.edit_json("ledger", lambda d: d["records"][0].update(fingerprint=""), fix_counts=True)


def forge_trainer_state(c: CutSurgery) -> None:
    meta = c.json("trainer_meta")
    meta["trainer_step"] += 1
    c.replace("trainer_meta", json.dumps(meta).encode(), fix_counts=True)


def forge_loader_position(c: CutSurgery) -> None:
    c.edit_json("loader", lambda d: d.update(_num_yielded=d["_num_yielded"] + 1), fix_counts=True)


def forge_loader_rows(c: CutSurgery) -> None:
    dataset, collate = reopen_dataset(c.m["dataset"])

    def change(doc: Any) -> None:
        rec = next(r for r in doc["records"] if r["phase"] == "RESERVED")
        other = (rec["idx"] + 1) % len(dataset)
        row = collate(dataset[other])
        rec.update(idx=other, task_name=row.task_name, fingerprint=row.fingerprint)

    c.edit_json("ledger", change, fix_counts=True)


def forge_prompt_tokens(c: CutSurgery) -> None:
    rows = decode_rollouts(c.path("rollouts").read_bytes())
    first, second = list(rows)[:2]
    rows[first] = tuple(replace(r, prompt_token_ids=rows[second][0].prompt_token_ids[:-1]) for r in rows[first])
    c.replace("rollouts", encode_rollouts(list(rows.items())), fix_counts=True)


FORGERIES: list[tuple[str, Callable[[CutSurgery], None]]] = [
    ("one_config", forge_one_config),
    ("counters", forge_counters),
    ("gate", forge_gate),
    ("coverage", forge_coverage),
    ("census", forge_census),
    ("fingerprints_uniform", forge_fingerprints),
    ("trainer_state", forge_trainer_state),
    ("loader_position", forge_loader_position),
    ("loader_rows", forge_loader_rows),
    ("rollout_prompt_tokens", forge_prompt_tokens),  # restore only: it needs the tokenizer
]


# The forgeries only the restore sees: they need the dataset's rows (torch's permutation) or the
# policy's tokenizer. The precheck refuses every other one before anything starts.
RESTORE_ONLY = {"loader_rows", "rollout_prompt_tokens"}


def _copy(store: Path, cut_id: str, to: Path) -> CutSurgery:
    """The store up to ``cut_id`` (newer cuts left out, so ``--resume auto`` meets it first)."""
    shutil.copytree(store, to, ignore=lambda d, names: [n for n in names if Path(d).name == "cuts" and n > cut_id])
    return CutSurgery(to / "cuts" / cut_id)


def test_the_controllers_cut_passes_verify_against_its_job(made: tuple[Path, Path, str], runs: Runs) -> None:
    job, store, cut_id = made
    out = verify(job, _copy(store, cut_id, runs.base / "untouched").cut.parents[1])
    assert out.returncode == 0, out.stderr
    checks = json.loads(out.stdout)["checks"]
    assert "coverage" in checks
    assert "job_identity" in checks
    assert "config_compatible" in checks
    assert "rollout_prompt_tokens" not in checks


@pytest.mark.parametrize(("check", "forge"), FORGERIES, ids=[c for c, _ in FORGERIES])
def test_a_forged_cut_is_refused_and_nothing_trains(
    check: str, forge: Callable[[CutSurgery], None], made: tuple[Path, Path, str], runs: Runs
) -> None:
    job, store, cut_id = made
    root = runs.base / f"forged-{check}"
    cut = _copy(store, cut_id, root)
    forge(cut)
    before = audit(root, "--all")

    out = verify(job, root)
    if check == "rollout_prompt_tokens":
        assert out.returncode == 0, "verify has no tokenizer; the restore runs this check"
    else:
        assert out.returncode == 1, out.stdout + out.stderr
        assert json.loads(out.stdout)["check"] == check

    rc, log = runs.run(job, root, "--resume", "auto", timeout=180)
    assert rc == 3, log
    assert f"[{check}]" in log
    assert cut_id in log
    assert audit(root, "--all") == before, "a refused resume trains nothing"
    # The precheck refuses before Ray starts what it can see without the dataset's rows and
    # the tokenizer; those two checks are the restore's, after the start.
    started = "Ray and the generation pool started" in log
    assert started == (check in RESTORE_ONLY), log


def test_resume_auto_skips_a_damaged_newest_cut_loudly_and_trains_the_same_prompts(
    made: tuple[Path, Path, str], runs: Runs
) -> None:
    job, store, _ = made
    root = runs.base / "damaged-newest"
    shutil.copytree(store, root)
    cuts = sorted(p.name for p in (root / "cuts").iterdir())
    newest = CutSurgery(root / "cuts" / cuts[-1])
    weights = newest.path("weights")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit on disk: the digest no longer matches
    weights.write_bytes(bytes(data))
    for d in [d for d in audit(root, "--all") if d["step"] >= CutSurgery(root / "cuts" / cuts[-2]).m["trainer_step"]]:
        # As if the run had been lost right after the damaged cut: its later steps are gone.
        (root / "audit" / f"step-{d['step']:08d}" / f"attempt-{d['attempt']:04d}.json").unlink()

    rc, log = runs.run(job, root, "--resume", "auto")
    assert rc == 0, log
    assert f"skipped damaged cut {cuts[-1]} (file_digest)" in log
    assert f"resumed from cut {cuts[-2]}" in log
    assert stream(root) == stream(store), "the older cut's later steps train the same prompts again"


def test_a_semantic_failure_is_never_skipped(made: tuple[Path, Path, str], runs: Runs) -> None:
    job, store, cut_id = made
    root = runs.base / "semantic-newest"
    cut = _copy(store, cut_id, root)
    forge_coverage(cut)
    rc, log = runs.run(job, root, "--resume", "auto", timeout=180)
    assert rc == 3, log
    assert "[coverage]" in log
    assert "skipped damaged cut" not in log
    assert "Ray and the generation pool started" not in log, "refused before anything started"
