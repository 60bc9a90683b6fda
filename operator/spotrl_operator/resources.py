"""The Kubernetes objects the operator creates for an RLJob, as plain manifests.

Pure builders: names are deterministic (so a restarted operator finds what it made),
every object carries an owner reference to the RLJob (so deletion cascades), and the
runtime's ServiceAccount may read its own RLJob and patch its status, nothing more.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spotrl_operator import placement
from spotrl_operator.settings import Settings, allowed_image_prefixes, image_allowed
from spotrl_runtime.api import rljob as api
from spotrl_runtime.api.placement import controller_pod_gpus
from spotrl_runtime.rewards.isolation import ENV_NAMES_VAR, IMPORT_PREFIXES_VAR, import_refusal

JOB_LABEL = "spotrl.dev/job"
ROLE_LABEL = "spotrl.dev/role"
ATTEMPT_LABEL = "spotrl.dev/attempt"
STANDBY_LABEL = "spotrl.dev/standby"
"""On a controller pod made ahead of its attempt (``spec.standby``): while ``status.attempt`` is
below the pod's, it is the job's standby, not its controller."""
WORKER_INDEX_LABEL = "spotrl.dev/worker-index"
TRAINER_INDEX_LABEL = "spotrl.dev/trainer-index"
INDEX_LABELS = {"worker": WORKER_INDEX_LABEL, "trainer": TRAINER_INDEX_LABEL}
"""The label that holds a Ray node pod's index within its attempt, by role."""
NODE_ROLES = ("worker", "trainer")
"""Pods that join the controller's Ray head as nodes of their own: generation workers
(``generation.workerPods``) and trainer ranks (``training.parallelism.trainerPods``)."""
WORKER_GRACE_SECONDS = 15
"""A worker or trainer pod has nothing to save (a trainer rank writes its shards of a cut
while the controller asks, never on SIGTERM): its grace period only covers stopping Ray."""
METRICS_PORT = 9400
"""The runtime pods' one port on the pod IP: /metrics. /status and POST /barrier listen on the
pod's loopback (``kubectl port-forward``), so nothing else in the cluster can park a job."""
RUNTIME_UID = 10001
"""The images' user (Dockerfile: ``useradd --uid 10001``)."""
RETENTION_LABEL = "spotrl.dev/retention-of"
"""The deletion pod of retentionPolicy Delete: not one of the job's pods (no JOB_LABEL), so
stopping the job's pods never stops it."""
DEFAULT_SECRET_ANNOTATION = "spotrl.dev/default-credentials-secret"
"""The chart's default credentials Secret when the operator first saw the job ("": none). A job
that names no Secret keeps mounting this one: its author was checked against it at admission,
and a later default reaches the job only through an update of the job, which the admission
policy checks again (it reads this annotation too)."""
# Where the runtime writes, each an emptyDir under a read-only root filesystem: Ray's session
# folder and torch's compile caches (/tmp), model and tokenizer caches ($HOME/.cache), and
# shared memory for Ray's object store and NCCL (/dev/shm, 64 MiB in a container otherwise).
WRITABLE = (("tmp", "/tmp", None), ("home", "/home/spotrl", None), ("dshm", "/dev/shm", "Memory"))


@dataclass(frozen=True)
class JobRef:
    """The RLJob an object belongs to."""

    name: str
    namespace: str
    uid: str
    default_secret: str | None = field(default=None, compare=False)
    """The job's :data:`DEFAULT_SECRET_ANNOTATION`; None: not recorded yet (the settings' default)."""


def names(job: str) -> dict[str, str]:
    """Every object name the operator derives from the job's name."""
    return {
        "service_account": f"{job}-runtime",
        "role": f"{job}-runtime",
        "role_binding": f"{job}-runtime",
        "service": job,
        "pdb": f"{job}-controller",
        "network_policy": job,
    }


