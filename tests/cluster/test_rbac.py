"""A pod's service account can do exactly what its Role allows, checked from inside the pod
with the token the node agent got for it through the TokenRequest API."""

import json

import pytest

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.manifests import python_pod

pytestmark = pytest.mark.cluster
FINISHED = ("Succeeded", "Failed")

# Runs in the pod with the official client, loading what the node gave the pod (KUBECONFIG).
PROBE = """
import json, pathlib, sys
from kubernetes import client, config
from kubernetes.client.rest import ApiException
config.load_config()
core = client.CoreV1Api()
ns = pathlib.Path(sys.argv[2], "namespace").read_text()
def attempt(fn):
    try:
        fn()
        return 200
    except ApiException as e:
        return e.status
cm = {"metadata": {"name": "written-by-pod"}, "data": {"k": "v"}}
out = {
    "list pods here": attempt(lambda: core.list_namespaced_pod(ns)),
    "get configmap here": attempt(lambda: core.read_namespaced_config_map("kube-root-ca.crt", ns)),
    "create configmap here": attempt(lambda: core.create_namespaced_config_map(ns, cm)),
    "list secrets here": attempt(lambda: core.list_namespaced_secret(ns)),
    "delete pods here": attempt(lambda: core.delete_collection_namespaced_pod(ns)),
    "list pods in default": attempt(lambda: core.list_namespaced_pod("default")),
    "list nodes": attempt(lambda: core.list_node()),
}
review = client.AuthenticationV1Api().create_self_subject_review(
    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
)
out["user"] = review.status.user_info.username
out["groups"] = sorted(review.status.user_info.groups)
pathlib.Path(sys.argv[1], "rbac.json").write_text(json.dumps(out))
"""


def test_service_account_gets_exactly_its_role(cluster: Cluster, namespace: str) -> None:
    admin = cluster.admin()
    admin.create(
        path("v1", "serviceaccounts", namespace),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
    )
    admin.create(
        path("rbac.authorization.k8s.io/v1", "roles", namespace),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "reader"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
            ],
        },
    )
    admin.create(
        path("rbac.authorization.k8s.io/v1", "rolebindings", namespace),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    pod = python_pod(
        "probe", PROBE, args=("/data", "/var/run/secrets/kubernetes.io/serviceaccount"), service_account="reader"
    )
    admin.create(path("v1", "pods", namespace), pod)
    done = cluster.wait_pod(
        namespace, "probe", lambda p: p is not None and p["status"].get("phase") in ("Succeeded", "Failed"), 60
    )
    assert done is not None
    assert done["status"]["phase"] == "Succeeded", cluster.pod_log(namespace, "probe")

    seen = json.loads((cluster.pod_dir(namespace, "probe") / "volumes" / "data" / "rbac.json").read_text())
    assert seen.pop("user") == f"system:serviceaccount:{namespace}:reader"
    assert "system:serviceaccounts" in seen.pop("groups")
    assert seen == {
        "list pods here": 200,
        "get configmap here": 200,
        "create configmap here": 403,
        "list secrets here": 403,
        "delete pods here": 403,
        "list pods in default": 403,
        "list nodes": 403,
    }
    assert admin.get_or_none(path("v1", "configmaps", namespace, "written-by-pod")) is None
