"""`spotrl ckpt list|inspect|verify` on real cuts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cut_scenarios import JOB, example_b_before_cut

from spotrl_runtime.checkpoint.ownership import prove_ownership
from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.storage import LocalStorage
from spotrl_runtime.storage.purge import OWNER_KEY


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """Two committed cuts of example B and a torn third one."""
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.cut()
    run.train()  # step 0: prompts 0, 2, 9
    run.pump()  # the gate opens: 12-14 are stamped 3, 15-17 wait
    run.cut("barrier")
    torn = root / "cuts" / "0000000003" / "w9-dead"
    torn.mkdir(parents=True)
    (torn / "ledger.json").write_text("{}")
    return root


def test_list_shows_committed_and_torn_cuts(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotrl(["ckpt", "list", str(job), "--json"]) == 0
    cuts = json.loads(capsys.readouterr().out)["cuts"]
    assert [(c["cut_id"], c["committed"], c.get("kind"), c.get("trainer_step"), c["latest"]) for c in cuts] == [
        ("0000000001", True, "periodic", 0, False),
        ("0000000002", True, "barrier", 1, True),
        ("0000000003", False, None, None, False),
    ]
    assert spotrl(["ckpt", "list", str(job)]) == 0
    text = capsys.readouterr().out
    assert "torn" in text
    assert "<- LATEST" in text


def test_inspect_shows_every_owner_and_file(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotrl(["ckpt", "inspect", str(job), "--json"]) == 0  # the job root means the newest committed cut
    d = json.loads(capsys.readouterr().out)
    assert d["cut_id"] == "0000000002"
    assert d["kind"] == "barrier"
    assert d["trainer_step"] == 1
    assert d["sampler"] == {"dispatch_index": 3, "lookahead": 2}
    assert d["loader"] == {"epoch": 0, "offset": 18, "batches": 6}
    assert [(r["group_id"], r["phase"], r["target_step"]) for r in d["ledger"]] == [
        ("g3", "ADMITTED", 2),
        ("g12", "ADMITTED", 3),
        ("g13", "ADMITTED", 3),
        ("g14", "ADMITTED", 3),
        ("g15", "RESERVED", None),
        ("g16", "RESERVED", None),
        ("g17", "RESERVED", None),
    ]
    assert [(g["group_id"], g["target_step"]) for g in d["replay"]] == [
        ("g6", 1),
        ("g7", 1),
        ("g8", 1),
        ("g10", 2),
        ("g11", 2),
    ]
    assert [s["idx"] for s in d["spare_pool"]] == [4, 5]
    assert [a["idxs"] for a in d["audit_tail"]] == [[0, 2, 9]]
    roles = {f["role"] for f in d["files"]}
    assert {"ledger", "replay_index", "rollouts", "loader", "sampler", "spare_pool", "weights", "optimizer"} <= roles
    cut = job / "cuts" / "0000000002"
    for f in d["files"]:
        data = (cut / f["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size"], f["sha256"])
    assert spotrl(["ckpt", "inspect", str(job / "cuts" / "0000000001")]) == 0
    text = capsys.readouterr().out
    assert "sampler cursor 2" in text
    assert "g12        RESERVED" in text


def test_verify_a_torn_cut_and_an_empty_root(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotrl(["ckpt", "verify", str(job / "cuts" / "0000000003")]) == 1
    assert "FAILED check manifest_present" in capsys.readouterr().err
    assert spotrl(["ckpt", "verify", str(job)]) == 0
    assert spotrl(["ckpt", "verify", str(tmp_path / "nothing-here")]) == 1
    assert "holds no committed cut" in capsys.readouterr().err


def test_verify_for_a_job_refuses_a_store_of_another_and_writes_nothing(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """'Will it resume?' answers as the resume does: a store whose JOB.json names another job is
    refused although its cuts are valid, and the check leaves the store as it was."""
    assert spotrl(["ckpt", "verify", str(job), "--job", JOB]) == 0, capsys.readouterr().err
    assert not (job / OWNER_KEY).exists(), "verify claimed the store"
    prove_ownership(LocalStorage(job), JobIdentity(JOB))
    assert spotrl(["ckpt", "verify", str(job), "--job", JOB, "--json"]) == 0
    capsys.readouterr()
    (job / OWNER_KEY).write_text(json.dumps({"name": "someone-else", "namespace": None, "uid": None}))
    before = sorted(p.name for p in job.iterdir())
    assert spotrl(["ckpt", "verify", str(job), "--job", JOB, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["check"], out["path"]) == ("job_identity", OWNER_KEY)
    assert "the store belongs to job 'someone-else'" in out["error"]
    assert sorted(p.name for p in job.iterdir()) == before
