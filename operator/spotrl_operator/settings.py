"""The operator's settings: flags, each with an environment variable as fallback.

One frozen :class:`Settings` object is built at start-up (:func:`from_args`) and handed to
everything that needs it; nothing reads the environment later. The Helm chart passes its
values as flags (``charts/spotrl/templates/deployment.yaml``).

Pure Python: importing this module does not import Kopf or the Kubernetes client, so the
``spotrl`` CLI can build its parser anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotrl_runtime.rewards.isolation import DEFAULT_IMPORT_PREFIXES, IMPORT_PREFIXES_VAR

# Caps on the barrier deadline per notice provider (see signals.Signal.provider): how long the
# platform's notice leaves the pods, minus a margin. spec.checkpoint.barrierDeadlineSeconds
# (default 100 s, fitting AWS's 120 s) applies where no cap is set.
DEFAULT_DEADLINE_CAPS: Mapping[str, int] = {"gke": 20, "aks": 25}
FINALIZER_SECONDS_MAX = 3000.0
"""The longest ``--finalizer-seconds``: the finalizer ends by itself before Kopf's own bound on it
(``handlers.FINALIZER_BOUND_SECONDS``) ends it."""
# Requests of a runtime pod whose RLJob sets none: enough to keep it out of the BestEffort
# class, which the kubelet evicts first under node pressure, ignoring the PodDisruptionBudget
# (a loss with no barrier). A runtime pod's memory limit equals its memory request.
DEFAULT_CONTROLLER_REQUESTS: Mapping[str, str] = {"cpu": "500m", "memory": "4Gi"}
DEFAULT_WORKER_REQUESTS: Mapping[str, str] = {"cpu": "500m", "memory": "2Gi"}
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$")


@dataclass(frozen=True)
class Settings:
    """Operator-wide defaults and knobs (flags, environment, or the Helm chart's values)."""

    runtime_image: str = "spotrl-runtime-cpu:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    default_storage: str | None = None
    """Root for jobs without spec.checkpoint.storage; each job gets <root>/<namespace>/<name>."""
    default_s3_endpoint: str | None = None
    default_credentials_secret: str | None = None
    """Secret (in the job's namespace) with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."""
    extra_taint_keys: tuple[str, ...] = ()
    """Taint keys (fnmatch patterns) that announce a node's end, besides the well-known ones."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """Added to every runtime container (e.g. cache folders)."""
    locked_env: frozenset[str] = frozenset()
    """Environment names a job's spec.runtimeEnv may not set (the admin's proxies, offline
    switches): such a job is refused, and its value never reaches a pod."""
    deadline_caps: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_DEADLINE_CAPS))
    """Barrier deadline caps in seconds, by notice provider (gke, aks, karpenter, cordon ...)."""
    controller_requests: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CONTROLLER_REQUESTS))
    """cpu and memory of a controller pod whose RLJob does not set them (spec.training.resources)."""
    worker_requests: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_WORKER_REQUESTS))
    """cpu and memory of a worker pod whose RLJob does not set them (spec.generation.resources)."""
    allowed_images: tuple[str, ...] = ()
    """Image prefixes an RLJob's spec.scheduling.image may start with; empty: only the runtime
    image's repository (any tag or digest); "*": any image."""
    reward_import_prefixes: tuple[str, ...] = DEFAULT_IMPORT_PREFIXES
    """Module prefixes spec.reward.importPath may name (rewards/isolation.py); empty: none,
    built-in rewards by name only; "*": any module."""
    retention_image: str = "spotrl-operator:0.1.0"
    """Image of the pod that deletes a job's cuts (retentionPolicy Delete): the operator's own."""
    network_policy: bool = True
    """Give each job a NetworkPolicy: its pods reach each other; metrics_from reaches /metrics."""
    metrics_from: tuple[Mapping[str, Any], ...] = ({"namespaceSelector": {}},)
    """NetworkPolicy peers allowed to scrape the controllers' /metrics port (default: any pod)."""
    runtime_do_not_disrupt: bool = True
    """Annotate the job's pods ``karpenter.sh/do-not-disrupt: "true"``: Karpenter's consolidation
    and drift leave their nodes alone (a spot interruption or an expiry still takes them, through
    the barrier)."""
    runtime_safe_to_evict: bool = False
    """False: annotate the job's pods ``cluster-autoscaler.kubernetes.io/safe-to-evict: "false"``, so
    the Cluster Autoscaler never scales their node down."""
    runtime_pod_annotations: Mapping[str, str] = field(default_factory=dict)
    """Added to every runtime pod of every job."""
    runtime_pod_labels: Mapping[str, str] = field(default_factory=dict)
    """Added to every runtime pod of every job (e.g. ``azure.workload.identity/use: "true"``)."""
    runtime_service_account_annotations: Mapping[str, str] = field(default_factory=dict)
    """On each job's ServiceAccount: a cloud identity for its pods (IRSA's ``eks.amazonaws.com/role-arn``,
    GKE's ``iam.gke.io/gcp-service-account``, AKS's ``azure.workload.identity/client-id``)."""
    kueue: bool = False
    """Act as Kueue's external controller for RLJobs that carry ``kueue.x-k8s.io/queue-name``
    (:mod:`~spotrl_operator.queueing`); needs Kueue's CRDs in the cluster."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty: the whole cluster."""
    refused_namespaces: tuple[str, ...] = ()
    """Namespaces where the operator runs no RLJob and makes nothing (the chart: ``kube-system`` and
    its own, unless ``allowSystemNamespaces``)."""
    reconcile_interval: float = 30.0
    """Seconds between two level-triggered passes over a running job when nothing wakes it
    earlier (every change of the job, its pods and their nodes wakes it; a finished job only then)."""
    finalizer_seconds: float = 900.0
    """A deleted RLJob's finalizer ends within this long (from the deletion), cuts deleted or not."""
    kube_qps: float = 50.0
    """Requests a second to the API server, at most (a token bucket, as client-go's); 0: no limit."""
    kube_burst: int = 100
    node_lost_seconds: float = 30.0
    """A node Ready Unknown (or tainted unreachable) this long is lost: its pods may be force-deleted."""
    unhealthy_node_share: float = 0.55
    """A zone with at least this share of its nodes not Ready (and 3) has no node lost by its
    health (:mod:`~spotrl_operator.fleet`; Kubernetes' ``--unhealthy-zone-threshold``)."""

    leader_election: bool = True
    lease_name: str = "spotrl-operator"
    lease_namespace: str = "default"
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    lease_seconds: float = 15.0
    """A leader that has not renewed for this long is replaced by a standby replica."""

    metrics_port: int = 9400
    """Prometheus endpoint (/metrics); 0 turns it off."""
    metrics_address: str = "0.0.0.0"
    kubeconfig: str | None = None
    """Default: KUBECONFIG, ~/.kube/config, then the in-cluster service account."""
    verbose: bool = False
    log_writes: bool = False
    """Log every write sent to the API server (method and path), to audit who acted when."""


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_number(name: str, default: float, kind: type[int] | type[float]) -> Any:
    """A numeric setting from the environment; a value that is not one stops with its name
    (a pod with service links gets SPOTRL_<SERVICE>_PORT=tcp://... from a Service)."""
    value = _env(name)
    if value is None:
        return kind(default)
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(
            f"spotrl operator: ${name}={value!r} is not a{'n integer' if kind is int else ' number'}; "
            "unset it (in a pod, a Service named like it injects it unless enableServiceLinks is false)"
        ) from None


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    return default if value is None else value.lower() in ("1", "true", "yes")