def child_kinds(settings: Settings) -> tuple[str, ...]:
    """The kinds of the objects a job has besides its pods (:meth:`Actuator.ensure_children`)."""
    kinds = ("ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget")
    return (*kinds, "NetworkPolicy") if settings.network_policy else kinds


def controller_pod_name(job: str, attempt: int) -> str:
    return f"{job}-controller-{attempt}"


def node_pod_name(job: str, role: str, attempt: int, index: int) -> str:
    """``<job>-worker-<attempt>-<index>`` or ``<job>-trainer-<attempt>-<index>``."""
    return f"{job}-{role}-{attempt}-{index}"


def worker_pod_name(job: str, attempt: int, index: int) -> str:
    return node_pod_name(job, "worker", attempt, index)


def trainer_pod_name(job: str, attempt: int, index: int) -> str:
    return node_pod_name(job, "trainer", attempt, index)


def instance_labels(job: str) -> dict[str, str]:
    """What every object the operator makes for a job carries, its deletion pod included: the
    job's NetworkPolicy selects these."""
    return {
        "app.kubernetes.io/name": "spotrl",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/managed-by": "spotrl-operator",
    }


def labels(job: str, role: str | None = None) -> dict[str, str]:
    out = {**instance_labels(job), JOB_LABEL: job}
    if role:
        out[ROLE_LABEL] = role
    return out


def _meta(
    ref: JobRef, name: str, role: str | None = None, extra_labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**labels(ref.name, role), **(extra_labels or {})},
        "ownerReferences": [owner_reference(ref)],
    }


def owner_reference(ref: JobRef) -> dict[str, Any]:
    """The RLJob as the controlling owner of an object (garbage-collected with it)."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def storage_uri(ref: JobRef, spec: api.RLJobSpec, settings: Settings) -> str:
    """Where this job's cuts live. Raises ValueError naming the field when there is none."""
    if spec.checkpoint.storage:
        return spec.checkpoint.storage
    if settings.default_storage:
        return f"{settings.default_storage.rstrip('/')}/{ref.namespace}/{ref.name}"
    raise ValueError(
        "spec.checkpoint.storage is not set and the operator has no default storage; "
        "set spec.checkpoint.storage (e.g. s3://bucket/prefix) or the chart value storage.default"
    )


def namespace_refused(namespace: str, settings: Settings) -> str | None:
    """Why the operator runs no job in ``namespace`` and makes nothing there (None: it may)."""
    if namespace not in settings.refused_namespaces:
        return None
    return (
        f"metadata.namespace: this operator runs no RLJob in namespace {namespace} (kube-system, or the operator's "
        "own namespace); create the job in another namespace, or ask the cluster's admin for the chart value "
        "allowSystemNamespaces"
    )


def check_job(ref: JobRef, spec: api.RLJobSpec, settings: Settings) -> None:
    """What the operator refuses to run, beyond the schema. Raises ValueError naming the field."""
    refused = namespace_refused(ref.namespace, settings)
    if refused:
        raise ValueError(refused)
    storage_uri(ref, spec, settings)
    image = spec.scheduling.image
    if image and not image_allowed(image, settings):
        raise ValueError(
            f"spec.scheduling.image {image!r} is not allowed by this operator (allowed: "
            f"{', '.join(allowed_image_prefixes(settings))}); use an allowed image, or ask the cluster's "
            "admin to add it to the chart value imagePolicy.allowedImages"
        )
    refusal = spec.reward.import_path and import_refusal(spec.reward.import_path, settings.reward_import_prefixes)
    if refusal:
        raise ValueError(refusal)
    locked = [e.name for e in spec.runtime_env if e.name in settings.locked_env]
    if locked:
        raise ValueError(
            f"spec.runtimeEnv {', '.join(locked)}: locked by the cluster's admin (chart value runtimeEnvLocked), "
            "whose value applies to every job; remove it from spec.runtimeEnv"
        )


