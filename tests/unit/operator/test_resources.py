"""The objects the operator creates: deterministic names, owner references, least privilege."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from spotrl_operator import resources
from spotrl_operator.observe import job_ref
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings, add_arguments, from_args
from spotrl_runtime.api.rljob import RLJobSpec, parse_spec

REF = JobRef("tiny", "team-a", "uid-1")
SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 10, "resources": {"cpu": "2", "gpu": 1}},
        "checkpoint": {"credentialsSecret": "s3-keys"},
        "scheduling": {"terminationGracePeriodSeconds": 45},
    }
)
SETTINGS = Settings(default_storage="s3://bucket/spotrl/", default_s3_endpoint="http://s3:9000")


def test_every_object_is_owned_by_the_rljob() -> None:
    objs = [
        resources.service_account(REF, SETTINGS),
        resources.role(REF),
        resources.role_binding(REF),
        resources.service(REF),
        resources.disruption_budget(REF, open_=False),
        resources.controller_pod(REF, SPEC, SETTINGS, 3),
    ]
    for obj in objs:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("RLJob", "tiny", "uid-1", True)
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["spotrl.dev/job"] == "tiny"
    assert [o["metadata"]["name"] for o in objs] == [
        "tiny-runtime",
        "tiny-runtime",
        "tiny-runtime",
        "tiny",
        "tiny-controller",
        "tiny-controller-3",
    ]


def test_the_runtime_role_reads_its_own_rljob_and_patches_its_status_only() -> None:
    rules = resources.role(REF)["rules"]
    assert rules == [
        {
            "apiGroups": ["spotrl.dev"],
            "resources": ["rljobs"],
            "resourceNames": ["tiny"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["spotrl.dev"],
            "resources": ["rljobs/status"],
            "resourceNames": ["tiny"],
            "verbs": ["get", "patch"],
        },
    ]


def test_the_budget_uses_an_integer_min_available() -> None:
    assert resources.disruption_budget(REF, open_=False)["spec"]["minAvailable"] == 1
    assert resources.disruption_budget(REF, open_=True)["spec"]["minAvailable"] == 0
    assert "maxUnavailable" not in resources.disruption_budget(REF, open_=True)["spec"]


def test_the_budget_holds_the_trainer_pods_with_the_controller() -> None:
    """A trainer rank lost is a preemption: closed, the budget holds every one of them (an
    integer minAvailable of 1 over three pods would let two go)."""
    closed = resources.disruption_budget(REF, open_=False, trainers=2)["spec"]
    assert closed["minAvailable"] == 3
    assert closed["selector"] == {
        "matchLabels": {"spotrl.dev/job": "tiny"},
        "matchExpressions": [
            {"key": "spotrl.dev/role", "operator": "In", "values": ["controller", "trainer"]},
            {"key": "spotrl.dev/standby", "operator": "DoesNotExist"},
        ],
    }
    assert resources.disruption_budget(REF, open_=True, trainers=2)["spec"]["minAvailable"] == 0
    assert resources.budget_trainers(TRAINER_SPEC) == 2
    assert resources.budget_trainers(SPEC) == 0
    ranks_in_controller = parse_spec(
        {
            **TRAINER_SPEC.model_dump(by_alias=True, exclude_none=True),
            "training": {"totalSteps": 10, "parallelism": {"strategy": "fsdp", "ranks": 2}},
        }
    )
    assert resources.budget_trainers(ranks_in_controller) == 0


def test_the_controller_pod() -> None:
    pod = resources.controller_pod(REF, SPEC, SETTINGS, 3, avoid_nodes=["spot-b", "spot-a"])
    spec = pod["spec"]
    assert spec["enableServiceLinks"] is False  # no SPOTRL_*_PORT=tcp://... from Services
    (c,) = spec["containers"]
    assert c["command"] == ["spotrl", "controller"]
    assert c["args"] == ["--resume", "auto"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["SPOTRL_ATTEMPT"] == "3"
    assert env["SPOTRL_JOB"] == "tiny"
    assert env["SPOTRL_STORAGE"] == "s3://bucket/spotrl/team-a/tiny"
    assert env["AWS_ENDPOINT_URL"] == "http://s3:9000"
    assert env["SPOTRL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]
    # The job's cpu, the operator's default memory, and a memory limit equal to the request.
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "4Gi", "nvidia.com/gpu": "1"},
    }
    assert spec["serviceAccountName"] == "tiny-runtime"
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 45
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # One requirement per node: a node field selector takes exactly one value (the API server
    # refuses more; tests/cluster/test_dry_run.py sends these pods to it).
    assert terms == [
        {
            "matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": ["spot-a"]},
                {"key": "metadata.name", "operator": "NotIn", "values": ["spot-b"]},
            ]
        }
    ]
    assert pod["metadata"]["labels"]["spotrl.dev/attempt"] == "3"


def test_no_storage_is_an_error_naming_the_field_and_the_chart_value() -> None:
    with pytest.raises(ValueError, match=r"spec\.checkpoint\.storage.*storage\.default"):
        resources.storage_uri(REF, SPEC, Settings())


WORKER_SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 10, "resources": {"cpu": "4"}},
        "generation": {
            "workers": 2,
            "workerPods": True,
            "backend": "vllm",
            "resources": {"cpu": "1500m", "memory": "8Gi", "gpu": 1},
        },
        "checkpoint": {"credentialsSecret": "s3-keys", "s3Region": "eu-west-1"},
        "scheduling": {
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "batch",
        },
    }
)


def test_the_worker_pod() -> None:
    pod = resources.worker_pod(REF, WORKER_SPEC, SETTINGS, 2, 1, "127.0.1.2:40001", avoid_nodes=["spot-a"])
    meta, spec = pod["metadata"], pod["spec"]
    assert spec["enableServiceLinks"] is False
    assert meta["name"] == "tiny-worker-2-1"
    assert meta["labels"]["spotrl.dev/role"] == "worker"
    assert meta["labels"]["spotrl.dev/attempt"] == "2"
    assert meta["labels"]["spotrl.dev/worker-index"] == "1"
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RLJob", "tiny", "uid-1")
    (c,) = spec["containers"]
    assert c["command"] == ["spotrl", "worker"]
    assert c["args"] == ["--address", "127.0.1.2:40001", "--num-cpus", "2", "--num-gpus", "1"]
    assert c["resources"] == {
        "requests": {"cpu": "1500m", "memory": "8Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
    }
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["SPOTRL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["AWS_ENDPOINT_URL"] == "http://s3:9000"
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert "SPOTRL_STORAGE" not in env, "a worker writes no cuts"
    assert c["envFrom"] == [], "a worker whose policy is not on S3 gets no keys"
    on_s3 = parse_spec({**WORKER_SPEC.model_dump(by_alias=True), "policy": {"model": "s3://models/qwen"}})
    (c,) = resources.worker_pod(REF, on_s3, SETTINGS, 2, 1, "127.0.1.2:40001")["spec"]["containers"]
    assert c["envFrom"] == [{"secretRef": {"name": "s3-keys"}}], "a policy on s3:// needs the keys"
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False, "a worker needs no Kubernetes API"
    assert spec["serviceAccountName"] == "tiny-runtime", "the job's cloud identity, for a policy on S3"
    assert spec["terminationGracePeriodSeconds"] == 15
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["priorityClassName"] == "batch"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["spot-a"]}]}]
    # The PDB holds the controller only: a worker is never waited for.
    selector = resources.disruption_budget(REF, open_=False)["spec"]["selector"]["matchExpressions"]
    assert selector[0] == {"key": "spotrl.dev/role", "operator": "In", "values": ["controller"]}


TRAINER_SPEC = parse_spec(
    {
        **WORKER_SPEC.model_dump(by_alias=True, exclude_none=True),
        "generation": {"workers": 1},
        "training": {
            "totalSteps": 10,
            "parallelism": {
                "strategy": "fsdp",
                "ranks": 2,
                "gpusPerRank": 1,
                "trainerPods": True,
                "resources": {"cpu": "3500m", "memory": "20Gi", "gpu": 1},
            },
        },
    }
)


def test_the_trainer_pod() -> None:
    pod = resources.trainer_pod(REF, TRAINER_SPEC, SETTINGS, 2, 1, "127.0.1.2:40001", avoid_nodes=["spot-a"])
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-trainer-2-1"
    assert meta["labels"]["spotrl.dev/role"] == "trainer"
    assert meta["labels"]["spotrl.dev/attempt"] == "2"
    assert meta["labels"]["spotrl.dev/trainer-index"] == "1"
    assert "spotrl.dev/worker-index" not in meta["labels"]
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RLJob", "tiny", "uid-1")
    (c,) = spec["containers"]
    assert c["name"] == "trainer"
    assert c["command"] == ["spotrl", "worker"]
    assert c["args"] == ["--role", "trainer", "--address", "127.0.1.2:40001", "--num-cpus", "4", "--num-gpus", "1"]
    assert c["resources"] == {
        "requests": {"cpu": "3500m", "memory": "20Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "20Gi", "nvidia.com/gpu": "1"},
    }
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    # Its rank writes its shards of every cut: the job's storage and keys, as the controller's.
    (controller,) = resources.controller_pod(REF, TRAINER_SPEC, SETTINGS, 2)["spec"]["containers"]
    assert env["SPOTRL_STORAGE"] == "s3://bucket/spotrl/team-a/tiny"
    assert env["AWS_ENDPOINT_URL"] == "http://s3:9000"
    assert env["SPOTRL_ATTEMPT"] == "2"
    assert c["envFrom"] == controller["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]
    assert [e for e in c["env"] if e["name"] != "SPOTRL_POD_NAME"] == [
        e for e in controller["env"] if e["name"] != "SPOTRL_POD_NAME"
    ]
    assert spec["automountServiceAccountToken"] is False, "a rank needs no Kubernetes API"
    assert spec["serviceAccountName"] == "tiny-runtime", "the job's cloud identity, as the controller's"
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 15
    assert spec["nodeSelector"] == {"pool": "gpu"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["spot-a"]}]}]
    # Without requests: the controller's defaults (a rank trains as the controller would).
    plain = parse_spec(
        {
            **TRAINER_SPEC.model_dump(by_alias=True, exclude_none=True),
            "training": {"totalSteps": 10, "parallelism": {"strategy": "fsdp", "ranks": 2, "trainerPods": True}},
        }
    )
    (c,) = resources.trainer_pod(REF, plain, SETTINGS, 1, 0, "10.0.0.1:6379")["spec"]["containers"]
    assert c["args"] == ["--role", "trainer", "--address", "10.0.0.1:6379"]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}


def test_a_worker_without_requests_gets_the_defaults_and_ray_counts_what_it_sees() -> None:
    plain = parse_spec({**WORKER_SPEC.model_dump(by_alias=True), "generation": {"workerPods": True}})
    (c,) = resources.worker_pod(REF, plain, SETTINGS, 1, 0, "10.0.0.1:6379")["spec"]["containers"]
    assert c["args"] == ["--address", "10.0.0.1:6379"]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}


def qos_class(pod: dict) -> str:
    """The kubelet's QoS class of a pod (v1.PodQOSClass), from its containers' resources."""
    cs = pod["spec"]["containers"]
    if not any(c.get("resources", {}).get("requests") or c.get("resources", {}).get("limits") for c in cs):
        return "BestEffort"
    for c in cs:
        req, lim = c["resources"].get("requests", {}), c["resources"].get("limits", {})
        if any(lim.get(k) is None or lim.get(k) != req.get(k, lim.get(k)) for k in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


BARE = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "generation": {"workerPods": True},
        "training": {"totalSteps": 10},
    }
)


def test_a_job_that_sets_no_resources_gets_no_besteffort_pod() -> None:
    """BestEffort pods go first under node pressure, and the kubelet's eviction ignores the PDB."""
    settings = Settings(default_storage="s3://b/x")
    pods = [
        resources.controller_pod(REF, BARE, settings, 1),
        resources.worker_pod(REF, BARE, settings, 1, 0, "10.0.0.1:6379"),
        resources.retention_pod(REF, BARE, settings, "s3://b/x/team-a/tiny", 0),
    ]
    assert [qos_class(p) for p in pods] == ["Burstable"] * 3
    (c,) = pods[0]["spec"]["containers"]
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"] == "4Gi"
    custom = Settings(default_storage="s3://b/x", controller_requests={"cpu": "2", "memory": "12Gi"})
    (c,) = resources.controller_pod(REF, BARE, custom, 1)["spec"]["containers"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "12Gi"}, "limits": {"memory": "12Gi"}}