OWN_LABEL_PREFIXES = ("spotrl.dev/", "app.kubernetes.io/")
"""Label keys the operator sets and selects by: a setting may not add its own."""


def _own_keys_refused(pairs: dict[str, str], flag: str) -> dict[str, str]:
    for key in pairs:
        if key.startswith(OWN_LABEL_PREFIXES):
            raise SystemExit(f"{flag} {key}: {', '.join(OWN_LABEL_PREFIXES)} keys are the operator's own; use another")
    return pairs


def _add_pairs(g: Any, flag: str, metavar: str, text: str) -> None:
    """A repeatable ``KEY=VALUE`` flag, read back by :func:`_pairs`."""
    g.add_argument(flag, action="append", default=[], metavar=metavar, help=text)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _requests(value: str, flag: str) -> dict[str, str]:
    """``cpu=500m,memory=4Gi`` as a mapping, each a Kubernetes quantity."""
    out = _pairs(_list(value), flag)
    for key, quantity in out.items():
        if key not in ("cpu", "memory"):
            raise SystemExit(f"{flag} {key}={quantity}: only cpu and memory can be defaulted")
        if not _QUANTITY.match(quantity):
            raise SystemExit(f"{flag} {key}={quantity}: not a Kubernetes quantity (e.g. 500m, 4Gi)")
    return out