def service_account(ref: JobRef, settings: Settings) -> dict[str, Any]:
    """The identity of the job's pods: the kube bridge's Role is bound to it, and a cloud identity
    (IRSA, GKE or AKS workload identity) annotated on it reaches S3 without keys."""
    meta = _meta(ref, names(ref.name)["service_account"])
    if settings.runtime_service_account_annotations:
        meta["annotations"] = dict(settings.runtime_service_account_annotations)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"


def _runtime_pod_meta(
    ref: JobRef, name: str, role: str, extra_labels: Mapping[str, str], settings: Settings
) -> dict[str, Any]:
    """A runtime pod's metadata: the operator's labels over the settings' ones, and the annotations
    that keep a node autoscaler's consolidation from draining a running job. A spot interruption
    still drains it, and the barrier cuts first."""
    meta = _meta(ref, name, role, {**settings.runtime_pod_labels, **extra_labels})
    annotations = dict(settings.runtime_pod_annotations)
    if settings.runtime_do_not_disrupt:
        annotations[DO_NOT_DISRUPT] = "true"
    if not settings.runtime_safe_to_evict:
        annotations[SAFE_TO_EVICT] = "false"
    if annotations:
        meta["annotations"] = annotations
    return meta


def role(ref: JobRef) -> dict[str, Any]:
    """Read this RLJob (get, and list/watch filtered to its name) and patch its status."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(ref, names(ref.name)["role"]),
        "rules": [
            {
                "apiGroups": [api.GROUP],
                "resources": [api.PLURAL],
                "resourceNames": [ref.name],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": [api.GROUP],
                "resources": [f"{api.PLURAL}/status"],
                "resourceNames": [ref.name],
                "verbs": ["get", "patch"],
            },
        ],
    }


def role_binding(ref: JobRef) -> dict[str, Any]:
    n = names(ref.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(ref, n["role_binding"]),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n["role"]},
        "subjects": [{"kind": "ServiceAccount", "name": n["service_account"], "namespace": ref.namespace}],
    }


def service(ref: JobRef) -> dict[str, Any]:
    """Headless: the controller's /metrics under a stable name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, names(ref.name)["service"]),
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: ref.name, ROLE_LABEL: "controller"},
            "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT}],
        },
    }


