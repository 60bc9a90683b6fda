"""A job whose reward reads the process environment, with the chart's default credentials
Secret (in every runtime pod, by envFrom), on the test control plane: the real operator, API
server and node agent, and the real `spotrl controller` in the controller pod. The reward's
process holds the job's runtimeEnv and no key; the reward scores without it; neither a key nor
what the reward returned reaches a log, the audit, the cuts, an Event, the job's status or the
operator's metrics. A job whose importPath the admin's prefixes do not allow fails, saying so."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from operator_harness import NOWHERE, TARGET, Jobs, JobStorage, OperatorProcess, render_chart, tiny_job

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.reward_probe import RAISED, RETURNED, write_probe
from spotrl_operator.settings import add_arguments, from_args

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(TARGET == "kind", reason="the reward module lives on the test machine, not in an image"),
]

GROUP = 4


def _reward_job(name: str, import_path: str, storage: JobStorage, **spec: object) -> dict:
    job = tiny_job(
        name,
        training={"totalSteps": 3},
        generation={"groupSize": GROUP},
        checkpoint={"storage": storage.uri(name), "s3Endpoint": storage.pod_endpoint, "everySteps": 3},
        **spec,
    )
    job["spec"]["reward"] = {"importPath": import_path}
    return job


def _objects(storage: JobStorage, prefix: str) -> dict[str, bytes]:
    client = storage.client()
    return {k: client.get_object(Bucket=storage.bucket, Key=k)["Body"].read() for k in storage.keys(prefix)}


def test_the_reward_finds_no_key_of_the_charts_default_secret_and_leaks_nothing_it_read(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    e2e_storage: JobStorage,
    tmp_path: Path,
) -> None:
    code, seen, files = tmp_path / "code", tmp_path / "seen", tmp_path / "files"
    (code / "spotrl_rewards").mkdir(parents=True)
    (code / "spotrl_rewards" / "__init__.py").write_text("")
    write_probe(code / "spotrl_rewards" / "probe.py", files)  # under the chart's default prefixes
    seen.mkdir()
    keys = [e2e_storage.access_key, e2e_storage.secret_key]
    cluster.admin().create(f"/api/v1/namespaces/{namespace}/secrets", e2e_storage.secret("shared-s3"))
    operator = start_operator(args=("--default-credentials-secret", "shared-s3"))
    env = [{"name": "PYTHONPATH", "value": str(code)}, {"name": "PROBE_OUT", "value": str(seen)}]
    jobs.create(
        _reward_job(
            "probe",
            "spotrl_rewards.probe:score",
            e2e_storage,
            runtimeEnv=[*env, {"name": "PROBE_FILES", "value": str(files)}],
        )
    )
    refused = _reward_job("refused", "probe:leaks", e2e_storage, scheduling={"nodeSelector": NOWHERE})
    jobs.create(refused)

    st = jobs.wait("refused", lambda s: s.get("phase") == "Failed", 30, "the refused job to fail")
    (failed,) = [c for c in st["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "InvalidConfiguration"
    assert failed["message"].startswith("spec.reward.importPath 'probe:leaks': module 'probe' is not allowed")
    assert "rewards.allowedImportPrefixes" in failed["message"]
    assert jobs.pods("refused") == [], "no pod imports it"

    st = jobs.wait("probe", lambda s: s.get("phase") in ("Succeeded", "Failed"), 300, "the probe job to finish")
    assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
    controller = next(p for p in jobs.pods("probe") if p["metadata"]["labels"]["spotrl.dev/role"] == "controller")
    (c,) = controller["spec"]["containers"]
    assert c["envFrom"] == [{"secretRef": {"name": "shared-s3"}}], "the controller holds the default Secret's keys"

    environs = [p.read_bytes() for p in seen.glob("*.environ")]
    assert environs, "the reward ran"
    for raw in environs:
        names = {kv.split(b"=", 1)[0].decode() for kv in raw.split(b"\0") if kv}
        assert {"PATH", "HOME", "PYTHONPATH", "PROBE_OUT", "PROBE_FILES"} <= names
        assert not {n for n in names if n.startswith(("AWS_", "SPOTRL_", "KUBERNETES_")) or n == "KUBECONFIG"}
        assert not any(k.encode() in raw for k in keys)

    stored = _objects(e2e_storage, "probe/")
    records = [json.loads(v) for k, v in stored.items() if "/audit/" in k and k.endswith(".json")]
    assert sorted(r["step"] for r in records) == [0, 1, 2]
    for r in records:
        failing = sum(1 for i in r["idxs"] if i % 4 in (1, 2))
        assert r["reward_errors"] == GROUP * failing, "the reward scored every other row, without the keys"

    pod_logs = "\n".join(
        p.read_text(errors="replace") for p in (cluster.workdir / "nodes" / "pods").glob(f"{namespace}_*/logs/*.log")
    )
    assert "'spotrl_rewards.probe:score' raised PermissionError" in pod_logs
    shown = {
        "the pods' logs": pod_logs,
        "the operator's log": operator.log(),
        "the job and its status": json.dumps(jobs.get("probe")),
        "the namespace's Events": json.dumps(cluster.admin().get(f"/api/v1/namespaces/{namespace}/events")),
        "the operator's metrics": json.dumps(operator.metrics()),
        "the audit and the cuts": b"\n".join(stored.values()).decode(errors="replace"),
    }
    for where, text in shown.items():
        for secret in (*keys, RETURNED):
            assert secret not in text, f"{secret!r} in {where}"
        if where != "the pods' logs":
            assert RAISED not in text, where
    assert all(line.startswith("PermissionError: ") for line in pod_logs.splitlines() if RAISED in line), (
        "the exception's message: only the reward's own traceback, in its pod's log"
    )


def test_the_charts_allowed_import_prefixes_reach_the_operators_settings(cluster: Cluster, namespace: str) -> None:
    def prefixes(*sets: str) -> tuple[str, ...]:
        (deploy,) = render_chart(cluster, namespace, *sets, only=("templates/deployment.yaml",))
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        return from_args(parser.parse_args(container["args"])).reward_import_prefixes

    assert prefixes() == ("spotrl_runtime.rewards", "spotrl_rewards"), "the built-ins and the image's own package"
    assert prefixes("rewards.allowedImportPrefixes={team_a.rewards,spotrl_runtime.rewards}") == (
        "team_a.rewards",
        "spotrl_runtime.rewards",
    )
    assert prefixes("rewards.allowedImportPrefixes={}") == (), "none: built-in rewards by name only"
