"""The admin's allow-list of reward modules (chart value rewards.allowedImportPrefixes): the
operator refuses a job whose spec.reward.importPath is outside it, and tells the controller pod
the list and the chart's runtimeEnv names (rewards/isolation.py), which no job can replace."""

from __future__ import annotations

import argparse

import pytest

from spotrl_operator import resources
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings, add_arguments, from_args
from spotrl_runtime.api.rljob import RLJobSpec, parse_spec

REF = JobRef("tiny", "team-a", "uid-1")


def _spec(reward: dict) -> RLJobSpec:
    return parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": reward,
            "training": {"totalSteps": 10},
        }
    )


def _settings(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(["--default-storage=s3://bkt/p", *argv]))


def test_the_default_allows_the_builtins_and_the_images_own_spotrl_rewards_package() -> None:
    settings = _settings()
    assert settings.reward_import_prefixes == ("spotrl_runtime.rewards", "spotrl_rewards")
    for ok in ({"name": "gsm8k"}, {"importPath": "spotrl_rewards.team_a:score"}, {"importPath": "spotrl_rewards:f"}):
        resources.check_job(REF, _spec(ok), settings)
    with pytest.raises(ValueError, match="not allowed") as err:
        resources.check_job(REF, _spec({"importPath": "probe:leaks"}), settings)
    assert str(err.value) == (
        "spec.reward.importPath 'probe:leaks': module 'probe' is not allowed on this cluster (allowed module "
        "prefixes: spotrl_runtime.rewards, spotrl_rewards); put the reward in a package under one of them, or ask "
        "the cluster's admin to add its prefix to the chart value rewards.allowedImportPrefixes"
    )


def test_the_admin_sets_the_prefixes_none_or_any() -> None:
    team = _settings("--reward-import-prefixes=team_a.rewards, spotrl_runtime.rewards")
    resources.check_job(REF, _spec({"importPath": "team_a.rewards.judge:score"}), team)
    with pytest.raises(ValueError, match=r"^spec\.reward\.importPath 'spotrl_rewards:f'"):
        resources.check_job(REF, _spec({"importPath": "spotrl_rewards:f"}), team)
    none = _settings("--reward-import-prefixes=")
    assert none.reward_import_prefixes == ()
    resources.check_job(REF, _spec({"name": "gsm8k"}), none)
    with pytest.raises(ValueError, match=r"none: built-in rewards by reward\.name only"):
        resources.check_job(REF, _spec({"importPath": "spotrl_runtime.rewards.builtin:gsm8k"}), none)
    resources.check_job(REF, _spec({"importPath": "os:getenv"}), _settings("--reward-import-prefixes=*"))


def test_the_controller_pod_gets_the_prefixes_and_the_charts_runtime_env_names_after_the_jobs_cannot_replace_them() -> (
    None
):
    settings = _settings(
        "--reward-import-prefixes=team_a.rewards", "--runtime-env=HTTPS_PROXY=http://p:3128", "--runtime-env=A=1"
    )
    spec = _spec({"importPath": "team_a.rewards:score"})
    (c,) = resources.controller_pod(REF, spec, settings, 1)["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SPOTRL_REWARD_IMPORT_PREFIXES"] == "team_a.rewards"
    assert env["SPOTRL_REWARD_ENV_NAMES"] == "A,HTTPS_PROXY"
    with pytest.raises(ValueError, match="operator's own"):
        parse_spec(
            {
                **spec.model_dump(by_alias=True, exclude_none=True),
                "runtimeEnv": [{"name": "SPOTRL_REWARD_IMPORT_PREFIXES", "value": "*"}],
            }
        )
