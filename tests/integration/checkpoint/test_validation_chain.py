"""Every check of the validation chain, on a real cut broken in that way: restore refuses it
with the named error, and `spotrl ckpt verify` exits non-zero naming the check."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cut_scenarios import DATASET, EXAMPLE_B, dataset_description, example_b_before_cut, loader_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.checkpoint import restore_cut, trainer_state
from spotrl_runtime.checkpoint.trainer_state import TorchSaveFormat, TrainerFile, TrainerSnapshot
from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core import validation as v
from spotrl_runtime.core.cut_format import (
    decode_rollouts,
    encode_rollouts,
)
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data import ArithmeticDataset, JsonlDataset, PromptCollate
from spotrl_runtime.data.dataset import PromptDataset
from spotrl_runtime.storage import LocalStorage, open_storage


@pytest.fixture
def cut_root(tmp_path: Path) -> Path:
    """A committed cut of worked example B (finished, in-flight, reserved and spare groups)."""
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.finish("g3", (0,))  # a partly finished ADMITTED group: one sibling row in the cut
    run.cut()
    return root


def jsonl_of(rows: list[dict[str, Any]], path: Path) -> str:
    path.write_text("".join(json.dumps({k: r[k] for k in ("task_name", "prompt", "answer")}) + "\n" for r in rows))
    return str(path)


def swapped_dataset(tmp_path: Path) -> str:
    """The same rows, but row 3 swapped with a row of the other task: a reordered dataset."""
    rows = [DATASET[i] for i in range(len(DATASET))]
    j = next(i for i, r in enumerate(rows) if r["task_name"] != rows[3]["task_name"] and i > 20)
    rows[3], rows[j] = rows[j], rows[3]
    return jsonl_of(rows, tmp_path / "reordered.jsonl")


def edited_dataset(tmp_path: Path) -> str:
    """The same rows, but row 3's answer edited (same idx, same task)."""
    rows = [dict(DATASET[i]) for i in range(len(DATASET))]
    rows[3]["answer"] = "42"
    return jsonl_of(rows, tmp_path / "edited.jsonl")


def break_orphan(s: CutSurgery) -> None:
    (s.path("ledger").parent / "ledger-from-another-run.json").write_bytes(s.path("ledger").read_bytes())


def break_flip_byte(s: CutSurgery) -> None:
    p = s.path("weights")
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def reserved_with_stamp(doc: Any) -> None:
    doc["records"][1]["target_step"] = 5


def truncate_ledger(doc: Any) -> None:
    doc["records"].pop()


def split_admission(doc: Any) -> None:
    # g13 ADMITTED (stamp 3) while its batch-mates g12 and g14 stay RESERVED.
    rec = next(r for r in doc["records"] if r["group_id"] == "g13")
    rec.update(phase="ADMITTED", target_step=3, weight_version=0)


def two_owners(doc: Any) -> None:
    doc["records"].append(
        {
            "group_id": "g0",
            "admission_id": "a0",
            "order": 0,
            "idx": 0,
            "task_name": DATASET[0]["task_name"],
            "phase": "ADMITTED",
            "target_step": 0,
            "expected_generations": 2,
            "weight_version": 0,
            "fingerprint": "",
        }
    )


def drop_a_row(s: CutSurgery) -> None:
    rows = decode_rollouts(s.path("rollouts").read_bytes())
    rows["g9"] = rows["g9"][:1]
    s.replace("rollouts", encode_rollouts(list(rows.items())), fix_counts=True)


# Forgeries of one invariant between owners each: every file still matches its size and digest,
# every count matches, and every check before the named one passes.


def edit_config(s: CutSurgery, **change: Any) -> None:
    """The same config change in both copies (sampler.json and the manifest)."""
    s.edit_json("sampler", lambda d: d["config"].update(change))
    s.m["config"].update(change)
    s.save_manifest()


def foreign_admission(doc: Any) -> None:
    # The whole RESERVED batch (g12..g14) under an admission id no counter handed out.
    for rec in doc["records"]:
        if rec["phase"] == "RESERVED":
            rec["admission_id"] = "a99"


