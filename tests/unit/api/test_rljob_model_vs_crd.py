"""The Python model and the CRD accept and reject the same RLJob documents.

Each bad document names the field the error must point at; both validators must name it.
"""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import pytest
import yaml

from spotrl_e2e.crd_emulation import api_server_errors
from spotrl_runtime.api import crd as crdgen
from spotrl_runtime.api.rljob import RLJob, SpecError, parse_rljob
from spotrl_runtime.api.rules import JOB_NAME_MAX, JOB_NAME_RULE, job_name_ok

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

MINIMAL: dict[str, Any] = {
    "apiVersion": "spotrl.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "t"},
    "spec": {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 3},
    },
}


def with_(path: str, value: Any, base: dict[str, Any] = MINIMAL) -> dict[str, Any]:
    """A copy of `base` with the dotted `path` set to `value` (or removed if value is DELETE)."""
    doc = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return doc


DELETE = object()

_GPU_TRAINING = {"totalSteps": 3, "resources": {"gpu": 1}}
_VLLM_TP2 = {"backend": "vllm", "tensorParallelSize": 2, "resources": {"gpu": 2}}

GOOD = {
    "minimal": MINIMAL,
    "vllm-workers-with-their-gpus-in-a-gpu-pod": with_(
        "spec.generation",
        {"backend": "vllm", "workers": 2, "tensorParallelSize": 2, "maxModelLen": 4096, "resources": {"gpu": 2}},
        with_("spec.training", _GPU_TRAINING),
    ),
    "lora-with-vllm-on-one-gpu": with_(
        "spec.policy.lora",
        {"rank": 16},
        with_("spec.generation", {**_VLLM_TP2, "tensorParallelSize": 1, "resources": {"gpu": 1}}),
    ),
    "tensor-parallel-vllm-without-lora": with_("spec.generation", _VLLM_TP2),
    "validation": with_("spec.validation", {"dataset": "builtin:arithmetic", "everySteps": 5, "limit": 32}),
    "vllm-with-gpu": with_("spec.generation", {"backend": "vllm", "resources": {"gpu": 1}}),
    "truncated-importance-sampling": with_("spec.training", {"totalSteps": 5, "importanceSamplingCap": 2.0}),
    "vllm-on-cpu": with_("spec.generation", {"backend": "vllm", "kvCacheMemory": "256Mi", "threads": 2}),
    "import-path-reward": with_("spec.reward", {"importPath": "my_pkg.rewards:score"}),
    "batched-reward-with-timeout": with_(
        "spec.reward", {"importPath": "my_pkg.rewards:judge", "batched": True, "timeoutSeconds": 120}
    ),
    "math-verify-reward": with_("spec.reward", {"name": "math_verify", "timeoutSeconds": 5}),
    "reward-workers": with_("spec.reward", {"name": "math_verify", "workers": 4}),
    "batched-reward-one-worker": with_(
        "spec.reward", {"importPath": "my_pkg.rewards:judge", "batched": True, "workers": 1}
    ),
    "chat-prompts": with_(
        "spec.dataset",
        {"uri": "s3://b/gsm8k/train.parquet", "promptField": "messages", "promptFormat": "chat", "systemPrompt": "Hi"},
    ),
    "dr-grpo": with_(
        "spec.training",
        {
            "totalSteps": 3,
            "advantage": {"estimator": "grpo", "normalizeByStd": False},
            "lossAggregation": "seq-mean-token-sum-norm",
        },
    ),
    "rloo-seq-mean": with_(
        "spec.training",
        {"totalSteps": 3, "advantage": {"estimator": "rloo"}, "lossAggregation": "seq-mean-token-mean"},
    ),
    "reinforce-plus-plus-baseline": with_(
        "spec.training", {"totalSteps": 3, "advantage": {"estimator": "reinforce++-baseline"}}
    ),
    "dapo-overlong": with_(
        "spec.training",
        {"totalSteps": 3, "overlong": {"filter": True, "softPenalty": {"buffer": 4, "factor": 1.0}}},
        with_("spec.generation", {"maxNewTokens": 16}),
    ),
    "dapo-dynamic-sampling": with_(
        "spec.training", {"totalSteps": 3, "sampling": {"dynamic": {"filter": "zero-std", "maxRounds": 3}}}
    ),
    "float32-lm-head": with_("spec.training", {"totalSteps": 3, "precision": {"lmHead": "float32"}}),
    "kl-in-reward": with_(
        "spec.training", {"totalSteps": 3, "klCoef": 0.05, "kl": {"inReward": True, "estimator": "k1"}}
    ),
    "rollout-correction-sequence-mask": with_(
        "spec.training",
        {"totalSteps": 3, "importanceSampling": {"level": "sequence", "mode": "mask"}, "kl": {"estimator": "k1"}},
    ),
    "dynamic-sampling-defaults": with_("spec.training", {"totalSteps": 3, "sampling": {"dynamic": {}}}),
    "ppo-mini-batches": with_(
        "spec.training",
        {"totalSteps": 3, "miniBatches": 4, "epochs": 2, "clipEpsilonHigh": 0.28},
        with_("spec.generation", {"promptsPerStep": 8}),
    ),
    "seconds-only-cuts": with_("spec.checkpoint", {"everySteps": 0, "everySeconds": 300}),
    "s3-with-endpoint": with_(
        "spec.checkpoint", {"storage": "s3://bucket-a/run1", "s3Endpoint": "http://127.0.0.1:7070"}
    ),
    "replace-with-spares": with_("spec.preemption", {"onDroppedPrompt": "replace", "sparePoolBatches": 2}),
    "micro-batch-equals-step": with_(
        "spec.training", {"totalSteps": 3, "microBatchSize": 32}, with_("spec.generation", {"groupSize": 4})
    ),
    "tolerations": with_(
        "spec.scheduling", {"tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}
    ),
    "explicit-null-optional": with_("spec.checkpoint", {"storage": None}),
    "worker-pods": with_(
        "spec.generation", {"workers": 2, "workerPods": True, "resources": {"cpu": "2", "memory": "4Gi"}}
    ),
    "quantities": with_("spec.training.resources", {"cpu": "500m", "memory": "1.5Gi"}),
    "placement": with_(
        "spec.scheduling",
        {
            "schedulerName": "kai-scheduler",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}
                                ]
                            },
                            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
                        ]
                    },
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 50,
                            "preference": {"matchExpressions": [{"key": "n", "operator": "Gt", "values": ["3"]}]},
                        }
                    ],
                },
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"spotrl.dev/job": "t"}},
                            },
                        }
                    ]
                },
            },
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
            ],
        },
    ),
}