def test_every_runtime_pod_meets_pod_security_restricted_with_a_read_only_root() -> None:
    settings = Settings(default_storage="s3://b/x")
    pods = [
        resources.controller_pod(REF, WORKER_SPEC, settings, 1),
        resources.worker_pod(REF, WORKER_SPEC, settings, 1, 0, "10.0.0.1:6379"),
        resources.trainer_pod(REF, TRAINER_SPEC, settings, 1, 0, "10.0.0.1:6379"),
        resources.retention_pod(REF, WORKER_SPEC, settings, "s3://b/x/team-a/tiny", 0),
    ]
    for pod in pods:
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert set(volumes) == {"tmp", "home", "dshm"}
        assert all("emptyDir" in v for v in volumes.values())
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/home/spotrl", "/dev/shm"}
            assert "hostPort" not in str(c.get("ports"))


def test_the_network_policy_admits_the_jobs_pods_and_the_scrapers_metrics_port_only() -> None:
    settings = Settings(metrics_from=({"namespaceSelector": {"matchLabels": {"name": "monitoring"}}},))
    np = resources.network_policy(REF, settings)
    spec = np["spec"]
    selector = spec["podSelector"]["matchLabels"]
    assert selector == {
        "app.kubernetes.io/name": "spotrl",
        "app.kubernetes.io/instance": "tiny",
        "app.kubernetes.io/managed-by": "spotrl-operator",
    }
    assert spec["policyTypes"] == ["Ingress"]
    own, metrics = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}
    # It selects every pod of the job, the deletion pod too.
    pods = [
        resources.controller_pod(REF, WORKER_SPEC, SETTINGS, 1),
        resources.worker_pod(REF, WORKER_SPEC, SETTINGS, 1, 0, "10.0.0.1:6379"),
        resources.trainer_pod(REF, TRAINER_SPEC, SETTINGS, 1, 0, "10.0.0.1:6379"),
        resources.retention_pod(REF, WORKER_SPEC, SETTINGS, "s3://bkt/x/team-a/tiny", 0),
    ]
    for pod in pods:
        assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["name"]
    other = resources.controller_pod(JobRef("tiny-2", "team-a", "u2"), WORKER_SPEC, SETTINGS, 1)
    assert not selector.items() <= other["metadata"]["labels"].items(), "another job's pod is not its own"
    assert metrics == {
        "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": 9400}],
    }
    # /barrier and /status listen on the pod's loopback: the Service exposes /metrics only.
    assert [p["port"] for p in resources.service(REF)["spec"]["ports"]] == [9400]