def move_to_step_2(doc: Any) -> None:
    # A finished group of step 1 restamped 2: step 1 holds 2 groups and step 2 holds 4.
    next(g for g in doc["groups"] if g["target_step"] == 1)["target_step"] = 2


def unfingerprint(doc: Any) -> None:
    doc["groups"][0]["fingerprint"] = ""


def other_row(doc: Any) -> None:
    # g13 (order 13) names row 20, with row 20's task and fingerprint: the row exists and
    # rebuilds, but it is not the one the loader read at order 13.
    row = PromptCollate()(DATASET[20])
    rec = next(r for r in doc["records"] if r["group_id"] == "g13")
    rec.update(idx=20, task_name=row.task_name, fingerprint=row.fingerprint)


def edit_trainer_meta(s: CutSurgery) -> None:
    meta = json.loads(s.path("trainer_meta").read_bytes())
    meta["trainer_step"] = 3
    s.replace("trainer_meta", json.dumps(meta).encode())


def foreign_prompt_tokens(s: CutSurgery) -> None:
    rows = decode_rollouts(s.path("rollouts").read_bytes())
    rows["g9"] = tuple(replace(r, prompt_token_ids=rows["g0"][0].prompt_token_ids) for r in rows["g9"])
    s.replace("rollouts", encode_rollouts(list(rows.items())))


def encode(prompt: Prompt) -> tuple[int, ...]:
    """How the scenario's generation encodes a prompt (see cut_scenarios.rollout)."""
    return tuple(ord(c) for c in prompt.text)


# (check, how to break the cut, extra `verify` args, restore keyword overrides)
Breaker = Callable[[CutSurgery, Path], Any]
CASES: list[tuple[str, Breaker, list[str], dict[str, Any]]] = [
    ("manifest_present", lambda s, t: s.manifest_path.unlink(), [], {}),
    ("manifest_parses", lambda s, t: s.manifest_path.write_text("{not json"), [], {}),
    ("schema_version", lambda s, t: (s.m.update(schema_version=99), s.save_manifest()), [], {}),
    ("job_identity", lambda s, t: None, ["--job", "other/job"], {"expect": v.Expectations(job="other/job")}),
    (
        "config_compatible",
        lambda s, t: None,
        None,  # type: ignore[list-item]
        {"expect": v.Expectations(config=RecoveryConfig(group_size=4, prompts_per_step=3, lookahead=2))},
    ),
    ("file_present", lambda s, t: s.path("ledger").unlink(), [], {}),
    ("file_size", lambda s, t: s.path("rollouts").write_bytes(s.path("rollouts").read_bytes()[:-5]), [], {}),
    ("file_digest", lambda s, t: break_flip_byte(s), [], {}),
    ("orphan_file", lambda s, t: break_orphan(s), [], {}),
    ("owner_file_format", lambda s, t: s.replace("sampler", b"[]"), [], {}),
    ("one_config", lambda s, t: (s.m["config"].update(min_step_fraction=0.9), s.save_manifest()), [], {}),
    ("ledger_record", lambda s, t: s.edit_json("ledger", reserved_with_stamp), [], {}),
    ("group_counts", lambda s, t: s.edit_json("ledger", truncate_ledger), [], {}),
    ("admission_consistent", lambda s, t: s.edit_json("ledger", split_admission, fix_counts=True), [], {}),
    ("counters", lambda s, t: s.edit_json("ledger", foreign_admission), [], {}),
    ("single_owner", lambda s, t: s.edit_json("ledger", two_owners, fix_counts=True), [], {}),
    ("rollout_rows", lambda s, t: drop_a_row(s), [], {}),
    (
        "cursor_covers_stamps",
        lambda s, t: (
            s.edit_json("sampler", lambda d: d.update(dispatch_index=1)),
            s.m.update(dispatch_index=1),
            s.save_manifest(),
        ),
        [],
        {},
    ),
    (
        "stamp_not_trained",
        lambda s, t: (
            s.edit_json("sampler", lambda d: d.update(trainer_step=1)),
            s.m.update(trainer_step=1),
            s.save_manifest(),
        ),
        [],
        {},
    ),
    ("gate", lambda s, t: edit_config(s, lookahead=1), [], {}),
    ("coverage", lambda s, t: s.edit_json("sampler", lambda d: d.update(retired=[])), [], {}),
    ("census", lambda s, t: s.edit_json("replay_index", move_to_step_2), [], {}),
    ("fingerprints_uniform", lambda s, t: s.edit_json("replay_index", unfingerprint), [], {}),
    ("trainer_state", lambda s, t: edit_trainer_meta(s), [], {}),
    (
        "policy_identity",
        lambda s, t: None,
        None,  # type: ignore[list-item]
        {"expect": v.Expectations(policy=v.PolicyExpectation({"base": "b" * 64, "rank": 16, "alpha": 32.0}))},
    ),
    (
        "loader_position",
        lambda s, t: s.edit_json("loader", lambda d: d.update(_num_yielded=d["_num_yielded"] + 1)),
        [],
        {},
    ),
    ("dataset_size", lambda s, t: None, ["--dataset", "builtin:arithmetic?size=99"], {"dataset": "size99"}),
    ("loader_rows", lambda s, t: s.edit_json("ledger", other_row), [], {}),
    ("prompt_rebuild", lambda s, t: None, ["--dataset", "@reordered"], {"dataset": "reordered"}),
    ("prompt_fingerprint", lambda s, t: None, ["--dataset", "@edited"], {"dataset": "edited"}),
    ("rollout_prompt_tokens", lambda s, t: foreign_prompt_tokens(s), None, {}),  # type: ignore[list-item]
]