# name -> (document, field path both validators must name)
BAD = {
    "vllm-workers-in-a-gpu-pod-without-gpus": (
        with_("spec.generation", {"backend": "vllm", "workers": 2}, with_("spec.training", _GPU_TRAINING)),
        "spec.generation.resources.gpu",
    ),
    "vllm-gpus-not-its-tensor-parallel-size": (
        with_("spec.generation", {"backend": "vllm", "tensorParallelSize": 2, "resources": {"gpu": 1}}),
        "spec.generation.resources.gpu",
    ),
    "max-model-len-not-above-max-new-tokens": (
        with_("spec.generation", {"maxModelLen": 64, "maxNewTokens": 64}),
        "spec.generation.maxModelLen",
    ),
    "tensor-parallel-transformers": (
        with_("spec.generation", {"tensorParallelSize": 2}),
        "spec.generation.tensorParallelSize",
    ),
    "lora-with-tensor-parallel-vllm": (
        with_("spec.policy.lora", {"rank": 16}, with_("spec.generation", _VLLM_TP2)),
        "spec.generation.tensorParallelSize",
    ),
    "fsdp-ranks-in-pod-without-their-gpus": (
        with_(
            "spec.training",
            {**_GPU_TRAINING, "parallelism": {"strategy": "fsdp", "ranks": 2, "gpusPerRank": 1}},
        ),
        "spec.training.resources.gpu",
    ),
    "validation-every-zero-steps": (
        with_("spec.validation", {"dataset": "builtin:arithmetic", "everySteps": 0}),
        "spec.validation.everySteps",
    ),
    "validation-without-dataset": (with_("spec.validation", {"everySteps": 5}), "spec.validation.dataset"),
    "missing-policy": (with_("spec.policy", DELETE), "spec.policy"),
    "missing-total-steps": (with_("spec.training", {}), "spec.training.totalSteps"),
    "group-size-1": (with_("spec.generation", {"groupSize": 1}), "spec.generation.groupSize"),
    "wrong-type": (with_("spec.generation", {"promptsPerStep": "eight"}), "spec.generation.promptsPerStep"),
    "unknown-backend": (with_("spec.generation", {"backend": "tgi"}), "spec.generation.backend"),
    "float16-policy": (with_("spec.policy", {"model": "builtin:tiny-arith", "dtype": "float16"}), "spec.policy.dtype"),
    "unknown-on-error": (
        with_("spec.reward", {"name": "arithmetic_exact", "onError": "zero"}),
        "spec.reward.onError",
    ),
    "normalize-by-std-with-rloo": (
        with_("spec.training", {"totalSteps": 3, "advantage": {"estimator": "rloo", "normalizeByStd": False}}),
        "spec.training.advantage.normalizeByStd",
    ),
    "unknown-estimator": (
        with_("spec.training", {"totalSteps": 3, "advantage": {"estimator": "ppo"}}),
        "spec.training.advantage.estimator",
    ),
    "unknown-loss-aggregation": (
        with_("spec.training", {"totalSteps": 3, "lossAggregation": "seq-sum"}),
        "spec.training.lossAggregation",
    ),
    "overlong-buffer-not-below-max-new-tokens": (
        with_(
            "spec.training",
            {"totalSteps": 3, "overlong": {"softPenalty": {"buffer": 16}}},
            with_("spec.generation", {"maxNewTokens": 16}),
        ),
        "spec.training.overlong.softPenalty.buffer",
    ),
    "kl-in-reward-without-a-coefficient": (
        with_("spec.training", {"totalSteps": 3, "kl": {"inReward": True}}),
        "spec.training.kl.inReward",
    ),
    "overlong-filter-not-a-bool": (
        with_("spec.training", {"totalSteps": 3, "overlong": {"filter": "yes"}}),
        "spec.training.overlong.filter",
    ),
    "importance-sampling-unknown-level": (
        with_("spec.training", {"totalSteps": 3, "importanceSampling": {"level": "turn"}}),
        "spec.training.importanceSampling.level",
    ),
    "lm-head-unknown-dtype": (
        with_("spec.training", {"totalSteps": 3, "precision": {"lmHead": "bfloat16"}}),
        "spec.training.precision.lmHead",
    ),
    "kl-unknown-estimator": (
        with_("spec.training", {"totalSteps": 3, "kl": {"estimator": "k4"}}),
        "spec.training.kl.estimator",
    ),
    "dynamic-sampling-unknown-filter": (
        with_("spec.training", {"totalSteps": 3, "sampling": {"dynamic": {"filter": "acc"}}}),
        "spec.training.sampling.dynamic.filter",
    ),
    "dynamic-sampling-no-rounds": (
        with_("spec.training", {"totalSteps": 3, "sampling": {"dynamic": {"maxRounds": 0}}}),
        "spec.training.sampling.dynamic.maxRounds",
    ),
    "mini-batches-above-the-step": (
        with_("spec.training", {"totalSteps": 3, "miniBatches": 9}, with_("spec.generation", {"promptsPerStep": 8})),
        "spec.training.miniBatches",
    ),
    "zero-epochs": (with_("spec.training", {"totalSteps": 3, "epochs": 0}), "spec.training.epochs"),
    "schedule-unknown": (with_("spec.training", {"totalSteps": 4, "lrSchedule": "linear"}), "spec.training.lrSchedule"),
    "unknown-field": (with_("spec.generation", {"grupSize": 4}), "spec.generation"),
    "negative-lookahead": (with_("spec.generation", {"lookahead": -1}), "spec.generation.lookahead"),
    "temperature-zero": (with_("spec.generation", {"temperature": 0}), "spec.generation.temperature"),
    "fraction-above-one": (with_("spec.preemption", {"minStepFraction": 1.5}), "spec.preemption.minStepFraction"),
    "replace-without-spares": (
        with_("spec.preemption", {"onDroppedPrompt": "replace"}),
        "spec.preemption.sparePoolBatches",
    ),
    "kv-cache-not-a-quantity": (
        with_("spec.generation", {"backend": "vllm", "kvCacheMemory": "lots"}),
        "spec.generation.kvCacheMemory",
    ),
    "negative-threads": (with_("spec.generation", {"threads": -1}), "spec.generation.threads"),
    "importance-cap-below-one": (
        with_("spec.training", {"totalSteps": 5, "importanceSamplingCap": 0.5}),
        "spec.training.importanceSamplingCap",
    ),
    "two-rewards": (
        with_("spec.reward", {"name": "arithmetic_exact", "importPath": "a.b:c"}),
        "spec.reward.name",
    ),
    "no-reward": (with_("spec.reward", {}), "spec.reward.name"),
    "system-prompt-without-chat": (
        with_("spec.dataset", {"uri": "builtin:arithmetic", "systemPrompt": "Be brief."}),
        "spec.dataset.systemPrompt",
    ),
    "unknown-prompt-format": (
        with_("spec.dataset", {"uri": "builtin:arithmetic", "promptFormat": "alpaca"}),
        "spec.dataset.promptFormat",
    ),
    "batched-builtin-reward": (with_("spec.reward", {"name": "gsm8k", "batched": True}), "spec.reward.batched"),
    "batched-reward-with-workers": (
        with_("spec.reward", {"importPath": "my_pkg.rewards:judge", "batched": True, "workers": 2}),
        "spec.reward.workers",
    ),
    "reward-workers-zero": (with_("spec.reward", {"name": "gsm8k", "workers": 0}), "spec.reward.workers"),
    "reward-timeout-zero": (with_("spec.reward", {"name": "gsm8k", "timeoutSeconds": 0}), "spec.reward.timeoutSeconds"),
    "bad-import-path": (with_("spec.reward", {"importPath": "not a path"}), "spec.reward.importPath"),
    "no-periodic-cuts": (
        with_("spec.checkpoint", {"everySteps": 0, "everySeconds": 0}),
        "spec.checkpoint.everySteps",
    ),
    "endpoint-without-s3": (
        with_("spec.checkpoint", {"storage": "/data/cuts", "s3Endpoint": "http://x:1"}),
        "spec.checkpoint.s3Endpoint",
    ),
    "bad-bucket": (with_("spec.checkpoint", {"storage": "s3://B"}), "spec.checkpoint.storage"),
    "deadline-too-short": (
        with_("spec.checkpoint", {"barrierDeadlineSeconds": 1}),
        "spec.checkpoint.barrierDeadlineSeconds",
    ),
    "micro-batch-too-big": (
        with_("spec.training", {"totalSteps": 3, "microBatchSize": 33}, with_("spec.generation", {"groupSize": 4})),
        "spec.training.microBatchSize",
    ),
    "bad-quantity": (with_("spec.training.resources", {"cpu": "two"}), "spec.training.resources.cpu"),
    "bad-toleration-operator": (
        with_("spec.scheduling", {"tolerations": [{"key": "k", "operator": "In"}]}),
        "spec.scheduling.tolerations[0].operator",
    ),
    "worker-pods-as-a-string": (
        with_("spec.generation", {"workerPods": "true"}),
        "spec.generation.workerPods",
    ),
    "affinity-exists-with-values": (
        with_(
            "spec.scheduling.affinity",
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["a"]}]}
                        ]
                    }
                }
            },
        ),
        "spec.scheduling.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].values",
    ),
    "affinity-in-without-values": (
        with_(
            "spec.scheduling.affinity",
            {
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}
                    ]
                }
            },
        ),
        "spec.scheduling.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
        ".labelSelector.matchExpressions[0].values",
    ),
    "affinity-without-terms": (
        with_(
            "spec.scheduling.affinity",
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
        ),
        "spec.scheduling.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
    ),
    "spread-without-skew": (
        with_(
            "spec.scheduling.topologySpreadConstraints",
            [{"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
        ),
        "spec.scheduling.topologySpreadConstraints[0].maxSkew",
    ),
    "empty-scheduler-name": (with_("spec.scheduling", {"schedulerName": ""}), "spec.scheduling.schedulerName"),
    "unknown-algorithm": (with_("spec.training", {"totalSteps": 3, "algorithm": "ppo"}), "spec.training.algorithm"),
}


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load((ROOT / crdgen.CRD_FILE).read_text())


def _normalise(path: str) -> str:
    # jsonschema writes list indices as ".0"; the model writes "[0]".
    parts = []
    for p in path.split("."):
        if p.isdigit() and parts:
            parts[-1] += f"[{p}]"
        else:
            parts.append(p)
    return ".".join(parts)


def test_committed_crd_is_generated_from_the_model(crd: dict[str, Any]) -> None:
    assert crd == yaml.safe_load(crdgen.crd_yaml()), "crds/ is stale: run `make generate`"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted_by_both(crd: dict[str, Any], path: pathlib.Path) -> None:
    doc = yaml.safe_load(path.read_text())
    parse_rljob(doc)
    assert api_server_errors(crd, doc) == []


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_documents_are_accepted_by_both(crd: dict[str, Any], name: str) -> None:
    doc = GOOD[name]
    parse_rljob(doc)
    assert api_server_errors(crd, doc) == []


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_documents_are_rejected_by_both_naming_the_field(crd: dict[str, Any], name: str) -> None:
    doc, field = BAD[name]
    with pytest.raises(SpecError) as info:
        parse_rljob(doc)
    model_paths = [p for p, _ in info.value.problems]
    assert any(p.startswith(field) for p in model_paths), (model_paths, field)

    server = api_server_errors(crd, doc)
    assert server, f"the CRD accepted {name}"
    server_paths = [_normalise(p) for p, _ in server]
    # The schema names a missing or unknown field by its parent object, so accept the parent.
    parent = field.rsplit(".", 1)[0]
    assert any(p.startswith(field) or p == parent for p in server_paths), (server_paths, field)


def test_lora_with_tensor_parallelism_is_refused_naming_both_fields_and_what_to_do(crd: dict[str, Any]) -> None:
    """The adapter reaches a worker once, a tensor-parallel engine is a channel member per rank:
    such a job would never sync, so both validators refuse it with one message."""
    doc, _ = BAD["lora-with-tensor-parallel-vllm"]
    with pytest.raises(SpecError) as info:
        parse_rljob(doc)
    (server_msg,) = [m for _, m in api_server_errors(crd, doc)]
    assert server_msg in [m for _, m in info.value.problems]
    for words in ("policy.lora", "generation.tensorParallelSize", "set generation.tensorParallelSize to 1"):
        assert words in server_msg


def test_rule_messages_are_identical_in_model_and_crd(crd: dict[str, Any]) -> None:
    doc, _ = BAD["replace-without-spares"]
    with pytest.raises(SpecError) as info:
        parse_rljob(doc)
    (server_msg,) = [m for _, m in api_server_errors(crd, doc)]
    assert server_msg in [m for _, m in info.value.problems]


def test_defaults_match(crd: dict[str, Any]) -> None:
    """What the API server stores after defaulting, the model reads as the same spec."""
    from spotrl_e2e.crd_emulation import _prune_and_default

    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = _prune_and_default(schema, copy.deepcopy(MINIMAL))
    assert parse_rljob(defaulted).spec == parse_rljob(MINIMAL).spec
    assert defaulted["spec"]["generation"]["groupSize"] == parse_rljob(MINIMAL).spec.generation.group_size


def test_error_message_names_field_and_what_is_allowed() -> None:
    doc, _ = BAD["group-size-1"]
    with pytest.raises(SpecError, match=r"spec\.generation\.groupSize: Input should be greater than or equal to 2"):
        parse_rljob(doc)


def test_wrong_kind_and_api_version_are_named() -> None:
    with pytest.raises(SpecError) as info:
        parse_rljob({**MINIMAL, "apiVersion": "batch/v1", "kind": "Job"})
    assert [p for p, _ in info.value.problems] == ["apiVersion", "kind"]


# metadata.name: the root rule (JOB_NAME_RULE). parse_rljob takes any DNS-1123 subdomain (a local
# `spotrl run` needs no Service); the CRD refuses what the operator cannot make a job's objects for.
JOB_NAMES_OK = ["t", "tiny-arith", "a1-b2", "x" * JOB_NAME_MAX]
JOB_NAMES_REFUSED = ["job.v2", "0-start-with-digit", "Tiny", "x" * (JOB_NAME_MAX + 1), "tiny-", "-tiny", "tiny_job"]


@pytest.mark.parametrize("name", JOB_NAMES_OK + JOB_NAMES_REFUSED)
def test_job_name_predicate_and_the_crds_rule_agree(crd: dict[str, Any], name: str) -> None:
    doc = with_("metadata.name", name)
    ok = name in JOB_NAMES_OK
    assert job_name_ok(name) is ok
    assert JOB_NAME_RULE.check(RLJob.model_validate(doc)) is ok
    server = api_server_errors(crd, doc)
    assert server == ([] if ok else [("", JOB_NAME_RULE.message)])


def test_job_name_predicate_refuses_what_is_not_a_string() -> None:
    assert not job_name_ok(None)
    assert not job_name_ok(7)
    assert not job_name_ok("")


def test_job_name_rule_says_the_field_what_is_allowed_and_what_to_do(crd: dict[str, Any]) -> None:
    message = JOB_NAME_RULE.message
    assert message.startswith("metadata.name ")
    assert f"at most {JOB_NAME_MAX} characters" in message
    assert "pick a shorter name of lowercase letters, digits and '-', starting with a letter" in message
    (rule,) = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert rule["message"] == message
    assert rule["optionalOldSelf"] is True, "checked on create: an older job must stay deletable"
    assert rule["rule"] == f"oldSelf.hasValue() || ({JOB_NAME_RULE.cel})"


def test_job_name_max_is_the_longest_name_every_object_of_the_job_accepts() -> None:
    """Every name and label value the operator derives from a job's name fits what Kubernetes
    allows it at JOB_NAME_MAX; one character more, the Service's name and the labels do not."""
    from spotrl_operator import queueing, resources
    from spotrl_operator.settings import Settings

    dns_label = r"[a-z]([-a-z0-9]*[a-z0-9])?"
    subdomain = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"

    def objects(job: str) -> list[dict[str, Any]]:
        ref = resources.JobRef(job, "team-a", "0b6f8f0e-5d1b-4c55-9a27-4d2b1c1d2e3f")
        spec = parse_rljob(MINIMAL).spec
        settings = Settings(default_storage="s3://bkt/spotrl")
        attempt = 10**6  # a million preemptions: a seven-digit attempt
        return [
            resources.service_account(ref, settings),
            resources.role(ref),
            resources.role_binding(ref),
            resources.service(ref),
            resources.network_policy(ref, settings),
            resources.disruption_budget(ref, open_=False, trainers=2),
            resources.controller_pod(ref, spec, settings, attempt),
            resources.worker_pod(ref, spec, settings, attempt, 1023, "h:6379"),
            resources.trainer_pod(ref, spec, settings, attempt, 1023, "h:6379"),
            resources.retention_pod(ref, spec, settings, "s3://bkt/x", attempt),
            resources.event({"name": job, "namespace": "team-a", "uid": ref.uid}, "Normal", "R", "m", "now", "op"),
            queueing.workload(ref, spec, settings, "queue", None),
        ]

    def problems(job: str) -> list[str]:
        out = []
        for obj in objects(job):
            meta = obj["metadata"]
            name, limit, pattern = meta["name"], 253, subdomain
            if obj["kind"] == "Service":
                limit, pattern = 63, dns_label
            if len(name) > limit or not re.fullmatch(pattern, name):
                out.append(f"{obj['kind']} {name}")
            out += [f"{obj['kind']} label {k}" for k, v in (meta.get("labels") or {}).items() if len(v) > 63]
        return out

    at_max = "j" * JOB_NAME_MAX
    assert job_name_ok(at_max)
    assert problems(at_max) == []
    over = problems(at_max + "j")
    assert "Service " + at_max + "j" in over
    assert "Pod label spotrl.dev/job" in over
