"""What a reward's process may reach: the environment it starts with and the modules
``spec.reward.importPath`` may name.

The reward is the job author's code, or any importable function the author names. The
controller beside it holds the storage's keys (the credentials Secret, by ``envFrom``) and the
runtime's settings; the reward needs neither. Its process (:mod:`~spotrl_runtime.rewards.runner`)
starts with an environment built from an allow-list: what Python needs, and the names of the
job's ``runtimeEnv`` and the chart's (which the operator lists in :data:`ENV_NAMES_VAR`),
never a storage, runtime or cluster variable (:data:`NEVER`). The operator passes the
cluster admin's allowed module prefixes in :data:`IMPORT_PREFIXES_VAR`; unset (a local
``spotrl run``), any module may be named.

This is defence in depth, not a boundary: the reward's process runs as the pod's user, so it
can read the pod's files (the ServiceAccount token) and the other processes' ``/proc``. What
keeps a job's pods from holding what its author may not read is the admission policy
(docs/operations/security.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

IMPORT_PREFIXES_VAR = "SPOTRL_REWARD_IMPORT_PREFIXES"
"""Comma-separated module prefixes ``importPath`` may name (set by the operator)."""

ENV_NAMES_VAR = "SPOTRL_REWARD_ENV_NAMES"
"""Comma-separated names of the chart's ``runtimeEnv`` (set by the operator): the reward gets them."""

DEFAULT_IMPORT_PREFIXES = ("spotrl_runtime.rewards", "spotrl_rewards")
"""The chart's default: the built-in rewards, and ``spotrl_rewards``, the package a job's own
image puts its rewards in (docs/guides/rewards.md)."""

BASE_ENV = (
    *("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED"),
    *("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"),
)
"""What every reward's process gets, with every ``LC_*``: what Python and its locale need, and
what a reward that runs a model on the pod's GPU needs to find it (GKE's driver libraries are
found by ``LD_LIBRARY_PATH``)."""

NEVER = ("AWS_", "SPOTRL_", "KUBERNETES_")
"""Prefixes no reward's process gets, even where ``runtimeEnv`` names them: the storage's
client (keys, endpoint, a web identity's token file), the runtime's settings, the cluster."""


@dataclass(frozen=True)
class RewardIsolation:
    """The reward process's environment, and the module prefixes it may import (None: any)."""

    env: Mapping[str, str]
    import_prefixes: tuple[str, ...] | None

    @classmethod
    def of(cls, environ: Mapping[str, str], runtime_env_names: Iterable[str]) -> RewardIsolation:
        """For a controller whose environment is ``environ``, running a job whose
        ``spec.runtimeEnv`` has ``runtime_env_names``."""
        names = {*runtime_env_names, *split_names(environ.get(ENV_NAMES_VAR, ""))}
        prefixes = environ.get(IMPORT_PREFIXES_VAR)
        return cls(child_environment(environ, names), None if prefixes is None else tuple(split_names(prefixes)))


def split_names(value: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [p.strip() for p in value.split(",") if p.strip()]


def child_environment(environ: Mapping[str, str], runtime_env_names: Iterable[str]) -> dict[str, str]:
    """The variables of ``environ`` a reward's process gets: :data:`BASE_ENV`, ``LC_*`` and
    ``runtime_env_names``, less any that starts with one of :data:`NEVER`."""
    allowed = {*BASE_ENV, *runtime_env_names}
    return {k: v for k, v in environ.items() if (k in allowed or k.startswith("LC_")) and not k.startswith(NEVER)}


def import_allowed(module: str, prefixes: tuple[str, ...] | None) -> bool:
    """Whether ``module`` is one of ``prefixes`` or below one (``a.b`` allows ``a.b`` and
    ``a.b.c``, not ``a.bc``); ``"*"`` allows any, None (no list) too."""
    if prefixes is None:
        return True
    return any(p == "*" or module == p or module.startswith(p + ".") for p in prefixes)


def import_refusal(import_path: str, prefixes: tuple[str, ...] | None) -> str | None:
    """Why ``spec.reward.importPath`` may not be imported here, or None if it may."""
    module = import_path.partition(":")[0]
    if import_allowed(module, prefixes):
        return None
    allowed = ", ".join(prefixes or ()) or "none: built-in rewards by reward.name only"
    return (
        f"spec.reward.importPath {import_path!r}: module {module!r} is not allowed on this cluster (allowed "
        f"module prefixes: {allowed}); put the reward in a package under one of them, or ask the cluster's admin "
        "to add its prefix to the chart value rewards.allowedImportPrefixes"
    )
