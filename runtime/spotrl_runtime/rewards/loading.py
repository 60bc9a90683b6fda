"""From ``spec.reward`` to a callable: a built-in by name, or any function by import path."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards.builtin import BUILTIN_REWARDS
from spotrl_runtime.rewards.isolation import import_refusal

RewardFn = Callable[[Prompt, str], float]
"""A reward function: ``fn(prompt, completion) -> float``.

``prompt`` is the :class:`~spotrl_runtime.core.types.Prompt` the group was generated from (its
``text``, the row's ``answer``, ``idx`` and ``task_name``); ``completion`` is the decoded
completion text, special tokens removed. Return a finite number; higher is better. It is called
once per rollout in a child process of the controller, under ``spec.reward.timeoutSeconds``
(:mod:`~spotrl_runtime.rewards.runner`), so keep it fast and free of side effects.
"""

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_MODULE = re.compile(_DOTTED)
_IMPORT_PATH = re.compile(rf"{_DOTTED}:[A-Za-z_][A-Za-z0-9_]*")


class RewardError(ValueError):
    """The reward cannot be loaded or returned something that is not a score."""


class RewardSpecLike(Protocol):
    """What :func:`load_reward` reads from ``spec.reward`` (the RLJob ``Reward`` model fits)."""

    @property
    def name(self) -> str | None: ...

    @property
    def import_path(self) -> str | None: ...


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward: calling it scores one completion and checks that the score is a number."""

    name: str
    fn: RewardFn

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return check_score(self.name, self.fn(prompt, completion))


def check_score(name: str, value: object) -> float:
    """``value`` as a score: a finite int or float (not a bool), else :class:`RewardError`. The
    error names the value's type, never the value: it goes to the log, the audit and, through a
    dropped group, the job's status, and a reward's value can be anything it read."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"reward {name!r} returned a {type(value).__name__}, not a number; it must return a float")
    if not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {float(value)}; it must return a finite float")
    return float(value)


def check_import_path(import_path: str, allowed: tuple[str, ...] | None = None) -> None:
    """:class:`RewardError` unless ``import_path`` is ``'package.module:function'`` under one of
    the ``allowed`` module prefixes (None: any; :mod:`~spotrl_runtime.rewards.isolation`).
    Imports nothing."""
    if not _IMPORT_PATH.fullmatch(import_path):
        raise RewardError(
            f"reward.importPath {import_path!r} must look like 'package.module:function' "
            "(a dotted module name, a colon, a function name)"
        )
    refusal = import_refusal(import_path, allowed)
    if refusal is not None:
        raise RewardError(refusal)


def import_reward(import_path: str, *, batched: bool = False, allowed: tuple[str, ...] | None = None) -> RewardFunction:
    """Imports ``'package.module:function'`` and checks it can be called as ``fn(prompt, completion)``.
    An exception the module's own code raised on import is named by its type (its message can
    hold anything the module read); it is this error's ``__cause__``, for the traceback."""
    check_import_path(import_path, allowed)
    module_name, _, attr = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name if err.name and _MODULE.fullmatch(err.name) else "?"
        raise RewardError(
            f"reward.importPath {import_path!r}: cannot import module {module_name!r} (no module named "
            f"{missing!r}); install the package in the runtime image or put it on PYTHONPATH"
        ) from err
    except Exception as err:
        raise RewardError(
            f"reward.importPath {import_path!r}: importing module {module_name!r} raised {type(err).__name__} "
            "(its traceback is in the log of the reward's process)"
        ) from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward.importPath {import_path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"reward.importPath {import_path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError as err:
        raise RewardError(
            f"reward.importPath {import_path!r}: {attr} cannot be called as "
            f"{'fn(prompts, completions)' if batched else 'fn(prompt, completion)'} ({err})"
        ) from err
    except ValueError:
        pass  # a builtin without a signature: trust it
    return RewardFunction(import_path, fn)


def load_reward(
    spec: RewardSpecLike, *, batched: bool = False, allowed: tuple[str, ...] | None = None
) -> RewardFunction:
    """The reward ``spec.reward`` names: exactly one of ``name`` (built-in) or ``importPath``.
    ``batched``: an import-path reward called once per group, ``fn(prompts, completions)``
    returning one float per completion (for rewards that call a model). ``allowed``: the module
    prefixes an import path may name (None: any)."""
    name = reward_name(spec, batched=batched, allowed=allowed)
    if spec.name is not None:
        return RewardFunction(name, BUILTIN_REWARDS[name])
    return import_reward(name, batched=batched, allowed=allowed)


def reward_name(spec: RewardSpecLike, *, batched: bool = False, allowed: tuple[str, ...] | None = None) -> str:
    """The reward ``spec.reward`` names (a built-in's name, or the import path), checked as
    :func:`load_reward` checks it but without importing anything: the controller checks the
    spec with this, and only the reward's own process imports it."""
    if (spec.name is None) == (spec.import_path is None):
        raise RewardError("reward: set exactly one of name (a built-in reward) or importPath (module:function)")
    if batched and spec.name is not None:
        raise RewardError("reward.batched: applies to importPath rewards; the built-in rewards score one completion")
    if spec.name is not None:
        if spec.name not in BUILTIN_REWARDS:
            raise RewardError(
                f"reward.name {spec.name!r} is not a built-in reward; use one of {sorted(BUILTIN_REWARDS)}"
            )
        return spec.name
    assert spec.import_path is not None
    check_import_path(spec.import_path, allowed)
    return spec.import_path