def test_every_check_has_a_case() -> None:
    """A delta cut's checks have theirs in test_delta_validation.py."""
    assert [c for c, *_ in CASES] == [c for c in v.CHECKS if c not in v.DELTA_CHECKS | {"redo_fingerprint"}]


def _dataset(name: str | None, tmp_path: Path) -> PromptDataset:
    if name == "size99":
        return ArithmeticDataset(size=99)
    if name == "reordered":
        return JsonlDataset.open(swapped_dataset(tmp_path))
    if name == "edited":
        return JsonlDataset.open(edited_dataset(tmp_path))
    return DATASET


@pytest.mark.parametrize(("check", "breaker", "verify_args", "restore_kw"), CASES, ids=[c for c, *_ in CASES])
def test_a_broken_cut_is_refused_with_the_named_check(
    check: str,
    breaker: Breaker,
    verify_args: list[str] | None,
    restore_kw: dict[str, Any],
    cut_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    surgery = CutSurgery.only_cut(cut_root)
    breaker(surgery, tmp_path)
    error = next(e for e in v.ERRORS if e.check == check)

    dataset = _dataset(restore_kw.get("dataset"), tmp_path)
    with pytest.raises(error) as info:
        restore_cut(
            LocalStorage(cut_root),
            dataset=dataset,
            collate=PromptCollate(),
            source=loader_for(EXAMPLE_B, dataset),
            cut_id=surgery.cut.name,
            expect=restore_kw.get("expect"),
            encode=encode,
        )
    assert info.value.check == check
    assert f"[{check}]" in str(info.value)
    assert surgery.cut.name in str(info.value), "the error names the cut (and file)"

    if verify_args is None:
        return  # the job's settings are not something `verify` is given
    args = [
        {"@reordered": swapped_dataset(tmp_path), "@edited": edited_dataset(tmp_path)}.get(a, a) for a in verify_args
    ]
    rc = spotrl(["ckpt", "verify", str(surgery.cut), *args])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"FAILED check {check}:" in err


def test_the_unbroken_cut_passes_every_check(cut_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotrl(["ckpt", "verify", str(cut_root), "--job", "default/scenario", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is True
    # Verify has no tokenizer: rollout_prompt_tokens is restore's.
    skipped = {"config_compatible", "policy_identity", "rollout_prompt_tokens", "redo_fingerprint", *v.DELTA_CHECKS}
    assert out["checks"] == [c for c in v.CHECKS if c not in skipped]
    restored = restore_cut(
        LocalStorage(cut_root),
        dataset=DATASET,
        collate=PromptCollate(),
        source=loader_for(EXAMPLE_B, DATASET),
        expect=v.Expectations(job="default/scenario", config=EXAMPLE_B, dataset=dataset_description(DATASET)),
        encode=encode,
    )
    assert restored.owners.counters.rollouts_reused == 1


def test_a_torn_cut_does_not_exist_and_restore_uses_the_previous_one(tmp_path: Path) -> None:
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    first = run.cut()
    second = run.cut()
    (root / "cuts" / second.cut_id / "manifest.json").unlink()  # as if the writer died before committing
    restored = restore_cut(
        LocalStorage(root), dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET)
    )
    assert restored.cut_id == first.cut_id


@pytest.mark.slow
def test_verify_via_the_installed_command(cut_root: Path) -> None:
    break_flip_byte(CutSurgery.only_cut(cut_root))
    spotrl_bin = Path(sys.executable).with_name("spotrl")
    proc = subprocess.run([str(spotrl_bin), "ckpt", "verify", str(cut_root)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "FAILED check file_digest" in proc.stderr
    assert "trainer/weights-00001-of-00001.pt" in proc.stderr


@pytest.mark.s3
def test_verify_an_s3_cut(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k, val in s3_bucket.env().items():
        monkeypatch.setenv(k, val)
    uri = f"s3://{s3_bucket.bucket}/jobs/b"
    run = example_b_before_cut(open_storage(uri))
    cut = run.cut()
    assert spotrl(["ckpt", "verify", uri]) == 0
    # Overwrite the ledger with other (valid JSON) content: a stale file.
    key = f"jobs/b/cuts/{cut.cut_id}/{cut.manifest.file('ledger').path}"  # type: ignore[union-attr]
    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key=key, Body=b'{"records": []}')
    capsys.readouterr()
    assert spotrl(["ckpt", "verify", f"{uri}/cuts/{cut.cut_id}"]) == 1
    assert "FAILED check file_size" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["weights", "optimizer", "rng"])
def test_an_unreadable_trainer_file_is_check_trainer_state_not_a_torch_error(cut_root: Path, role: str) -> None:
    surgery = CutSurgery.only_cut(cut_root)
    surgery.replace(role, b"not a torch file, but its digest and size match")
    with pytest.raises(v.TrainerStateError) as info:
        restore_cut(
            LocalStorage(cut_root),
            dataset=DATASET,
            collate=PromptCollate(),
            source=loader_for(EXAMPLE_B, DATASET),
        )
    assert info.value.check == "trainer_state"
    assert "do not load as torch.save/v2" in str(info.value)


def test_a_trainer_format_without_its_files_is_check_trainer_state(cut_root: Path) -> None:
    surgery = CutSurgery.only_cut(cut_root)
    weights = surgery.path("weights")
    surgery.m["files"] = [f for f in surgery.m["files"] if f["role"] != "weights"]
    weights.unlink()
    surgery.save_manifest()
    with pytest.raises(v.TrainerStateError, match="needs a weights file"):
        restore_cut(
            LocalStorage(cut_root), dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET)
        )


@pytest.fixture
def parted_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed cut whose weights (example B's weight and bias) are two parts."""
    monkeypatch.setattr(trainer_state, "WEIGHT_PART_BYTES", 8)
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.cut()
    names = [f["path"].split("/", 1)[1] for f in CutSurgery.only_cut(root).m["files"] if f["role"] == "weights"]
    assert names == ["trainer/weights-00001-of-00002.pt", "trainer/weights-00002-of-00002.pt"]
    return root


def restore_b(root: Path) -> Any:
    return restore_cut(
        LocalStorage(root), dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET)
    )


def test_weights_in_two_parts_restore_exactly(parted_root: Path) -> None:
    restored = restore_b(parted_root)
    again = example_b_before_cut(None)
    assert restored.trainer is not None
    assert restored.trainer.weights.keys() == again.model.state_dict().keys()
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(restored.trainer.weights[name], tensor), name


def weights_entries(s: CutSurgery) -> list[dict[str, Any]]:
    return [f for f in s.m["files"] if f["role"] == "weights"]


def lose_second_part(s: CutSurgery) -> None:
    second = weights_entries(s)[1]
    s.m["files"].remove(second)
    (s.cut / second["path"]).unlink()


def add_a_third_part(s: CutSurgery) -> None:
    extra = dict(weights_entries(s)[1])
    extra["path"] = extra["path"].replace("weights-00002-of-00002.pt", "weights-00003-of-00002.pt")
    shutil.copy(s.cut / weights_entries(s)[1]["path"], s.cut / extra["path"])
    s.m["files"].append(extra)


def rename_second_part(s: CutSurgery) -> None:
    second = weights_entries(s)[1]
    old = s.cut / second["path"]
    second["path"] = second["path"].replace("weights-00002-of-00002.pt", "weights.pt")
    old.rename(s.cut / second["path"])


def count_parts_differently(s: CutSurgery) -> None:
    second = weights_entries(s)[1]
    old = s.cut / second["path"]
    second["path"] = second["path"].replace("weights-00002-of-00002.pt", "weights-00002-of-00003.pt")
    old.rename(s.cut / second["path"])


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        (lose_second_part, "parts listed are 1-of-2:"),
        (add_a_third_part, "parts listed are 1-of-2, 2-of-2, 3-of-2"),
        (rename_second_part, "is named trainer/weights-<i>-of-<n>.pt"),
        (count_parts_differently, "parts listed are 1-of-2, 2-of-3"),
    ],
)
def test_a_cut_that_lost_or_gained_a_weights_part_is_check_trainer_state(
    parted_root: Path, forge: Callable[[CutSurgery], None], says: str
) -> None:
    """Every file left matches its size and digest: only the parts' names and count can tell."""
    surgery = CutSurgery.only_cut(parted_root)
    forge(surgery)
    surgery.save_manifest()
    with pytest.raises(v.TrainerStateError, match=says) as info:
        restore_b(parted_root)
    assert info.value.check == "trainer_state"
    proc = subprocess.run(
        [sys.executable, "-m", "spotrl_runtime.cli", "ckpt", "verify", str(parted_root)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "FAILED check trainer_state" in proc.stderr


def test_two_parts_holding_one_tensor_do_not_load(parted_root: Path) -> None:
    """Consistent names, sizes and digests, but the second part holds the first's tensor too:
    merging would let one silently win."""
    surgery = CutSurgery.only_cut(parted_root)
    first, second = (surgery.cut / f["path"] for f in weights_entries(surgery))
    both = {**torch.load(first, weights_only=True), **torch.load(second, weights_only=True)}
    buf = io.BytesIO()
    torch.save(both, buf)
    entry = weights_entries(surgery)[1]
    second.write_bytes(buf.getvalue())
    entry.update(size=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    surgery.save_manifest()
    with pytest.raises(v.TrainerStateError, match="which an earlier weights file holds too") as info:
        restore_b(parted_root)
    assert info.value.check == "trainer_state"


class WritesTorchSaveV1(TorchSaveFormat):
    """What cuts were before ``torch.save/v2``: the weights in one ``trainer/weights.pt``."""

    name = "torch.save/v1"

    def files(self, snapshot: TrainerSnapshot) -> list[TrainerFile]:
        rest = [f for f in super().files(snapshot) if f.role != "weights"]
        weights = dict(snapshot.weights)
        return [TrainerFile("trainer/weights.pt", "weights", lambda f: torch.save(weights, f)), *rest]


def test_a_torch_save_v1_cut_still_restores(tmp_path: Path) -> None:
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    assert run.writer is not None
    run.writer.trainer_format = WritesTorchSaveV1()
    cut = run.cut()
    assert cut.manifest.trainer_format == "torch.save/v1"
    assert [f.path.split("/", 1)[1] for f in cut.manifest.files if f.role == "weights"] == ["trainer/weights.pt"]
    assert spotrl(["ckpt", "verify", str(root)]) == 0
    restored = restore_b(root)
    assert restored.trainer is not None
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(restored.trainer.weights[name], tensor), name
