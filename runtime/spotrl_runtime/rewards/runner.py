"""Rewards scored in a process of their own, each call under a timeout.

A reward is user code, or a parser such as math-verify that can run for minutes on a
pathological answer (``\\boxed{9^{9^{9^{9^{9}}}}}``). Scored in the controller, it would stall
every step behind it, and a thread cannot be stopped. :class:`RewardRunner` keeps one child
process (``python -m spotrl_runtime.rewards.child``: nothing of the controller's threads, Ray or
torch is inherited, and its environment is the allow-list of
:class:`~spotrl_runtime.rewards.isolation.RewardIsolation`, without the storage's keys) that
loads the reward once and scores one completion per call (a ``batched`` reward: one group per
call). The controller checks ``spec.reward`` but never imports the reward's module: only the
child does, so no code of the author's runs in the process that holds the keys.
A call that outlasts ``spec.reward.timeoutSeconds`` costs that child: it is killed and a fresh
one started for the next call. A call that raises, times out or returns no finite number is a
:class:`RewardFailure` with its message. By ``spec.reward.onError`` the controller scores it
``errorScore`` and counts it (``reward_errors``, every step, with a warning in the log), or
drops the group and the audit records why (``reward failed: ...``). It is never scored in silence.

What the controller logs and records of a failure names the reward (``module:function``) and a
type: the exception's, or the returned value's. Never the value, nor the exception's message:
either can hold anything the reward read, and from the log's last line, the audit or a dropped
group they would reach the job's status and Events, which more people read than the pod's
log. The child prints the exception's traceback, message included, to its own stderr (the
controller pod's log, for the author to debug), followed by a line of its own, so that a crash
right after it does not make the message the pod's termination message.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards.builtin import BUILTIN_IMPORTS
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.loading import RewardError, RewardSpecLike, check_score, load_reward, reward_name

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
    batched: bool
    allowed: tuple[str, ...] | None
    sys_path: tuple[str, ...]
    """The controller's, as ``multiprocessing``'s spawn gives its children."""


class RewardRunner:
    """Scores completions with ``spec.reward`` in a child process, each call within ``timeout``
    seconds. ``isolation``: the child's environment and the module prefixes it may import. The
    spec is checked here without importing the reward; :meth:`ready` waits for the child to
    load it, so that a reward that cannot load fails the start with its
    :class:`~spotrl_runtime.rewards.loading.RewardError`, not the first step."""

    def __init__(
        self, spec: RewardSpecLike, *, timeout: float, isolation: RewardIsolation, batched: bool = False
    ) -> None:
        self.name = reward_name(spec, batched=batched, allowed=isolation.import_prefixes)
        self.timeout = timeout
        self.batched = batched
        self._env = dict(isolation.env)
        self._spec = _Spec(spec.name, spec.import_path, batched, isolation.import_prefixes, tuple(sys.path))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        """Starts the child with only its allowed environment (a ``multiprocessing`` child would
        inherit the controller's) and sends it the spec; it says it is ready (the reward and
        what it imports loaded) before the first call's clock starts (:meth:`_ready`)."""
        parent, child = multiprocessing.Pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "spotrl_runtime.rewards.child", str(child.fileno()), str(os.getpid())],
                env=self._env,
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C or SIGTERM to the controller's group is the controller's
            )
        finally:
            child.close()
        self._conn = parent
        self._started = False
        with contextlib.suppress(OSError):  # a child already gone: _ready finds its end closed
            self._conn.send(self._spec)

    def ready(self) -> None:
        """Waits until the child has loaded the reward; :class:`RewardError` if it cannot."""
        with self._lock:
            if self._conn is None:
                self._start()
            failure = self._ready()
        if failure is not None:
            raise RewardError(failure.message)

    def _ready(self) -> RewardFailure | None:
        assert self._conn is not None
        if self._started:
            return None
        if not self._conn.poll(START_TIMEOUT):
            self._stop()
            return RewardFailure(f"reward {self.name!r}: its process did not start within {START_TIMEOUT:g} s")
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            kind, value = "error", f"reward {self.name!r}: its process exited before it loaded the reward"
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
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)
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
        if self._proc is None or self._proc.poll() is not None:
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
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(2)
            self._stop()


def serve(conn: Connection) -> None:
    """The child (:mod:`~spotrl_runtime.rewards.child`): reads the spec, loads the reward, then
    answers each request with ("ok", scores) or ("error", why)."""
    logging.basicConfig(level=logging.ERROR)  # a reward's chatter (math-verify warns per call) stays here
    spec: _Spec = conn.recv()
    sys.path[:] = spec.sys_path
    label = spec.name or spec.import_path
    try:
        reward = load_reward(spec, batched=spec.batched, allowed=spec.allowed)
        for module in BUILTIN_IMPORTS.get(spec.name or "", ()):
            importlib.import_module(module)
    except RewardError as err:
        if err.__cause__ is not None:
            _print_traceback(err.__cause__, f"reward {label!r} did not load")
        conn.send(("error", f"reward {label!r} did not load: {err}"))
        return
    except Exception as err:
        _print_traceback(err, f"reward {label!r} did not load")
        conn.send(("error", f"reward {label!r} did not load: {type(err).__name__} (traceback in the log)"))
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
                        f"it returned a {type(values).__name__}"
                        + (f" of {len(values)}" if isinstance(values, Sequence) else "")
                    )
                out: Any = [_checked(reward.name, v) for v in values]
            else:
                _, prompt, text = request
                out = check_score(reward.name, reward.fn(prompt, text))
            conn.send(("ok", out))
        except RewardError as err:
            conn.send(("error", str(err)))
        except Exception as err:
            _print_traceback(err, f"reward {reward.name!r} raised {type(err).__name__}")
            conn.send(("error", f"reward {reward.name!r} raised {type(err).__name__}"))


def _print_traceback(err: BaseException, what: str) -> None:
    """The reward's exception in full, on this process's stderr (the pod's log, for its author),
    then a line of ours: a crash right after must not make the exception's message, which can
    hold anything the reward read, the log's last line (the pod's termination message)."""
    traceback.print_exception(err, file=sys.stderr)
    print(f"spotrl: {what} (traceback above, from the reward's process)", file=sys.stderr, flush=True)


def _checked(name: str, value: Any) -> Score:
    try:
        return check_score(name, value)
    except RewardError as err:
        return RewardFailure(str(err))
