"""Rewards scored in a process of their own, each call under a timeout.

A reward is user code, or a parser such as math-verify that can run for minutes on a
pathological answer (``\\boxed{9^{9^{9^{9^{9}}}}}``). Scored in the controller, it would stall
every step behind it, and a thread cannot be stopped. :class:`RewardRunner` keeps one child
process (``spawn``: nothing of the controller's threads, Ray or torch is inherited) that loads
the reward once and scores one completion per call (a ``batched`` reward: one group per call).
A call that outlasts ``spec.reward.timeoutSeconds`` costs that child: it is killed and a fresh
one started for the next call. A call that raises, times out or returns no finite number is a
:class:`RewardFailure` with its message. By ``spec.reward.onError`` the controller scores it
``errorScore`` and counts it (``reward_errors``, every step, with a warning in the log), or
drops the group and the audit records why (``reward failed: ...``). It is never scored in silence.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards.builtin import BUILTIN_IMPORTS
from spotrl_runtime.rewards.loading import RewardError, RewardSpecLike, check_score, load_reward

log = logging.getLogger("spotrl.reward")

START_TIMEOUT = 120.0
"""How long the reward's process may take to start and load the reward (imports: math-verify's
take a second or two), apart from each call's timeout."""


@dataclass(frozen=True)
class RewardFailure:
    """A completion the reward could not score: why (an exception, a timeout, not a number)."""

    message: str


Score = float | RewardFailure


@dataclass(frozen=True)
class _Spec:
    """What the child needs to load the reward (picklable, unlike the RLJob model)."""

    name: str | None
    import_path: str | None
    batched: bool = False


class RewardRunner:
    """Scores completions with ``spec.reward`` in a child process, each call within ``timeout``
    seconds. The reward is loaded here first, so that a reward that cannot load fails the start
    with its :class:`~spotrl_runtime.rewards.loading.RewardError`, not the first step."""

    def __init__(self, spec: RewardSpecLike, *, timeout: float, batched: bool = False) -> None:
        self.name = load_reward(spec, batched=batched).name
        self.timeout = timeout
        self.batched = batched
        self._spec = _Spec(spec.name, spec.import_path, batched)
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        """Starts the child; it says it is ready (the reward and what it imports loaded) before
        the first call's clock starts (:meth:`_ready`)."""
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self._spec), name="spotrl-reward", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._started = False

    def _ready(self) -> RewardFailure | None:
        assert self._conn is not None
        if self._started:
            return None
        if not self._conn.poll(START_TIMEOUT):
            self._stop()
            return RewardFailure(f"reward {self.name!r}: its process did not start within {START_TIMEOUT:g} s")
        kind, value = self._conn.recv()
        if kind != "ready":
            self._stop()
            return RewardFailure(value)
        self._started = True
        return None

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
            self._proc = None

    def score(self, prompt: Prompt, completions: Sequence[str], *, stop_at_failure: bool = True) -> list[Score]:
        """One score per completion, in order. ``stop_at_failure``: the list ends at the first
        :class:`RewardFailure` (the group is dropped, so the rest need not wait for the reward);
        otherwise every completion has its score or its failure (a batched call that failed as
        a whole fails each of its completions)."""
        with self._lock:
            if self.batched:
                out = self._call(("batch", [prompt] * len(completions), list(completions)))
                if isinstance(out, RewardFailure):
                    return [out] if stop_at_failure else [out] * len(completions)
                failed = [s for s in out if isinstance(s, RewardFailure)]
                return out[: out.index(failed[0]) + 1] if failed and stop_at_failure else out
            scores: list[Score] = []
            for text in completions:
                scores.append(self._call(("one", prompt, text)))
                if stop_at_failure and isinstance(scores[-1], RewardFailure):
                    break
            return scores

    def _call(self, request: tuple[Any, ...]) -> Any:
        if self._proc is None or not self._proc.is_alive():
            self._stop()
            self._start()
        assert self._conn is not None
        try:
            failure = self._ready()
            if failure is not None:
                return failure
            self._conn.send(request)
            if not self._conn.poll(self.timeout):
                self._stop()  # the only way to stop a call that runs on: its process goes
                return RewardFailure(f"reward {self.name!r} timed out after {self.timeout:g} s")
            kind, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as err:
            self._stop()
            return RewardFailure(f"reward {self.name!r}: its process died ({type(err).__name__})")
        if kind == "error":
            return RewardFailure(value)
        return value

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    self._conn.send(None)
            if self._proc is not None:
                self._proc.join(2)
            self._stop()


def _serve(conn: Connection, spec: _Spec) -> None:
    """The child: loads the reward, then answers each request with ("ok", scores) or ("error", why)."""
    with contextlib.suppress(OSError):
        os.setsid()  # as Ray's processes: a Ctrl-C or SIGTERM to the controller's group is the controller's
    logging.basicConfig(level=logging.ERROR)  # a reward's chatter (math-verify warns per call) stays here
    try:
        reward = load_reward(spec, batched=spec.batched)
        for module in BUILTIN_IMPORTS.get(spec.name or "", ()):
            importlib.import_module(module)
    except Exception as err:
        conn.send(("error", f"reward {spec.name or spec.import_path!r} did not load: {type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the controller is gone
        if request is None:
            return
        try:
            if request[0] == "batch":
                _, prompts, texts = request
                values = reward.fn(prompts, texts)
                if not isinstance(values, Sequence) or len(values) != len(texts):
                    raise RewardError(
                        f"reward {reward.name!r} is batched: it must return a list of {len(texts)} floats, "
                        f"it returned {type(values).__name__}"
                    )
                out: Any = [_checked(reward.name, v) for v in values]
            else:
                _, prompt, text = request
                out = check_score(reward.name, reward.fn(prompt, text))
            conn.send(("ok", out))
        except RewardError as err:
            conn.send(("error", str(err)))
        except Exception as err:
            conn.send(("error", f"reward {reward.name!r} raised {type(err).__name__}: {str(err)[:500]}"))


def _checked(name: str, value: Any) -> Score:
    try:
        return check_score(name, value)
    except RewardError as err:
        return RewardFailure(str(err))