@pytest.mark.parametrize(
    ("image", "allowed", "ok"),
    [
        ("ghcr.io/spotrl/spotrl-runtime:0.2.0", (), True),
        ("ghcr.io/spotrl/spotrl-runtime@sha256:abc", (), True),
        ("ghcr.io/spotrl/spotrl-runtime-evil:1", (), False),
        ("docker.io/attacker/miner:latest", (), False),
        ("registry.example.com/ml/policy:3", ("registry.example.com/ml/",), True),
        ("registry.example.com/mlx/policy:3", ("registry.example.com/ml/",), False),
        ("anything:1", ("*",), True),
    ],
)
def test_spec_scheduling_image_must_be_allowed_by_the_operator(image: str, allowed: tuple, ok: bool) -> None:
    settings = Settings(
        default_storage="s3://b/x", allowed_images=allowed, runtime_image="ghcr.io/spotrl/spotrl-runtime:0.1.0"
    )
    spec = parse_spec({**BARE.model_dump(by_alias=True, exclude_none=True), "scheduling": {"image": image}})
    if ok:
        resources.check_job(REF, spec, settings)
    else:
        with pytest.raises(ValueError, match=r"spec\.scheduling\.image .* imagePolicy\.allowedImages"):
            resources.check_job(REF, spec, settings)