def _peers(value: str | None) -> tuple[dict[str, Any], ...]:
    """``--metrics-from``: a JSON list of NetworkPolicy peers (objects)."""
    if value is None:
        return tuple(dict(p) for p in Settings().metrics_from)
    try:
        peers = json.loads(value)
    except ValueError as err:
        raise SystemExit(f"--metrics-from: not JSON ({err}); give a list of NetworkPolicy peers") from None
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise SystemExit(
            '--metrics-from: expected a JSON list of NetworkPolicy peers, e.g. [{"namespaceSelector": {}}]'
        )
    return tuple(peers)


def allowed_image_prefixes(settings: Settings) -> tuple[str, ...]:
    """What :attr:`Settings.allowed_images` allows, with its default spelled out."""
    return settings.allowed_images or _repository_prefixes(settings.runtime_image)


def image_allowed(image: str, settings: Settings) -> bool:
    """Whether a job may run ``image``."""
    return any(p == "*" or image.startswith(p) for p in allowed_image_prefixes(settings))


def _repository_prefixes(image: str) -> tuple[str, ...]:
    """``repo:tag`` or ``repo@sha256:...`` -> the prefixes that allow any tag or digest of repo."""
    repo = image.split("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
    return (f"{repo}:", f"{repo}@")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The operator's flags. Every one falls back to the environment variable named in its help."""
    d = Settings()
    g = p.add_argument_group("runtime pods")
    g.add_argument(
        "--runtime-image",
        default=_env("SPOTRL_RUNTIME_IMAGE", d.runtime_image),
        help="image of the controller pods when spec.scheduling.image is unset ($SPOTRL_RUNTIME_IMAGE)",
    )
    g.add_argument(
        "--image-pull-policy",
        default=_env("SPOTRL_IMAGE_PULL_POLICY", d.image_pull_policy),
        choices=("Always", "IfNotPresent", "Never"),
        help="($SPOTRL_IMAGE_PULL_POLICY)",
    )
    g.add_argument(
        "--default-storage",
        default=_env("SPOTRL_DEFAULT_STORAGE"),
        help="cut storage root for jobs without spec.checkpoint.storage, e.g. s3://bucket/spotrl; "
        "a job gets <root>/<namespace>/<name> ($SPOTRL_DEFAULT_STORAGE)",
    )
    g.add_argument(
        "--default-s3-endpoint",
        default=_env("SPOTRL_DEFAULT_S3_ENDPOINT"),
        help="S3 endpoint for jobs without spec.checkpoint.s3Endpoint ($SPOTRL_DEFAULT_S3_ENDPOINT)",
    )
    g.add_argument(
        "--default-credentials-secret",
        default=_env("SPOTRL_DEFAULT_CREDENTIALS_SECRET"),
        help="Secret in the job's namespace with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, for jobs "
        "without spec.checkpoint.credentialsSecret ($SPOTRL_DEFAULT_CREDENTIALS_SECRET)",
    )
    _add_pairs(g, "--runtime-env", "NAME=VALUE", "environment variable for every runtime container (repeatable)")
    g.add_argument(
        "--runtime-env-locked",
        action="append",
        default=_list(_env("SPOTRL_RUNTIME_ENV_LOCKED")),
        metavar="NAME",
        help="environment name a job's spec.runtimeEnv may not set: a job that does is refused, and only "
        "--runtime-env's value (if any) reaches its pods (repeatable; $SPOTRL_RUNTIME_ENV_LOCKED, comma-separated)",
    )
    g.add_argument(
        "--runtime-do-not-disrupt",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPOTRL_RUNTIME_DO_NOT_DISRUPT", d.runtime_do_not_disrupt),
        help="annotate the job's pods karpenter.sh/do-not-disrupt: \"true\", so that Karpenter's consolidation "
        "never drains a running job (a spot interruption still does, through the barrier) "
        "($SPOTRL_RUNTIME_DO_NOT_DISRUPT; default %(default)s)",
    )
    g.add_argument(
        "--runtime-safe-to-evict",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPOTRL_RUNTIME_SAFE_TO_EVICT", d.runtime_safe_to_evict),
        help='false: annotate the job\'s pods cluster-autoscaler.kubernetes.io/safe-to-evict: "false", so that '
        "the Cluster Autoscaler never scales their node down ($SPOTRL_RUNTIME_SAFE_TO_EVICT; default %(default)s)",
    )
    _add_pairs(g, "--runtime-pod-annotation", "KEY=VALUE", "annotation of every runtime pod (repeatable)")
    _add_pairs(
        g,
        "--runtime-pod-label",
        "KEY=VALUE",
        "label of every runtime pod (repeatable), e.g. azure.workload.identity/use=true; not spotrl.dev/ or "
        "app.kubernetes.io/ keys (the operator's own)",
    )
    _add_pairs(
        g,
        "--runtime-service-account-annotation",
        "KEY=VALUE",
        "annotation of each job's ServiceAccount <job>-runtime, which its pods run as (repeatable): a cloud "
        "identity for S3 without keys, e.g. eks.amazonaws.com/role-arn=arn:aws:iam::111122223333:role/spotrl",
    )
    g.add_argument(
        "--controller-requests",
        default=_env("SPOTRL_CONTROLLER_REQUESTS", ",".join(f"{k}={v}" for k, v in d.controller_requests.items())),
        metavar="cpu=Q,memory=Q",
        help="requests of a controller pod whose RLJob sets none; a pod's memory limit is its memory request "
        "(default %(default)s; $SPOTRL_CONTROLLER_REQUESTS)",
    )
    g.add_argument(
        "--worker-requests",
        default=_env("SPOTRL_WORKER_REQUESTS", ",".join(f"{k}={v}" for k, v in d.worker_requests.items())),
        metavar="cpu=Q,memory=Q",
        help="requests of a worker pod whose RLJob sets none (default %(default)s; $SPOTRL_WORKER_REQUESTS)",
    )
    g.add_argument(
        "--allowed-images",
        default=_env("SPOTRL_ALLOWED_IMAGES"),
        metavar="PREFIX,...",
        help="image prefixes spec.scheduling.image may start with, e.g. registry.example.com/ml/; "
        "default: only the runtime image's repository; '*': any ($SPOTRL_ALLOWED_IMAGES)",
    )
    g.add_argument(
        "--reward-import-prefixes",
        default=_env(IMPORT_PREFIXES_VAR, ",".join(DEFAULT_IMPORT_PREFIXES)),
        metavar="PREFIX,...",
        help="module prefixes spec.reward.importPath may name (a.b allows a.b and a.b.*); empty: none, "
        "built-in rewards by name only; '*': any (default %(default)s; $SPOTRL_REWARD_IMPORT_PREFIXES)",
    )
    g.add_argument(
        "--retention-image",
        default=_env("SPOTRL_RETENTION_IMAGE", d.retention_image),
        help="image of the pod that deletes a job's cuts for retentionPolicy Delete; the chart sets the "
        "operator's own ($SPOTRL_RETENTION_IMAGE)",
    )
    g.add_argument(
        "--no-network-policy",
        dest="network_policy",
        action="store_false",
        help="do not give each job a NetworkPolicy",
    )
    g.add_argument(
        "--metrics-from",
        default=_env("SPOTRL_METRICS_FROM"),
        metavar="JSON",
        help="NetworkPolicy peers (a JSON list) allowed to scrape the controllers' /metrics; "
        'default: [{"namespaceSelector": {}}], any pod ($SPOTRL_METRICS_FROM)',
    )
    g.add_argument(
        "--kueue",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPOTRL_KUEUE", False),
        help="queue RLJobs labelled kueue.x-k8s.io/queue-name through Kueue: a Workload per job, "
        "admitted before any pod starts, a barrier cut when Kueue evicts it ($SPOTRL_KUEUE)",
    )
    g = p.add_argument_group("preemption signals")
    g.add_argument(
        "--extra-taint-key",
        action="append",
        default=_list(_env("SPOTRL_EXTRA_TAINT_KEYS")),
        metavar="PATTERN",
        help="taint key (fnmatch pattern) that announces a node's end, besides the well-known handlers' "
        "(repeatable; $SPOTRL_EXTRA_TAINT_KEYS, comma-separated)",
    )
    _add_pairs(
        g,
        "--deadline-cap",
        "PROVIDER=SECONDS",
        "cap the barrier deadline for a notice provider (gke, aks, karpenter, aws-node-termination-handler, "
        "cordon, disruption-target, node-not-ready, node-deleted, taint); default: "
        + ", ".join(f"{k}={v}" for k, v in DEFAULT_DEADLINE_CAPS.items()),
    )
    g = p.add_argument_group("operator")
    g.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        default=_list(_env("SPOTRL_WATCH_NAMESPACES")),
        metavar="NS",
        help="watch only this namespace (repeatable; $SPOTRL_WATCH_NAMESPACES, comma-separated); default: all",
    )
    g.add_argument(
        "--refused-namespace",
        action="append",
        dest="refused_namespaces",
        default=_list(_env("SPOTRL_REFUSED_NAMESPACES")),
        metavar="NS",
        help="run no RLJob in this namespace and make nothing there: a job there fails, saying why (repeatable; "
        "$SPOTRL_REFUSED_NAMESPACES, comma-separated); default: none",
    )
    g.add_argument(
        "--reconcile-interval",
        type=float,
        default=_env_number("SPOTRL_RECONCILE_INTERVAL", d.reconcile_interval, float),
        help="seconds between two passes over a job when no event wakes it earlier ($SPOTRL_RECONCILE_INTERVAL)",
    )
    g.add_argument(
        "--finalizer-seconds",
        type=float,
        default=_env_number("SPOTRL_FINALIZER_SECONDS", d.finalizer_seconds, float),
        help="a deleted RLJob is let go within this long, its cuts deleted or not (then a CutsNotDeleted "
        "Event says where they stay) ($SPOTRL_FINALIZER_SECONDS; default %(default)s)",
    )
    g.add_argument(
        "--kube-qps",
        type=float,
        default=_env_number("SPOTRL_KUBE_QPS", d.kube_qps, float),
        help="requests a second to the API server at most, 0: no limit ($SPOTRL_KUBE_QPS; default %(default)s)",
    )
    g.add_argument(
        "--kube-burst",
        type=int,
        default=_env_number("SPOTRL_KUBE_BURST", d.kube_burst, int),
        help="requests allowed at once above --kube-qps ($SPOTRL_KUBE_BURST; default %(default)s)",
    )
    g.add_argument(
        "--node-lost-seconds",
        type=float,
        default=_env_number("SPOTRL_NODE_LOST_SECONDS", d.node_lost_seconds, float),
        help="a node Ready Unknown (or tainted unreachable) this long is lost and its pods force-deleted "
        "($SPOTRL_NODE_LOST_SECONDS; default %(default)s)",
    )
    g.add_argument(
        "--unhealthy-node-share",
        type=float,
        default=_env_number("SPOTRL_UNHEALTHY_NODE_SHARE", d.unhealthy_node_share, float),
        help="in a zone with at least this share of its nodes not Ready (and 3), force deletes pause "
        "($SPOTRL_UNHEALTHY_NODE_SHARE; default %(default)s)",
    )
    g.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="run without the Lease (only ever with one replica)",
    )
    g.add_argument(
        "--lease-name", default=_env("SPOTRL_LEASE_NAME", d.lease_name), help="leader Lease ($SPOTRL_LEASE_NAME)"
    )
    g.add_argument(
        "--lease-namespace",
        default=_env("SPOTRL_LEASE_NAMESPACE", _env("POD_NAMESPACE", d.lease_namespace)),
        help="namespace of the leader Lease ($SPOTRL_LEASE_NAMESPACE, then $POD_NAMESPACE)",
    )
    g.add_argument(
        "--identity",
        default=_env("SPOTRL_IDENTITY", _env("POD_NAME", d.identity)),
        help="this replica's name in the Lease ($SPOTRL_IDENTITY, then $POD_NAME, then <host>-<random>)",
    )
    g.add_argument(
        "--lease-seconds",
        type=float,
        default=d.lease_seconds,
        help="a leader silent for this long is replaced (default %(default)s)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=_env_number("SPOTRL_METRICS_PORT", d.metrics_port, int),
        help="Prometheus /metrics port, 0: off ($SPOTRL_METRICS_PORT)",
    )
    g.add_argument(
        "--metrics-address",
        default=_env("SPOTRL_METRICS_ADDRESS", _env("POD_IP", d.metrics_address)),
        help="address to bind /metrics ($SPOTRL_METRICS_ADDRESS, then $POD_IP, then 0.0.0.0)",
    )
    g.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG, ~/.kube/config, then in-cluster")
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    g.add_argument(
        "--log-writes", action="store_true", help="log every write sent to the API server (an audit of who acted when)"
    )


