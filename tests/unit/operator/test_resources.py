"""The objects the operator creates: deterministic names, owner references, least privilege."""

from __future__ import annotations

import pytest

from spotrl_operator import resources
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings
from spotrl_runtime.api.rljob import parse_spec

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
        resources.service_account(REF),
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


def test_the_controller_pod() -> None:
    pod = resources.controller_pod(REF, SPEC, SETTINGS, 3, avoid_nodes=["spot-b", "spot-a"])
    spec = pod["spec"]
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
    assert c["resources"] == {"requests": {"cpu": "2", "nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    assert spec["serviceAccountName"] == "tiny-runtime"
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 45
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["spot-a", "spot-b"]}]}]
    assert pod["metadata"]["labels"]["spotrl.dev/attempt"] == "3"


def test_no_storage_is_an_error_naming_the_field_and_the_chart_value() -> None:
    with pytest.raises(ValueError, match=r"spec\.checkpoint\.storage.*storage\.default"):
        resources.storage_uri(REF, SPEC, Settings())