def test_a_job_in_a_refused_namespace_is_refused_naming_the_namespace_and_the_chart_value() -> None:
    settings = Settings(default_storage="s3://b/x", refused_namespaces=("kube-system", "team-a"))
    with pytest.raises(ValueError, match=r"metadata\.namespace: .* namespace team-a .* allowSystemNamespaces"):
        resources.check_job(REF, SPEC, settings)
    resources.check_job(replace(REF, namespace="team-b"), SPEC, settings)


@pytest.mark.parametrize(("quantity", "cpus"), [("500m", 1), ("1", 1), ("1.5", 2), ("2000m", 2), ("3", 3)])
def test_cpu_requests_round_up_to_whole_ray_cpus(quantity: str, cpus: int) -> None:
    assert resources._ray_cpus(quantity) == cpus


@pytest.mark.parametrize(
    ("generation", "pod_gpus", "worker_pod_gpus"),
    [
        ({"backend": "vllm", "workers": 2, "resources": {"gpu": 1}}, "3", None),  # the trainer's and one each
        ({"backend": "vllm", "workers": 2, "tensorParallelSize": 2, "resources": {"gpu": 2}}, "5", None),
        ({"backend": "vllm", "workers": 2, "workerPods": True, "resources": {"gpu": 1}}, "1", "1"),
        ({"backend": "transformers", "workers": 2}, "1", None),  # they share the trainer's GPU
    ],
)
def test_the_controller_pod_requests_the_gpus_of_the_workers_it_holds(
    generation: dict, pod_gpus: str, worker_pod_gpus: str | None
) -> None:
    spec = parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 4, "resources": {"gpu": 1}},
            "generation": generation,
        }
    )
    (c,) = resources.controller_pod(REF, spec, SETTINGS, 1)["spec"]["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == pod_gpus
    assert c["resources"]["limits"]["nvidia.com/gpu"] == pod_gpus
    if worker_pod_gpus is not None:
        (w,) = resources.worker_pod(REF, spec, SETTINGS, 1, 0, "10.0.0.1:6379")["spec"]["containers"]
        assert w["resources"]["requests"]["nvidia.com/gpu"] == worker_pod_gpus


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _all_runtime_pods(spec: RLJobSpec, settings: Settings) -> list[dict]:
    return [
        resources.controller_pod(REF, spec, settings, 1),
        resources.controller_pod(REF, spec, settings, 2, standby=True),
        resources.worker_pod(REF, spec, settings, 1, 0, "127.0.1.2:40001"),
        resources.trainer_pod(REF, spec, settings, 1, 0, "127.0.1.2:40001"),
    ]


def test_consolidation_never_drains_a_runtime_pod_unless_the_operator_is_told_so() -> None:
    """Karpenter's consolidation, drift and expiry skip a node with a do-not-disrupt pod, and the
    Cluster Autoscaler's scale-down one with a pod not safe to evict: every runtime pod carries
    both by default. A spot interruption ignores them (the barrier handles it)."""
    for pod in _all_runtime_pods(SPEC, Settings(default_storage="s3://bkt/p")):
        annotations = pod["metadata"]["annotations"]
        assert annotations[resources.DO_NOT_DISRUPT] == "true", pod["metadata"]["name"]
        assert annotations[resources.SAFE_TO_EVICT] == "false", pod["metadata"]["name"]
    off = Settings(default_storage="s3://bkt/p", runtime_do_not_disrupt=False, runtime_safe_to_evict=True)
    for pod in _all_runtime_pods(SPEC, off):
        assert "annotations" not in pod["metadata"], pod["metadata"]["name"]
    retention = resources.retention_pod(REF, SPEC, Settings(), "s3://bkt/p", 0)
    assert resources.DO_NOT_DISRUPT not in retention["metadata"].get("annotations", {}), "it deletes, not trains"


def test_the_settings_pod_labels_never_replace_the_operators_own() -> None:
    settings = Settings(
        default_storage="s3://bkt/p",
        runtime_pod_labels={"azure.workload.identity/use": "true", "team": "rl"},
        runtime_pod_annotations={"example.com/cost-center": "ml", resources.DO_NOT_DISRUPT: "false"},
    )
    for pod in _all_runtime_pods(SPEC, settings):
        meta = pod["metadata"]
        assert meta["labels"]["azure.workload.identity/use"] == "true"
        assert meta["labels"]["team"] == "rl"
        assert meta["labels"]["spotrl.dev/job"] == "tiny"
        assert meta["annotations"]["example.com/cost-center"] == "ml"
        assert meta["annotations"][resources.DO_NOT_DISRUPT] == "true", "the setting, not an annotation, turns it off"
    with pytest.raises(SystemExit, match=r"--runtime-pod-label spotrl\.dev/job: .*operator.s own"):
        from_args(_parse(["--runtime-pod-label", "spotrl.dev/job=other"]))


def test_a_cloud_identity_reaches_every_pod_that_touches_s3_through_the_jobs_service_account() -> None:
    """IRSA, GKE and AKS workload identity annotate a ServiceAccount; every pod that reads or writes
    S3 runs as the job's, and without a Secret the deletion pod does too."""
    role = {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/spotrl"}
    settings = Settings(default_storage="s3://bkt/p", runtime_service_account_annotations=role)
    sa = resources.service_account(REF, settings)
    assert sa["metadata"]["annotations"] == role
    assert "annotations" not in resources.service_account(REF, Settings())["metadata"]
    keyless = parse_spec({**SPEC.model_dump(by_alias=True), "checkpoint": {"storage": "s3://bkt/p"}})
    for pod in _all_runtime_pods(keyless, settings):
        assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"]
        assert pod["spec"]["containers"][0]["envFrom"] == [], "no Secret: boto3's chain finds the role"
    retention = resources.retention_pod(REF, keyless, settings, "s3://bkt/p", 0)
    assert retention["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    with_keys = parse_spec(
        {**SPEC.model_dump(by_alias=True), "checkpoint": {"storage": "s3://bkt/p", "credentialsSecret": "keys"}}
    )
    assert "serviceAccountName" not in resources.retention_pod(REF, with_keys, settings, "s3://bkt/p", 0)["spec"]
    held = resources.retention_service_account(REF, settings)
    assert held["metadata"]["name"] == sa["metadata"]["name"], "the cloud identity is bound to the name"
    assert held["metadata"]["annotations"] == role
    assert "ownerReferences" not in held["metadata"], "a foreground deletion's collector would take it"
    assert held["metadata"]["labels"][resources.RETENTION_LABEL] == REF.name


def test_runtime_env_reaches_every_runtime_container_after_the_operators_own() -> None:
    env_spec = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
        {"name": "HF_HOME", "value": "/home/spotrl/.cache/hf"},
    ]
    spec = parse_spec({**SPEC.model_dump(by_alias=True), "runtimeEnv": env_spec})
    for pod in _all_runtime_pods(spec, Settings(default_storage="s3://bkt/p", extra_env={"A": "1"})):
        env = pod["spec"]["containers"][0]["env"]
        assert env[-2:] == env_spec, pod["metadata"]["name"]
        names = [e["name"] for e in env]
        assert names.index("A") < names.index("HF_TOKEN"), "the job's own come last, so they win"
    # The job's own replace the settings' and the operator's of the same name: a Kueue Workload
    # refuses a name twice in a container's env.
    settings = Settings(default_storage="s3://bkt/p", extra_env={"HF_HOME": "/cache/hf", "A": "1"})
    ours = [{"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"}, *env_spec]
    spec = parse_spec({**SPEC.model_dump(by_alias=True), "runtimeEnv": ours, "checkpoint": {"s3Region": "us-east-1"}})
    for pod in _all_runtime_pods(spec, settings):
        env = pod["spec"]["containers"][0]["env"]
        names = [e["name"] for e in env]
        assert len(names) == len(set(names)), (pod["metadata"]["name"], names)
        assert env[-3:] == ours
        assert {"name": "A", "value": "1"} in env


def test_a_job_keeps_the_default_secret_recorded_on_it_when_the_default_changes() -> None:
    """The default Secret a job's author was checked against at admission is recorded on the job
    (by the operator, on first sight) and stays the one its pods mount: a later default (a helm
    upgrade) reaches them only once the author takes the record off, an update the admission
    policy checks against the new default."""
    spec = parse_spec({**SPEC.model_dump(by_alias=True), "checkpoint": {"storage": "s3://bkt/p"}})
    new = Settings(default_credentials_secret="new")
    job = {"metadata": {"name": "tiny", "namespace": "team-a", "uid": "u"}}
    assert resources.default_secret_to_record(job, new) == "new"
    assert resources.default_secret_to_record(job, Settings()) == "", "none is a record too"
    recorded = {"metadata": {"annotations": {resources.DEFAULT_SECRET_ANNOTATION: ""}}}
    assert resources.default_secret_to_record(recorded, new) is None, "recorded once, never replaced"

    def mounted(recorded: str | None, job_spec: RLJobSpec = spec) -> list:
        annotations = {} if recorded is None else {resources.DEFAULT_SECRET_ANNOTATION: recorded}
        ref = job_ref({"metadata": {**job["metadata"], "annotations": annotations}})
        pods = [
            resources.controller_pod(ref, job_spec, new, 1),
            resources.trainer_pod(ref, job_spec, new, 1, 0, "127.0.1.2:40001"),
            resources.retention_pod(ref, job_spec, new, "s3://bkt/p", 0),
        ]  # the pods that get the job's keys
        return [p["spec"]["containers"][0]["envFrom"] for p in pods]

    assert mounted(None) == [[{"secretRef": {"name": "new"}}]] * 3, "not recorded yet: the settings'"
    assert mounted("old") == [[{"secretRef": {"name": "old"}}]] * 3
    assert mounted("") == [[]] * 3, "none when it was created: still none"
    named = parse_spec(
        {**SPEC.model_dump(by_alias=True), "checkpoint": {"storage": "s3://bkt/p", "credentialsSecret": "k"}}
    )
    assert mounted("old", named) == [[{"secretRef": {"name": "k"}}]] * 3, "the job's own wins"


def test_a_locked_runtime_env_name_keeps_the_admins_value_and_refuses_the_job() -> None:
    """runtimeEnvLocked: a job may not replace the admin's proxy; every other name is the job's,
    each name once (a Kueue Workload refuses a name twice)."""
    settings = from_args(
        _parse(
            [
                "--default-storage=s3://bkt/p",
                "--runtime-env=HTTPS_PROXY=http://proxy:3128",
                "--runtime-env=A=1",
                "--runtime-env-locked=HTTPS_PROXY",
                "--runtime-env-locked=HF_HUB_OFFLINE",
            ]
        )
    )
    ours = [
        {"name": "HTTPS_PROXY", "value": "http://mine:8080"},
        {"name": "A", "value": "2"},
        {"name": "HF_HUB_OFFLINE", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ]
    spec = parse_spec({**SPEC.model_dump(by_alias=True), "runtimeEnv": ours})
    with pytest.raises(ValueError, match=r"^spec\.runtimeEnv HTTPS_PROXY, HF_HUB_OFFLINE: locked .* runtimeEnvLocked"):
        resources.check_job(REF, spec, settings)
    # Pods made anyway (the retention pod of a refused job) still get the admin's value.
    for pod in [*_all_runtime_pods(spec, settings), resources.retention_pod(REF, spec, settings, "s3://bkt/p", 0)]:
        env = pod["spec"]["containers"][0]["env"]
        names = [e["name"] for e in env]
        assert len(names) == len(set(names)), (pod["metadata"]["name"], names)
        assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in env
        assert {"name": "A", "value": "2"} in env, "an unlocked name is still the job's"
        assert "HF_HUB_OFFLINE" not in names, "locked and unset by the admin: no job sets it"
    resources.check_job(REF, parse_spec({**SPEC.model_dump(by_alias=True), "runtimeEnv": ours[1:2]}), settings)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ([{"name": "SPOTRL_JOB", "value": "x"}], "operator's own"),
        ([{"name": "A"}], "exactly one of value and valueFrom"),
        ([{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}], "exactly one"),
        ([{"name": "A", "valueFrom": {}}], "exactly one of secretKeyRef and configMapKeyRef"),
        ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "runtimeEnv names must be unique"),
        ([{"name": "1A", "value": "1"}], "pattern"),
        ([{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}], "fieldRef"),
    ],
)
def test_a_bad_runtime_env_is_refused_naming_what_to_fix(env: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec({**SPEC.model_dump(by_alias=True), "runtimeEnv": env})
