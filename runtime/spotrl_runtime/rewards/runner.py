"""Rewards scored in processes of their own, each call under a timeout.

A reward is user code, or a parser such as math-verify that can run for minutes on a
pathological answer (``\\boxed{9^{9^{9^{9^{9}}}}}``). Scored in the controller, it would stall
every step behind it, and a thread cannot be stopped. :class:`RewardRunner` keeps
``spec.reward.workers`` child processes (``python -m spotrl_runtime.rewards.child``: nothing of
the controller's threads, Ray or torch is inherited, and its environment is the allow-list of
:class:`~spotrl_runtime.rewards.isolation.RewardIsolation`, without the storage's keys), each of
which loads the reward once and scores one completion per call (a ``batched`` reward: one group
per call, in one process). A group's completions go to the processes as they come free, and
their scores come back in the group's order, the same as one process would give. The
controller checks ``spec.reward`` but never imports the reward's module: only the children do,
so no code of the author's runs in the process that holds the keys.
A call that outlasts ``spec.reward.timeoutSeconds`` costs its process: it is killed and a fresh
one started at once; one that died is replaced too. A call that raises, times out or returns no
finite number is a :class:`RewardFailure` with its message. By ``spec.reward.onError`` the
controller scores it ``errorScore`` and counts it (``reward_errors``, every step, with a warning
in the log), or drops the group and the audit records why (``reward failed: ...``). It is never
scored in silence. The processes end with the runner (:meth:`RewardRunner.close`) or, however
the controller ends (SIGKILL included), with the controller: each asks the kernel for it.

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
import math
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from spotrl_runtime.core.types import Prompt
from spotrl_runtime.cpus import default_workers
from spotrl_runtime.rewards.builtin import BUILTIN_IMPORTS
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.loading import RewardError, RewardSpecLike, check_score, load_reward, reward_name

log = logging.getLogger("spotrl.reward")

START_TIMEOUT = 120.0
"""How long the reward's process may take to start and load the reward (imports: math-verify's
take a second or two), apart from each call's timeout."""

CLOSE_WAIT = 2.0
"""How long :meth:`RewardRunner.close` waits for a call in flight before it kills its processes
(and then for that call to return)."""


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


class _Process:
    """One reward process as the runner sees it: ``stopped`` (none running), ``starting`` (it
    loads the reward), ``idle``, or ``busy`` with one call (``item``: the completion's index in
    the group being scored; None: a call whose result nobody waits for, read and dropped).
    ``deadline``: when a start or a call has run too long (monotonic seconds)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.state: Literal["stopped", "starting", "idle", "busy"] = "stopped"
        self.item: int | None = None
        self.deadline = math.inf

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, item: int, request: tuple[Any, ...], timeout: float) -> str | None:
        """Starts a call; the name of the error if its process is gone (then it is stopped)."""
        assert self.conn is not None
        try:
            self.conn.send(request)
        except OSError as err:
            self.stop()
            return type(err).__name__
        self.state, self.item, self.deadline = "busy", item, time.monotonic() + timeout
        return None

    def receive(self) -> tuple[str, Any]:
        """Its message: ("ready", None), ("ok", score(s)), ("error", why), or ("died", error name)."""
        assert self.conn is not None
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as err:
            return "died", type(err).__name__
        return kind, value

    def stop(self) -> None:
        """SIGKILLs it (the only way to stop a call that runs on) and reaps it, within 10 s."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.proc = None
        self.state, self.item, self.deadline = "stopped", None, math.inf


@dataclass(frozen=True)
class _Event:
    """What a process's message or passed deadline meant: ``score`` for completion ``item``
    (None: nobody waits for it), or ``start_failure``: it could not load the reward."""

    item: int | None = None
    score: Score | None = None
    start_failure: RewardFailure | None = None


