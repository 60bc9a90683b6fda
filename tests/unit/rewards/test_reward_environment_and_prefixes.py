"""What a reward's process may reach (rewards/isolation.py): its environment, from an allow-list
(no storage keys, runtime settings or cluster variables), and the module prefixes the admin allows."""

from __future__ import annotations

import pytest

from spotrl_runtime.rewards.isolation import (
    DEFAULT_IMPORT_PREFIXES,
    RewardIsolation,
    child_environment,
    import_allowed,
    import_refusal,
)

POD = {
    "PATH": "/opt/spotrl/bin:/usr/bin",
    "HOME": "/home/spotrl",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONPATH": "/opt/my_rewards",
    "PYTHONUNBUFFERED": "1",
    # The chart's default credentials Secret, by envFrom, and the storage's settings:
    "AWS_ACCESS_KEY_ID": "AKIA-id",
    "AWS_SECRET_ACCESS_KEY": "the-secret-key",
    "AWS_SESSION_TOKEN": "a-session",
    "AWS_ENDPOINT_URL": "http://s3:9000",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
    "AWS_ROLE_ARN": "arn:aws:iam::1:role/r",
    "SPOTRL_STORAGE": "s3://bucket/team/job",
    "SPOTRL_JOB": "job",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "MINIO_ROOT_PASSWORD": "another-key-of-the-secret",
    "VIRTUAL_ENV": "/opt/spotrl",
    # The job's runtimeEnv and the chart's:
    "HF_TOKEN": "hf-token",
    "REWARD_MODEL_URL": "http://judge",
    "HTTPS_PROXY": "http://proxy:3128",
}


def test_the_reward_gets_what_python_needs_and_the_jobs_runtime_env_and_nothing_else() -> None:
    env = child_environment(POD, ["HF_TOKEN", "REWARD_MODEL_URL"])
    assert env == {
        "PATH": "/opt/spotrl/bin:/usr/bin",
        "HOME": "/home/spotrl",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": "/tmp",
        "PYTHONPATH": "/opt/my_rewards",
        "PYTHONUNBUFFERED": "1",
        "HF_TOKEN": "hf-token",
        "REWARD_MODEL_URL": "http://judge",
    }


def test_runtime_env_cannot_name_a_storage_runtime_or_cluster_variable_into_the_reward() -> None:
    """The job's own AWS_* configure the storage's client as well (they replace the Secret's)."""
    names = ["AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "SPOTRL_STORAGE", "KUBERNETES_SERVICE_HOST", "HF_TOKEN"]
    assert child_environment(POD, names).keys() - child_environment(POD, []).keys() == {"HF_TOKEN"}


def test_the_operator_lists_the_charts_runtime_env_and_the_allowed_prefixes() -> None:
    pod = {
        **POD,
        "SPOTRL_REWARD_ENV_NAMES": "HTTPS_PROXY, AWS_ACCESS_KEY_ID",
        "SPOTRL_REWARD_IMPORT_PREFIXES": "spotrl_runtime.rewards,team_a.rewards",
    }
    isolation = RewardIsolation.of(pod, iter(["HF_TOKEN"]))
    assert isolation.env == {**child_environment(POD, []), "HF_TOKEN": "hf-token", "HTTPS_PROXY": "http://proxy:3128"}
    assert isolation.import_prefixes == ("spotrl_runtime.rewards", "team_a.rewards")
    assert RewardIsolation.of({**pod, "SPOTRL_REWARD_IMPORT_PREFIXES": ""}, []).import_prefixes == (), "none allowed"
    assert RewardIsolation.of(POD, []).import_prefixes is None, "a local run (no operator): any module"


@pytest.mark.parametrize(
    ("module", "prefixes", "allowed"),
    [
        ("spotrl_runtime.rewards.builtin", DEFAULT_IMPORT_PREFIXES, True),
        ("spotrl_rewards", DEFAULT_IMPORT_PREFIXES, True),
        ("spotrl_rewards.team_a.score", DEFAULT_IMPORT_PREFIXES, True),
        ("spotrl_rewardsx.score", DEFAULT_IMPORT_PREFIXES, False),
        ("spotrl_runtime.storage", DEFAULT_IMPORT_PREFIXES, False),
        ("os", DEFAULT_IMPORT_PREFIXES, False),
        ("os", ("*",), True),
        ("os", None, True),
        ("spotrl_rewards", (), False),
    ],
)
def test_a_prefix_allows_its_module_and_those_below_it(
    module: str, prefixes: tuple[str, ...] | None, allowed: bool
) -> None:
    assert import_allowed(module, prefixes) is allowed


def test_a_refusal_names_the_field_the_prefixes_and_who_to_ask() -> None:
    assert import_refusal("spotrl_rewards.a:f", DEFAULT_IMPORT_PREFIXES) is None
    assert import_refusal("probe:leaks", DEFAULT_IMPORT_PREFIXES) == (
        "spec.reward.importPath 'probe:leaks': module 'probe' is not allowed on this cluster (allowed module "
        "prefixes: spotrl_runtime.rewards, spotrl_rewards); put the reward in a package under one of them, or ask "
        "the cluster's admin to add its prefix to the chart value rewards.allowedImportPrefixes"
    )
