"""`spotrl eval`: a policy scored on held-out rows with the job's prompt format and reward.
Greedy means greedy (the same completions as transformers' own greedy decoding), a reward
that fails is counted as failed and never as 0, and bad flags are refused by name."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data import ArithmeticDataset
from spotrl_runtime.models import load_policy
from spotrl_runtime.rewards.builtin import arithmetic_exact
from spotrl_runtime.vllm_build import vllm_build

ROWS = 24


def _job(tmp_path: Path, reward: dict[str, Any] | None = None) -> tuple[Path, Path]:
    data = tmp_path / "held-out.jsonl"
    rows = [ArithmeticDataset(size=ROWS, seed=5)[i] for i in range(ROWS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": reward or {"name": "arithmetic_exact"},
            "generation": {"groupSize": 8, "promptsPerStep": 16, "maxNewTokens": 8},
            "training": {"totalSteps": 4},
        },
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return job, data


def _eval(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    rc = spotrl(["eval", *args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if rc in (0, 1) else out


def test_greedy_is_transformers_greedy_and_scored_by_the_jobs_reward(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, data = _job(tmp_path)
    rc, result = _eval(capsys, "-f", str(job), "--dataset", str(data))
    assert rc == 0
    assert (result["prompts"], result["completions"], result["reward_failed"]) == (ROWS, ROWS, 0)

    model, tok = load_policy("builtin:tiny-arith")
    correct = 0
    texts = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        texts.append(text)
        correct += int(arithmetic_exact(Prompt(idx=0, task_name=row["task_name"], text="", answer=row["answer"]), text))
    assert result["accuracy"] == correct / ROWS
    assert [e["completion"] for e in result["examples"]] == texts[: len(result["examples"])]
    assert 0 < correct < ROWS, "the demo policy knows some sums and not others"

    rc, again = _eval(capsys, "-f", str(job), "--dataset", str(data), "--samples", "4", "--temperature", "1.0")
    assert rc == 0
    assert again["completions"] == 4 * ROWS
    rc, same = _eval(capsys, "-f", str(job), "--dataset", str(data), "--samples", "4", "--temperature", "1.0")
    assert same == again, "sampled evaluation is seeded per row"


@pytest.mark.skipif(
    vllm_build() == "cuda" or platform.machine() != "x86_64", reason="vLLM's CPU build is for x86-64 machines"
)
def test_the_vllm_backend_scores_what_transformers_greedy_scores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a process of its own, as a user runs it: vLLM's logs must leave stdout to the JSON."""
    job, data = _job(tmp_path)
    rc, want = _eval(capsys, "-f", str(job), "--dataset", str(data), "--limit", "12")
    assert rc == 0
    args = ["eval", "-f", str(job), "--dataset", str(data), "--limit", "12", "--backend", "vllm", "--json"]
    out = subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert (got["prompts"], got["completions"]) == (12, 12)
    assert got["accuracy"] == want["accuracy"]
    assert [e["completion"] for e in got["examples"]] == [e["completion"] for e in want["examples"]]


def test_a_reward_that_fails_is_counted_as_failed_never_as_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code = tmp_path / "rewards"
    code.mkdir()
    (code / "picky.py").write_text(
        "def score(prompt, completion):\n"
        "    if prompt.idx % 4 == 1:\n"
        "        raise ValueError(f'cannot score row {prompt.idx}')\n"
        "    return 1.0\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(code))
    monkeypatch.syspath_prepend(str(code))
    job, data = _job(tmp_path, {"importPath": "picky:score"})
    rc, result = _eval(capsys, "-f", str(job), "--dataset", str(data))
    assert rc == 1, "a failed reward is the exit code"
    assert result["reward_failed"] == ROWS // 4
    assert result["reward_mean"] == 1.0, "the failures are not averaged in as zeros"
    assert result["accuracy"] == (ROWS - ROWS // 4) / ROWS


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--samples", "0"], "--samples"),
        (["--temperature", "0"], "--temperature"),
        (["--dataset", "/nonexistent/rows.parquet"], "rows.parquet"),
        (["--model", "builtin:nope"], "builtin:nope"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_flags_are_refused_by_name(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, _ = _job(tmp_path)
    try:
        rc = spotrl(["eval", "-f", str(job), *args])
    except SystemExit as exit_:  # argparse's own refusal
        rc = exit_.code
    assert rc == 2
    err = capsys.readouterr().err
    assert named in err, err