def from_args(args: argparse.Namespace) -> Settings:
    """The settings the parsed flags describe. Raises SystemExit naming a malformed flag."""
    caps = dict(DEFAULT_DEADLINE_CAPS)
    for key, value in _pairs(args.deadline_cap, "--deadline-cap").items():
        try:
            caps[key] = int(value)
        except ValueError:
            raise SystemExit(f"--deadline-cap {key}={value}: SECONDS must be an integer") from None
    if args.reconcile_interval <= 0:
        raise SystemExit("--reconcile-interval must be above 0")
    if args.lease_seconds < 3:
        raise SystemExit("--lease-seconds must be at least 3")
    if not 0 < args.finalizer_seconds <= FINALIZER_SECONDS_MAX:
        raise SystemExit(
            f"--finalizer-seconds must be above 0 and at most {FINALIZER_SECONDS_MAX:.0f} (Kopf's own bound on the "
            "finalizer, an hour, stays behind it)"
        )
    if args.kube_qps < 0 or args.kube_burst < 1:
        raise SystemExit("--kube-qps must be 0 or more and --kube-burst at least 1")
    if args.node_lost_seconds < 0:
        raise SystemExit("--node-lost-seconds must be 0 or more")
    if not 0 < args.unhealthy_node_share <= 1:
        raise SystemExit("--unhealthy-node-share must be above 0 and at most 1")
    return Settings(
        runtime_image=args.runtime_image,
        image_pull_policy=args.image_pull_policy,
        default_storage=args.default_storage,
        default_s3_endpoint=args.default_s3_endpoint,
        default_credentials_secret=args.default_credentials_secret,
        extra_taint_keys=tuple(args.extra_taint_key),
        extra_env=_pairs(args.runtime_env, "--runtime-env"),
        locked_env=frozenset(args.runtime_env_locked),
        deadline_caps=caps,
        controller_requests=_requests(args.controller_requests, "--controller-requests"),
        worker_requests=_requests(args.worker_requests, "--worker-requests"),
        allowed_images=tuple(_list(args.allowed_images)),
        reward_import_prefixes=tuple(_list(args.reward_import_prefixes)),
        retention_image=args.retention_image,
        network_policy=args.network_policy,
        metrics_from=_peers(args.metrics_from),
        runtime_do_not_disrupt=args.runtime_do_not_disrupt,
        runtime_safe_to_evict=args.runtime_safe_to_evict,
        runtime_pod_annotations=_pairs(args.runtime_pod_annotation, "--runtime-pod-annotation"),
        runtime_pod_labels=_own_keys_refused(
            _pairs(args.runtime_pod_label, "--runtime-pod-label"), "--runtime-pod-label"
        ),
        runtime_service_account_annotations=_pairs(
            args.runtime_service_account_annotation, "--runtime-service-account-annotation"
        ),
        kueue=args.kueue,
        namespaces=tuple(args.namespaces),
        refused_namespaces=tuple(args.refused_namespaces),
        reconcile_interval=args.reconcile_interval,
        finalizer_seconds=args.finalizer_seconds,
        kube_qps=args.kube_qps,
        kube_burst=args.kube_burst,
        node_lost_seconds=args.node_lost_seconds,
        unhealthy_node_share=args.unhealthy_node_share,
        leader_election=args.leader_election,
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace,
        identity=args.identity,
        lease_seconds=args.lease_seconds,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        kubeconfig=args.kubeconfig,
        verbose=args.verbose,
        log_writes=args.log_writes,
    )