class RewardRunner:
    """Scores completions with ``spec.reward`` in ``workers`` child processes (None: one per
    CPU of the pod, :func:`~spotrl_runtime.cpus.default_workers`; a batched reward
    uses one), each call within ``timeout`` seconds; a group's completions are scored in
    parallel and returned in order. ``isolation``: the processes' environment and the module
    prefixes they may import. The spec is checked here without importing the reward;
    :meth:`ready` waits for every process to load it, so that a reward that cannot load fails
    the start with its :class:`~spotrl_runtime.rewards.loading.RewardError`, not the first step."""

    def __init__(
        self,
        spec: RewardSpecLike,
        *,
        timeout: float,
        isolation: RewardIsolation,
        batched: bool = False,
        workers: int | None = None,
    ) -> None:
        self.name = reward_name(spec, batched=batched, allowed=isolation.import_prefixes)
        if batched and workers not in (None, 1):
            raise RewardError("reward.workers: a batched reward scores a group in one call; leave workers unset or 1")
        if workers is not None and workers < 1:
            raise RewardError(f"reward.workers is {workers}; it must be at least 1")
        self.timeout = timeout
        self.batched = batched
        self.workers = 1 if batched else workers or default_workers()
        self._env = dict(isolation.env)
        self._spec = _Spec(spec.name, spec.import_path, batched, isolation.import_prefixes, tuple(sys.path))
        self._lock = threading.Lock()
        self._closed = False
        # Every process is started from this one thread, which lives until close(): a child
        # asks for SIGKILL when its parent goes (child.py), and to Linux the parent is the
        # thread that started it, not the process (prctl(2), PR_SET_PDEATHSIG).
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="spotrl-reward-start")
        self._procs = [_Process() for _ in range(self.workers)]
        for p in self._procs:
            self._start(p)
        log.info("reward %r: scored by %d process(es) (reward.workers)", self.name, self.workers)

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The reward's processes now running or starting (for tests and ``ps``)."""
        return [p.proc for p in self._procs if p.proc is not None]

    def _start(self, p: _Process) -> None:
        """Starts a process with only its allowed environment (a ``multiprocessing`` child
        would inherit the controller's) and sends it the spec; it says when it is ready (the
        reward and what it imports loaded) before its first call's clock starts. Once the
        runner is closed, none starts."""
        if self._closed:
            return
        parent, child = multiprocessing.Pipe()
        argv = [sys.executable, "-m", "spotrl_runtime.rewards.child", str(child.fileno()), str(os.getpid())]
        try:
            p.proc = self._starter.submit(_popen, argv, self._env, child.fileno()).result(timeout=START_TIMEOUT)
        finally:
            child.close()
        p.conn, p.state, p.deadline = parent, "starting", time.monotonic() + START_TIMEOUT
        with contextlib.suppress(OSError):  # a process already gone: its end reads EOF
            parent.send(self._spec)

    def ready(self) -> None:
        """Waits until every process has loaded the reward; :class:`RewardError` if one cannot."""
        with self._lock:
            for p in self._procs:
                if p.state == "stopped":
                    self._start(p)
            failure: RewardFailure | None = None
            while any(p.state == "starting" for p in self._procs):
                for event in self._wait():
                    failure = failure or event.start_failure
        if failure is not None:
            raise RewardError(failure.message)

    def score(self, prompt: Prompt, completions: Sequence[str], *, stop_at_failure: bool = True) -> list[Score]:
        """One score per completion, in order, the same as one process scoring them one after
        the other would give. ``stop_at_failure``: the list ends at the first
        :class:`RewardFailure` (the group is dropped, so the rest need not wait for the reward);
        otherwise every completion has its score or its failure (a batched call that failed as
        a whole fails each of its completions)."""
        with self._lock:
            if self.batched:
                (out,) = self._run([("batch", [prompt] * len(completions), list(completions))], stop_at_failure)
                if isinstance(out, RewardFailure):
                    return [out] if stop_at_failure else [out] * len(completions)
                failed = [s for s in out if isinstance(s, RewardFailure)]
                return out[: out.index(failed[0]) + 1] if failed and stop_at_failure else out
            return self._run([("one", prompt, text) for text in completions], stop_at_failure)

    def _run(self, requests: list[tuple[Any, ...]], stop_at_failure: bool) -> list[Any]:
        """Each request's answer, in order (with ``stop_at_failure``, up to the first failure),
        each sent to the first idle process. Every wait is bounded by a call's or a start's
        deadline, and each deadline ends in an answer or a failure, so this returns."""
        results: dict[int, Any] = {}
        todo = deque(range(len(requests)))
        while True:
            wanted = _wanted(results, len(requests), stop_at_failure)
            if all(i in results for i in range(wanted)):
                break
            if self._closed:  # close() gave up waiting for this call: it ends now, its processes with it
                for p in self._procs:
                    p.stop()
                gone = RewardFailure(f"reward {self.name!r}: its processes were stopped (the controller is stopping)")
                results.update({i: gone for i in range(wanted) if i not in results})
                continue
            todo = deque(i for i in todo if i < wanted)
            self._dispatch(requests, todo, results)
            for event in self._wait():
                if event.item is not None and event.score is not None:
                    results[event.item] = event.score
                elif event.start_failure is not None and todo:
                    # As one process would: the call it could not start fails, the next restarts it.
                    results[todo.popleft()] = event.start_failure
        for p in self._procs:
            p.item = None  # calls past the first failure: their answers are read and dropped later
        return [results[i] for i in range(wanted)]

    def _dispatch(self, requests: list[tuple[Any, ...]], todo: deque[int], results: dict[int, Any]) -> None:
        """Sends the next waiting requests to idle processes; starts stopped ones while any waits."""
        for p in self._procs:
            if not todo:
                return
            if p.state == "idle" and not p.alive():
                p.stop()  # it died between calls (killed, out of memory): replaced, no call lost
            if p.state == "stopped" and not self._closed:
                self._start(p)
            elif p.state == "idle":
                item = todo.popleft()
                died = p.send(item, requests[item], self.timeout)
                if died is not None:
                    results[item] = RewardFailure(f"reward {self.name!r}: its process died ({died})")
                    self._start(p)

    def _wait(self) -> list[_Event]:
        """Waits for a message from a starting or busy process, at most until the nearest
        deadline, and says what each message or passed deadline meant."""
        waiting = [p for p in self._procs if p.state in ("starting", "busy")]
        if not waiting:
            return []
        timeout = max(0.0, min(p.deadline for p in waiting) - time.monotonic())
        readable = set(wait([p.conn for p in waiting if p.conn is not None], timeout))
        now = time.monotonic()
        events = []
        for p in waiting:
            if p.conn in readable:
                events.append(self._answer(p, *p.receive()))
            elif now >= p.deadline:
                events.append(self._late(p))
        return events

    def _answer(self, p: _Process, kind: str, value: Any) -> _Event:
        if p.state == "starting":
            if kind == "ready":
                p.state, p.deadline = "idle", math.inf
                return _Event()
            p.stop()
            if kind == "died":
                value = f"reward {self.name!r}: its process exited before it loaded the reward"
            return _Event(start_failure=RewardFailure(value))
        item = p.item
        if kind == "died":
            p.stop()
            self._start(p)
            return _Event(item, RewardFailure(f"reward {self.name!r}: its process died ({value})"))
        p.state, p.item, p.deadline = "idle", None, math.inf
        return _Event(item, RewardFailure(value) if kind == "error" else value)

    def _late(self, p: _Process) -> _Event:
        item, starting = p.item, p.state == "starting"
        p.stop()
        if starting:
            return _Event(
                start_failure=RewardFailure(
                    f"reward {self.name!r}: its process did not start within {START_TIMEOUT:g} s"
                )
            )
        self._start(p)  # replaced at once: it loads the reward while the others score
        return _Event(item, RewardFailure(f"reward {self.name!r} timed out after {self.timeout:g} s"))

    def close(self) -> None:
        """Asks the idle processes to exit, waits up to 2 s, then SIGKILLs what is left. A call
        in flight (a hung reward, up to its timeout) is not waited for: its processes are
        killed, and it returns with each completion failed."""
        self._closed = True  # from now on no process starts
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            for p in list(self._procs):
                proc = p.proc  # the scoring thread reads their EOF and stops them itself
                if proc is not None:
                    proc.kill()
            if not self._lock.acquire(timeout=CLOSE_WAIT):
                log.warning("reward %r: its processes were killed, but a call still holds the runner", self.name)
                return
        try:
            for p in self._procs:
                if p.state == "idle" and p.conn is not None:
                    with contextlib.suppress(OSError):
                        p.conn.send(None)
            deadline = time.monotonic() + 2
            for p in self._procs:
                if p.state == "idle" and p.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.proc.wait(max(0.0, deadline - time.monotonic()))
            for p in self._procs:
                p.stop()
            self._starter.shutdown(wait=False)
        finally:
            self._lock.release()


def _popen(argv: list[str], env: dict[str, str], fd: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        env=env,
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or SIGTERM to the controller's group is the controller's
    )


def _wanted(results: dict[int, Any], n: int, stop_at_failure: bool) -> int:
    """How many leading answers a call of ``n`` returns: all, or up to the first failure."""
    if stop_at_failure:
        failed = [i for i, s in results.items() if isinstance(s, RewardFailure)]
        if failed:
            return min(failed) + 1
    return n


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
    # One write: the processes of a reward pool share the pod's stderr, and two of them printing at
    # once must not splice one's line into another's traceback.
    text = "".join(traceback.format_exception(err)) + f"spotrl: {what} (traceback above, from the reward's process)\n"
    sys.stderr.write(text)
    sys.stderr.flush()


def _checked(name: str, value: Any) -> Score:
    try:
        return check_score(name, value)
    except RewardError as err:
        return RewardFailure(str(err))
