"""A run whose reward reads the process environment, with the storage's keys in the controller's
(as the chart's default credentials Secret puts them in every runtime pod, by envFrom): the
reward's process holds the job's runtimeEnv and no key, the reward scores without them, and
what the reward returns or raises reaches no controller log line, audit record or cut."""

from __future__ import annotations

import json
import re
from pathlib import Path

from controller_runs import Runs

from spotrl_e2e.reward_probe import RAISED, RETURNED, write_probe

KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIA-key-id-7f3b91",
    "AWS_SECRET_ACCESS_KEY": "storage-secret-0c9e4a",
    "AWS_SESSION_TOKEN": "session-token-5d21",
}
ALLOWED = {
    *("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED"),
    *("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"),
}


def _files_text(root: Path) -> str:
    return "\n".join(p.read_bytes().decode(errors="replace") for p in sorted(root.rglob("*")) if p.is_file())


def test_the_reward_scores_without_the_storage_keys_and_leaks_nothing_it_read(runs: Runs, tmp_path: Path) -> None:
    code, seen, files = tmp_path / "code", tmp_path / "seen", tmp_path / "files"
    for d in (code, seen, files):
        d.mkdir()
    write_probe(code / "probe_reward.py", files)
    job = runs.job(
        {
            "reward": {"importPath": "probe_reward:score", "workers": 2},  # every process of a pool alike
            "training.totalSteps": 2,
            "runtimeEnv": [{"name": "PROBE_OUT", "value": "set in the shell of a local run"}],
        }
    )
    storage = tmp_path / "cuts"
    # PROBE_FILES as the chart's runtimeEnv is named by the operator; the import allow-list as it sets it.
    env = {
        **KEYS,
        "PYTHONPATH": str(code),
        "PROBE_OUT": str(seen),
        "PROBE_FILES": str(files),
        "NOT_NAMED_BY_THE_JOB": "x",
        "SPOTRL_REWARD_ENV_NAMES": "PROBE_FILES",
        "SPOTRL_REWARD_IMPORT_PREFIXES": "spotrl_runtime.rewards,probe_reward",
    }
    rc, log = runs.run(job, storage, **env)
    assert rc == 0, log

    environs = [p.read_bytes() for p in seen.glob("*.environ")]
    assert len(environs) >= 2, "the reward ran, in both processes of its pool"
    for raw in environs:
        names = {kv.split(b"=", 1)[0].decode() for kv in raw.split(b"\0") if kv}
        assert {"PATH", "PYTHONPATH", "PROBE_OUT", "PROBE_FILES"} <= names
        assert {n for n in names if not n.startswith("LC_")} <= ALLOWED | {"PROBE_OUT", "PROBE_FILES"}, names
        assert not any(k.encode() in raw for k in KEYS.values())

    records = [json.loads(p.read_text()) for p in sorted((storage / "audit").glob("step-*/attempt-*.json"))]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        failing = sum(1 for i in r["idxs"] if i % 4 in (1, 2))
        assert failing, r["idxs"]
        assert r["reward_errors"] == 8 * failing, "only the rows that return or raise what they read fail"
    assert "returned a str, not a number; it must return a float" in log
    assert "'probe_reward:score' raised PermissionError" in log

    stored = _files_text(storage)
    for secret in (*KEYS.values(), RETURNED):
        assert secret not in log
        assert secret not in stored
    assert RAISED not in stored
    outside_tracebacks = [
        line for line in log.splitlines() if RAISED in line and not line.startswith("PermissionError:")
    ]
    assert not outside_tracebacks, "the exception's message: only the reward's own traceback, for its author"
    assert re.search(rf"PermissionError: cannot use {RAISED}", log)


def test_the_runtime_refuses_a_module_the_admins_prefixes_do_not_allow_before_importing_it(
    runs: Runs, tmp_path: Path
) -> None:
    """The operator refuses such a job first; the controller checks again (an older operator,
    a pod made by hand), naming the field, the prefixes and who to ask."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "imported_here.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef score(prompt, completion):\n    return 1.0\n"
    )
    job = runs.job({"reward": {"importPath": "imported_here:score"}, "training.totalSteps": 1})
    env = {"PYTHONPATH": str(code), "SPOTRL_REWARD_IMPORT_PREFIXES": "spotrl_runtime.rewards,spotrl_rewards"}
    rc, log = runs.run(job, tmp_path / "cuts", **env)
    assert rc == 1, log
    assert log.strip().splitlines()[-1] == (
        "spotrl: spec.reward.importPath 'imported_here:score': module 'imported_here' is not allowed on this cluster "
        "(allowed module prefixes: spotrl_runtime.rewards, spotrl_rewards); put the reward in a package under one "
        "of them, or ask the cluster's admin to add its prefix to the chart value rewards.allowedImportPrefixes"
    )
    assert not (tmp_path / "imported").exists(), "no process imported it"
