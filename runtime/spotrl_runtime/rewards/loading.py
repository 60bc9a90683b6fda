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

RewardFn = Callable[[Prompt, str], float]
"""A reward function: ``fn(prompt, completion) -> float``.

``prompt`` is the :class:`~spotrl_runtime.core.types.Prompt` the group was generated from (its
``text``, the row's ``answer``, ``idx`` and ``task_name``); ``completion`` is the decoded
completion text, special tokens removed. Return a finite number; higher is better. It is called
once per rollout in a child process of the controller, under ``spec.reward.timeoutSeconds``
(:mod:`~spotrl_runtime.rewards.runner`), so keep it fast and free of side effects.
"""

_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


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
    """``value`` as a score: a finite int or float (not a bool), else :class:`RewardError`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"reward {name!r} returned {value!r} ({type(value).__name__}); it must return a float")
    if not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r}; it must return a finite float")
    return float(value)


def import_reward(import_path: str, *, batched: bool = False) -> RewardFunction:
    """Imports ``'package.module:function'`` and checks it can be called as ``fn(prompt, completion)``."""
    if not _IMPORT_PATH.fullmatch(import_path):
        raise RewardError(
            f"reward.importPath {import_path!r} must look like 'package.module:function' "
            "(a dotted module name, a colon, a function name)"
        )
    module_name, _, attr = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(
            f"reward.importPath {import_path!r}: cannot import module {module_name!r} ({err}); "
            "install the package in the runtime image or put it on PYTHONPATH"
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


def load_reward(spec: RewardSpecLike, *, batched: bool = False) -> RewardFunction:
    """The reward ``spec.reward`` names: exactly one of ``name`` (built-in) or ``importPath``.
    ``batched``: an import-path reward called once per group, ``fn(prompts, completions)``
    returning one float per completion (for rewards that call a model)."""
    if (spec.name is None) == (spec.import_path is None):
        raise RewardError("reward: set exactly one of name (a built-in reward) or importPath (module:function)")
    if batched and spec.name is not None:
        raise RewardError("reward.batched: applies to importPath rewards; the built-in rewards score one completion")
    if spec.name is not None:
        if spec.name not in BUILTIN_REWARDS:
            raise RewardError(
                f"reward.name {spec.name!r} is not a built-in reward; use one of {sorted(BUILTIN_REWARDS)}"
            )
        return RewardFunction(spec.name, BUILTIN_REWARDS[spec.name])
    assert spec.import_path is not None
    return import_reward(spec.import_path, batched=batched)
