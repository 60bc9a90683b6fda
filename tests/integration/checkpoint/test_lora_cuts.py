"""A LoRA run's cut records its adapter's identity (the base's digest, rank, alpha, targets), and a
resume onto anything else is refused by check ``policy_identity``. Each forgery is consistent in
every way but one: the trainer's meta.json is edited and the manifest's digest made to match."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import DATASET, EXAMPLE_B, example_b_before_cut, loader_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.checkpoint import restore_cut
from spotrl_runtime.core import validation as v
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage

ADAPTER = {"base": "b" * 64, "rank": 16, "alpha": 32.0, "targets": ["down_proj", "q_proj", "v_proj"]}


@pytest.fixture
def lora_cut(tmp_path: Path) -> Path:
    """Worked example B's cut, its trainer state recorded as a LoRA adapter's."""
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.cut()
    set_adapter(CutSurgery.only_cut(root), ADAPTER)
    return root


def set_adapter(s: CutSurgery, adapter: dict[str, Any] | None) -> None:
    meta = json.loads(s.path("trainer_meta").read_bytes())
    meta.pop("adapter", None)
    if adapter is not None:
        meta["adapter"] = adapter
    s.replace("trainer_meta", json.dumps(meta).encode())


def restore(root: Path, adapter: dict[str, Any] | None, job: str | None = None) -> Any:
    return restore_cut(
        LocalStorage(root),
        dataset=DATASET,
        collate=PromptCollate(),
        source=loader_for(EXAMPLE_B, DATASET),
        expect=v.Expectations(job=job, policy=v.PolicyExpectation(adapter)),
    )


def test_the_same_adapter_resumes(lora_cut: Path) -> None:
    restored = restore(lora_cut, dict(ADAPTER))
    assert restored.trainer is not None
    assert restored.trainer.meta["adapter"] == ADAPTER


FORGERIES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("another base", lambda a: a.update(base="c" * 64), "base"),
    ("another rank", lambda a: a.update(rank=8), "rank 16.*policy.lora.rank gives 8"),
    ("another alpha", lambda a: a.update(alpha=16.0), "alpha"),
    ("fewer targets", lambda a: a.update(targets=["q_proj", "v_proj"]), "targetModules"),
]


@pytest.mark.parametrize(("what", "change", "says"), FORGERIES, ids=[f[0] for f in FORGERIES])
def test_a_job_of_another_adapter_is_refused_by_name(
    lora_cut: Path, what: str, change: Callable[[dict[str, Any]], None], says: str
) -> None:
    wanted = dict(ADAPTER)
    change(wanted)
    with pytest.raises(v.PolicyIdentityError, match=says) as info:
        restore(lora_cut, wanted)
    assert info.value.check == "policy_identity"
    assert "trainer/meta.json" in str(info.value)


def test_an_adapter_cut_for_a_full_weight_job_and_the_reverse_are_refused(lora_cut: Path) -> None:
    with pytest.raises(v.PolicyIdentityError, match="holds a LoRA adapter, but the job trains every weight"):
        restore(lora_cut, None)
    set_adapter(CutSurgery.only_cut(lora_cut), None)
    with pytest.raises(v.PolicyIdentityError, match=r"holds every weight.*trains a LoRA adapter"):
        restore(lora_cut, dict(ADAPTER))
    assert restore(lora_cut, None).trainer is not None


def test_a_forged_identity_that_is_not_an_object_is_refused(lora_cut: Path) -> None:
    set_adapter(CutSurgery.only_cut(lora_cut), "rank 16")  # type: ignore[arg-type]
    with pytest.raises(v.PolicyIdentityError, match="not an object"):
        restore(lora_cut, dict(ADAPTER))


def test_an_adapter_of_another_job_is_refused_by_the_jobs_identity(lora_cut: Path) -> None:
    with pytest.raises(v.ForeignCutError, match="belongs to job"):
        restore(lora_cut, dict(ADAPTER), job="default/another")