def network_policy(ref: JobRef, settings: Settings) -> dict[str, Any]:
    """Who may reach the job's pods (its deletion pod too): the job's own pods (Ray between
    the controller and its worker and trainer pods, the ranks' gloo or NCCL, and the weight
    channel from the trainer to the generation workers, on any port), and
    ``settings.metrics_from`` the controller's /metrics port. Nothing else; egress (S3, the
    API server, model hubs) is not restricted."""
    own = {"podSelector": {"matchLabels": instance_labels(ref.name)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ref, names(ref.name)["network_policy"]),
        "spec": {
            "podSelector": {"matchLabels": instance_labels(ref.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {
                    "from": [dict(p) for p in settings.metrics_from],
                    "ports": [{"protocol": "TCP", "port": METRICS_PORT}],
                },
            ],
        },
    }


def budget_trainers(spec: api.RLJobSpec) -> int:
    """Trainer pods the job's PodDisruptionBudget holds besides the controller (its ranks,
    with ``training.parallelism.trainerPods``; else none)."""
    par = spec.training.parallelism
    return par.ranks if par.trainer_pods else 0


def disruption_budget(ref: JobRef, open_: bool, trainers: int = 0) -> dict[str, Any]:
    """The pods that hold the job's state: the controller, and its ``trainers`` trainer pods
    (:func:`budget_trainers`; a trainer rank lost is a preemption of the whole group, while a
    generation worker is never waited for). Closed (minAvailable: all of them): every
    eviction of one of them gets 429 until a cut commits; open: minAvailable 0. An integer
    minAvailable, not maxUnavailable: for that the disruption controller would need the scale
    of the pods' owner, and an RLJob has none."""
    roles = ["controller", "trainer"] if trainers else ["controller"]
    selector: dict[str, Any] = {
        "matchLabels": {JOB_LABEL: ref.name},
        "matchExpressions": [
            {"key": ROLE_LABEL, "operator": "In", "values": roles},
            # A standby (spec.standby) holds nothing yet; counted, it would let the drain evict
            # the controller it stands by for. The operator takes the label off as it promotes it.
            {"key": STANDBY_LABEL, "operator": "DoesNotExist"},
        ],
    }
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ref, names(ref.name)["pdb"]),
        "spec": {
            "minAvailable": 0 if open_ else 1 + trainers,
            "selector": selector,
            # Evict a pod that never became ready without waiting for the budget.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _quantities(res: api.Resources, defaults: Mapping[str, str]) -> dict[str, Any]:
    """Requests (the job's, else the operator's defaults: never BestEffort) and limits: GPUs,
    and memory equal to its request. A pod without a memory limit can push its node into
    memory pressure, and the kubelet's evictions then ignore the PodDisruptionBudget: the
    controller could go with no barrier because a worker grew."""
    req: dict[str, Any] = {k: v for k, v in defaults.items() if k in ("cpu", "memory")}
    if res.cpu:
        req["cpu"] = res.cpu
    if res.memory:
        req["memory"] = res.memory
    limits: dict[str, Any] = {}
    if "memory" in req:
        limits["memory"] = req["memory"]
    if res.gpu:
        req["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(res.gpu)
    out: dict[str, Any] = {"requests": req}
    if limits:
        out["limits"] = limits
    return out


def _restricted(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """Pod Security ``restricted``, a read-only root filesystem and the runtime's writable
    folders, for a pod spec with one container."""
    pod_spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_spec["volumes"] = [
        {"name": name, "emptyDir": {"medium": medium} if medium else {}} for name, _, medium in WRITABLE
    ]
    for container in pod_spec["containers"]:
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        container["volumeMounts"] = [{"name": name, "mountPath": mount} for name, mount, _ in WRITABLE]
    return pod_spec


def _runtime_env(
    ref: JobRef, spec: api.RLJobSpec, settings: Settings, attempt: int, storage: bool, credentials: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, envFrom) of a runtime container: who it is, and how it reaches the job's S3
    (the storage, and models or datasets on s3://). ``credentials``: whether it gets the
    job's credentials Secret at all."""
    env: list[dict[str, Any]] = [
        {"name": "SPOTRL_JOB", "value": ref.name},
        {"name": "SPOTRL_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "SPOTRL_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SPOTRL_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SPOTRL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SPOTRL_ATTEMPT", "value": str(attempt)},
    ]
    if storage:
        env.append({"name": "SPOTRL_STORAGE", "value": storage_uri(ref, spec, settings)})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    # What the reward's process may import, and which of the admin's variables it gets beside the
    # job's (rewards/isolation.py). SPOTRL_ names are the operator's: no runtimeEnv replaces them.
    env.append({"name": IMPORT_PREFIXES_VAR, "value": ",".join(settings.reward_import_prefixes)})
    env.append({"name": ENV_NAMES_VAR, "value": ",".join(sorted(settings.extra_env))})
    endpoint = spec.checkpoint.s3_endpoint or settings.default_s3_endpoint
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": endpoint})
    if spec.checkpoint.s3_region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": spec.checkpoint.s3_region})
    env += [{"name": k, "value": v} for k, v in sorted(settings.extra_env.items())]
    # A locked name keeps the settings' value even where the job was not refused (check_job).
    own = [e for e in spec.runtime_env if e.name not in settings.locked_env]
    env += [e.model_dump(by_alias=True, exclude_none=True) for e in own]
    secret = credentials_secret(ref, spec, settings)
    env_from = [{"secretRef": {"name": secret}}] if secret and credentials else []
    return _last_of_each_name(env), env_from


def _last_of_each_name(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each name once, where it was last given: the job's own over the settings' and the
    operator's. A pod lets the last of two win, but Kueue's Workload refuses a name twice
    (its containers' env is a map by name), which would keep a queued job from being admitted."""
    last = {e["name"]: i for i, e in enumerate(env)}
    return [e for i, e in enumerate(env) if last[e["name"]] == i]


def credentials_secret(ref: JobRef, spec: api.RLJobSpec, settings: Settings) -> str | None:
    """The Secret with the job's S3 keys: its own, else the default recorded on it, else the
    settings'; None: the pods find credentials themselves (boto3's chain: a cloud identity on
    the job's ServiceAccount, a node role)."""
    default = settings.default_credentials_secret if ref.default_secret is None else ref.default_secret
    return spec.checkpoint.credentials_secret or default or None


def default_secret_to_record(job: Mapping[str, Any], settings: Settings) -> str | None:
    """What to record in the job's :data:`DEFAULT_SECRET_ANNOTATION`; None: it is recorded."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    return None if DEFAULT_SECRET_ANNOTATION in annotations else settings.default_credentials_secret or ""


def _placement(spec: api.RLJobSpec, avoid_nodes: Iterable[str]) -> dict[str, Any]:
    """The job's scheduling constraints, for every pod of the job, kept off ``avoid_nodes``."""
    sched = spec.scheduling
    out: dict[str, Any] = {
        "nodeSelector": dict(sched.node_selector),
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations],
    }
    pod_affinity = placement.affinity(sched, avoid_nodes)
    if pod_affinity:
        out["affinity"] = pod_affinity
    if sched.topology_spread_constraints:
        out["topologySpreadConstraints"] = [
            c.model_dump(by_alias=True, exclude_none=True, mode="json") for c in sched.topology_spread_constraints
        ]
    if sched.scheduler_name:
        out["schedulerName"] = sched.scheduler_name
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    return out


def controller_pod(
    ref: JobRef,
    spec: api.RLJobSpec,
    settings: Settings,
    attempt: int,
    avoid_nodes: Iterable[str] = (),
    standby: bool = False,
) -> dict[str, Any]:
    """The job's controller (trainer, recovery core; generation workers as Ray actors unless
    ``generation.workerPods``). ``standby``: made before its attempt is on the status
    (``spec.standby``); the same pod, labelled so, which warms up and waits for its attempt."""
    n = names(ref.name)
    sched = spec.scheduling
    env, env_from = _runtime_env(ref, spec, settings, attempt, storage=True)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": n["service_account"],
        "restartPolicy": "Never",
        # No Service environment variables: a Service named like spotrl-* would inject
        # SPOTRL_*_PORT=tcp://... into the settings the runtime reads from its environment.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": sched.termination_grace_period_seconds,
        **_placement(spec, avoid_nodes),
        "containers": [
            {
                "name": "controller",
                "image": sched.image or settings.runtime_image,
                "imagePullPolicy": settings.image_pull_policy,
                "command": ["spotrl", "controller"],
                "args": ["--resume", "auto"],
                "env": env,
                "envFrom": env_from,
                "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
                # A crash's one-line error (the log's tail) goes into the pod's status, and from
                # there into the RLJob's ControllerCrashed Event and status message.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": _quantities(
                    spec.training.resources.model_copy(update={"gpu": controller_pod_gpus(spec)}),
                    settings.controller_requests,
                ),
                # Ready once /metrics accepts connections: a TCP probe, which the kernel answers
                # even while a long step holds the interpreter (an HTTP one could time out, and
                # an unready controller is evicted without waiting for the budget).
                "readinessProbe": {"tcpSocket": {"port": METRICS_PORT}, "periodSeconds": 5, "failureThreshold": 6},
            }
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _runtime_pod_meta(
            ref,
            controller_pod_name(ref.name, attempt),
            "controller",
            {ATTEMPT_LABEL: str(attempt), **({STANDBY_LABEL: "true"} if standby else {})},
            settings,
        ),
        "spec": _restricted(pod_spec),
    }


def _ray_cpus(quantity: str | None) -> int | None:
    """A CPU request (a Kubernetes quantity) as the whole CPUs a Ray node offers: rounded
    up, at least 1. None when there is no request (Ray counts the CPUs it sees)."""
    if not quantity:
        return None
    return max(1, math.ceil(api.quantity_value(quantity) - 1e-9))


def worker_pod(
    ref: JobRef,
    spec: api.RLJobSpec,
    settings: Settings,
    attempt: int,
    index: int,
    address: str,
    avoid_nodes: Iterable[str] = (),
) -> dict[str, Any]:
    """Generation worker ``index`` of controller attempt ``attempt`` (``generation.workerPods``):
    ``spotrl worker`` joins the controller's Ray cluster at ``address`` as a node that offers
    one worker slot, with ``generation.resources``. It writes no cuts; it reads from S3 only
    to load a policy stored there (weights come from the controller), so only then does it
    get the job's keys. It is not covered by the PodDisruptionBudget."""
    needs_s3 = spec.policy.model.startswith("s3://")
    return _node_pod(ref, spec, settings, "worker", attempt, index, address, avoid_nodes, storage=False, keys=needs_s3)


def trainer_pod(
    ref: JobRef,
    spec: api.RLJobSpec,
    settings: Settings,
    attempt: int,
    index: int,
    address: str,
    avoid_nodes: Iterable[str] = (),
) -> dict[str, Any]:
    """Trainer pod ``index`` of controller attempt ``attempt`` (``training.parallelism.trainerPods``):
    ``spotrl worker --role trainer`` joins the controller's Ray cluster at ``address`` as a
    node that offers one trainer rank's slot, with ``parallelism.resources``. Its rank writes
    its shards of every cut straight to the job's storage: it gets the storage and the job's
    keys, as the controller does. The PodDisruptionBudget holds it with the controller."""
    return _node_pod(ref, spec, settings, "trainer", attempt, index, address, avoid_nodes, storage=True, keys=True)


def _node_pod(
    ref: JobRef,
    spec: api.RLJobSpec,
    settings: Settings,
    role: str,
    attempt: int,
    index: int,
    address: str,
    avoid_nodes: Iterable[str],
    storage: bool,
    keys: bool,
) -> dict[str, Any]:
    """A pod of ``role`` (:data:`NODE_ROLES`) that joins the controller's Ray cluster as a node
    of its own. It needs no Kubernetes API access, so it gets no token."""
    sched = spec.scheduling
    env, env_from = _runtime_env(ref, spec, settings, attempt, storage=storage, credentials=keys)
    if role == "trainer":
        res, defaults = spec.training.parallelism.resources, settings.controller_requests
        args = ["--role", "trainer", "--address", address]
    else:
        res, defaults = spec.generation.resources, settings.worker_requests
        args = ["--address", address]
    cpus = _ray_cpus(res.cpu)
    if cpus is not None:
        args += ["--num-cpus", str(cpus)]
    if res.gpu:
        args += ["--num-gpus", str(res.gpu)]
    pod_spec: dict[str, Any] = {
        # The job's identity (a cloud role for S3 reaches it through the ServiceAccount), but no
        # Kubernetes API token: the pod never calls the API server.
        "serviceAccountName": names(ref.name)["service_account"],
        "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        "enableServiceLinks": False,  # as the controller: no SPOTRL_*_PORT from Services
        "terminationGracePeriodSeconds": min(WORKER_GRACE_SECONDS, sched.termination_grace_period_seconds),
        **_placement(spec, avoid_nodes),
        "containers": [
            {
                "name": role,
                "image": sched.image or settings.runtime_image,
                "imagePullPolicy": settings.image_pull_policy,
                "command": ["spotrl", "worker"],
                "args": args,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": env,
                "envFrom": env_from,
                "resources": _quantities(res, defaults),
            }
        ],
    }
    extra = {ATTEMPT_LABEL: str(attempt), INDEX_LABELS[role]: str(index)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _runtime_pod_meta(ref, node_pod_name(ref.name, role, attempt, index), role, extra, settings),
        "spec": _restricted(pod_spec),
    }


def retention_pod_name(job: str, try_: int) -> str:
    return f"{job}-retention-{try_}"


TERMINATION_LOG = "/dev/termination-log"


RETENTION_DEADLINE_SECONDS = 300
"""A deletion pod running longer (a hung S3 call) fails, and counts as a failed try."""


def retention_pod(ref: JobRef, spec: api.RLJobSpec, settings: Settings, uri: str, try_: int) -> dict[str, Any]:
    """Deletes a deleted job's cuts (retentionPolicy Delete): ``spotrl ckpt delete`` in the
    job's namespace, with the job's S3 credentials from its Secret. The kubelet reads the
    Secret for it; the operator never does. No owner reference (the RLJob is going, and a
    foreground deletion would collect the pod at once): the operator deletes it when done."""
    env, env_from = _runtime_env(ref, spec, settings, attempt=0, storage=False)
    keys = credentials_secret(ref, spec, settings)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # Without a Secret the keys come from the job's cloud identity, on its ServiceAccount (held
        # for the pod: retention_service_account).
        **({} if keys else {"serviceAccountName": names(ref.name)["service_account"]}),
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "activeDeadlineSeconds": RETENTION_DEADLINE_SECONDS,
        # Anywhere the job's pods could run; not its nodeSelector (its GPU nodes may be gone).
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations],
        "containers": [
            {
                "name": "delete-cuts",
                "image": settings.retention_image,
                "imagePullPolicy": settings.image_pull_policy,
                "command": ["spotrl", "ckpt", "delete", uri],
                "args": ["--job", f"{ref.namespace}/{ref.name}", "--yes", "--termination-log", TERMINATION_LOG],
                "env": env,
                "envFrom": env_from,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {
                    "requests": {"cpu": "50m", "memory": "128Mi"},
                    "limits": {"memory": "256Mi"},
                },
            }
        ],
    }
    meta = _meta(ref, retention_pod_name(ref.name, try_))
    del meta["ownerReferences"]
    meta["labels"] = {**instance_labels(ref.name), RETENTION_LABEL: ref.name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": _restricted(pod_spec)}


def retention_service_account(ref: JobRef, settings: Settings) -> dict[str, Any]:
    """The job's ServiceAccount as its keyless deletion pod holds it: owned by no one, so that the
    garbage collector of a foreground deletion, which deletes the RLJob's dependents before it,
    leaves it (a cloud identity is bound to its name). The operator deletes it with the pod."""
    sa = service_account(ref, settings)
    del sa["metadata"]["ownerReferences"]
    sa["metadata"]["labels"][RETENTION_LABEL] = ref.name
    return sa


def event(
    job_meta: Mapping[str, Any], type_: str, reason: str, message: str, now: str, instance: str
) -> dict[str, Any]:
    """A core/v1 Event about the RLJob. Its name is a digest of what it says, so the same
    Event again is found (and counted) instead of added."""
    digest = hashlib.sha256(f"{job_meta.get('uid')}|{type_}|{reason}|{message}".encode()).hexdigest()[:16]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{job_meta['name']}.{digest}", "namespace": job_meta["namespace"]},
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": job_meta["name"],
            "namespace": job_meta["namespace"],
            "uid": job_meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "spotrl-operator"},
        "reportingComponent": "spotrl.dev/operator",
        "reportingInstance": instance[:128],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
