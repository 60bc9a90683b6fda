"""Rewards scored by a pool of processes (rewards/runner.py, ``spec.reward.workers``): a group's
completions scored side by side and returned in its order, the same as one process gives; a
reward that raises or hangs fails only its completion, and with onError drop the group ends at
the first failure; a process killed, timed out or dead is replaced; nothing outlives the
runner or the controller, however it ends. Real processes, no mocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards import RewardError
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.runner import RewardFailure, RewardRunner, Score

pytestmark = pytest.mark.slow  # each runner starts processes

PROMPT = Prompt(idx=0, task_name="t", text="...", answer="1")

# A completion is a little program for the reward: "v:S:D" returns float S after sleeping D
# seconds; "boom" raises; "pid" returns the process's id; "hang" sleeps for ten minutes.
REWARDS = textwrap.dedent(
    """
    import os
    import time

    def plays(prompt, completion):
        if completion == "boom":
            raise ZeroDivisionError("boom")
        if completion == "hang":
            time.sleep(600)
        if completion == "pid":
            time.sleep(0.2)
            return float(os.getpid())
        _, score, delay = completion.split(":")
        time.sleep(float(delay))
        return float(score)
    """
)


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., RewardRunner]]:
    """Makes runners of ``pool_rewards:plays`` (closed at the end of the test)."""
    (tmp_path / "pool_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    made: list[RewardRunner] = []

    def runner(workers: int, timeout: float = 20) -> RewardRunner:
        made.append(
            RewardRunner(
                Reward(import_path="pool_rewards:plays"),
                timeout=timeout,
                isolation=RewardIsolation.of(os.environ, ()),
                workers=workers,
            )
        )
        made[-1].ready()
        return made[-1]

    yield runner
    for r in made:
        r.close()


def _failure(what: str) -> RewardFailure:
    return RewardFailure(f"reward 'pool_rewards:plays' {what}")


RAISED = _failure("raised ZeroDivisionError")

# Groups whose later completions finish first (the sleeps shrink along the group), with failures
# in the middle and at the end: the order a pool returns must not be the order scores arrive in.
GROUPS = [
    [f"v:{k}:{0.05 * (6 - k)}" for k in range(6)],
    ["v:1:0.2", "boom", "v:3:0", "boom", "v:5:0.1"],
    ["v:1:0", "v:2:0.3", "v:3:0", "boom"],
    ["boom", "v:2:0.1", "v:3:0"],
    [],
]


@pytest.mark.parametrize("stop_at_failure", [True, False], ids=["drop", "score"])
def test_a_pool_scores_in_the_groups_order_exactly_as_one_process_does(
    make: Callable[..., RewardRunner], stop_at_failure: bool
) -> None:
    one, pool = make(1), make(3)
    expected: list[list[Score]] = [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [1.0, RAISED] if stop_at_failure else [1.0, RAISED, 3.0, RAISED, 5.0],
        [1.0, 2.0, 3.0, RAISED],
        [RAISED] if stop_at_failure else [RAISED, 2.0, 3.0],
        [],
    ]
    for group, want in zip(GROUPS, expected, strict=True):
        assert one.score(PROMPT, group, stop_at_failure=stop_at_failure) == want
        assert pool.score(PROMPT, group, stop_at_failure=stop_at_failure) == want, group


def test_a_groups_completions_are_scored_by_every_process_side_by_side(make: Callable[..., RewardRunner]) -> None:
    """Each call sleeps 0.2 s: with two processes, both score parts of one group."""
    pool = make(2)
    pids = {int(s) for s in pool.score(PROMPT, ["pid"] * 6) if isinstance(s, float)}
    assert pids == {p.pid for p in pool.processes}
    assert len(pids) == 2


def test_an_answer_nobody_waits_for_never_lands_in_the_next_group(make: Callable[..., RewardRunner]) -> None:
    """With onError drop a group ends at its first failure while another process still scores a
    later completion: the call returns at once, and that late answer (7) is read and dropped."""
    pool = make(2)
    assert pool.score(PROMPT, ["boom", "v:7:1.0"]) == [RAISED]
    assert pool.score(PROMPT, ["v:2:0", "v:3:0", "v:4:0"]) == [2.0, 3.0, 4.0]
    time.sleep(1.2)  # it has answered: the next call reads that answer before any of its own
    assert pool.score(PROMPT, ["v:5:0", "v:6:0.5"]) == [5.0, 6.0]


def test_a_hanging_completion_times_out_alone_and_its_process_is_replaced(make: Callable[..., RewardRunner]) -> None:
    pool = make(2, timeout=1.5)
    before = {p.pid for p in pool.processes}
    timed_out = _failure("timed out after 1.5 s")
    t0 = time.monotonic()
    assert pool.score(PROMPT, ["v:1:0", "hang", "v:3:0", "v:4:0"], stop_at_failure=False) == [1.0, timed_out, 3.0, 4.0]
    assert time.monotonic() - t0 < 30, "bounded by the call's timeout, not the reward's ten minutes"
    assert pool.score(PROMPT, ["hang", "v:2:0"]) == [timed_out], "onError drop: the group ends at it"
    after = {p.pid for p in pool.processes}
    assert len(after) == 2, "each process killed for its timeout was replaced"
    assert len(before - after) == 2
    assert pool.score(PROMPT, ["v:1:0", "v:2:0", "v:3:0"]) == [1.0, 2.0, 3.0]


def test_a_process_killed_between_groups_is_replaced_without_losing_a_completion(
    make: Callable[..., RewardRunner],
) -> None:
    pool = make(2)
    victim = pool.processes[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert pool.score(PROMPT, [f"v:{k}:0" for k in range(4)]) == [0.0, 1.0, 2.0, 3.0]
    assert len(pool.processes) == 2
    assert victim.pid not in {p.pid for p in pool.processes}


def test_a_process_killed_during_a_call_fails_that_completion_only_and_is_replaced(
    make: Callable[..., RewardRunner],
) -> None:
    pool = make(2)
    pids = {p.pid for p in pool.processes}
    # The first completion goes to the first process: kill it while that call sleeps.
    killer = threading.Timer(0.5, os.kill, (pool.processes[0].pid, signal.SIGKILL))
    killer.start()
    scores = pool.score(PROMPT, ["v:0:3", "v:1:0", "v:2:0"], stop_at_failure=False)
    killer.join()
    assert scores == [RewardFailure("reward 'pool_rewards:plays': its process died (EOFError)"), 1.0, 2.0]
    assert len(pool.processes) == 2
    assert len(pids & {p.pid for p in pool.processes}) == 1


def test_the_processes_outlive_the_thread_that_started_them(make: Callable[..., RewardRunner]) -> None:
    """A child asks to die with its parent, and to Linux the parent is the thread that started
    it: a runner made on a thread that ends (and processes replaced on the scoring thread) must
    not lose its processes with that thread."""
    made: list[RewardRunner] = []
    thread = threading.Thread(target=lambda: made.append(make(2)))
    thread.start()
    thread.join()
    (pool,) = made
    time.sleep(0.5)
    assert all(p.poll() is None for p in pool.processes)
    assert pool.score(PROMPT, ["v:1:0", "v:2:0"]) == [1.0, 2.0]


def test_close_leaves_no_process_and_ends_a_hung_call_at_once(make: Callable[..., RewardRunner]) -> None:
    """A SIGTERM's shutdown closes the runner while a call may hang for its whole timeout (ten
    minutes here): close() kills its processes, the call returns each completion failed, and
    no process is started again."""
    pool = make(2, timeout=600)
    procs = list(pool.processes)
    scores: list[list[Score]] = []
    scoring = threading.Thread(target=lambda: scores.append(pool.score(PROMPT, ["hang", "hang", "v:1:0"])), daemon=True)
    scoring.start()
    time.sleep(0.5)
    assert all(p.poll() is None for p in procs), "both in a hung call"
    t0 = time.monotonic()
    pool.close()
    scoring.join(30)
    assert time.monotonic() - t0 < 30, "not the call's ten minutes"
    (first,) = scores[0]  # onError drop: the group ends at its first completion, failed
    assert isinstance(first, RewardFailure)
    assert first.message in (  # its process's end read, or close() seen first
        "reward 'pool_rewards:plays': its process died (EOFError)",
        "reward 'pool_rewards:plays': its processes were stopped (the controller is stopping)",
    )
    assert all(p.poll() is not None for p in procs)
    assert pool.processes == []


CONTROLLER = textwrap.dedent(
    """
    import os, sys, threading
    from spotrl_runtime.api.rljob import Reward
    from spotrl_runtime.core.types import Prompt
    from spotrl_runtime.rewards.isolation import RewardIsolation
    from spotrl_runtime.rewards.runner import RewardRunner

    pool = RewardRunner(Reward(import_path="pool_rewards:plays"), timeout=600,
                        isolation=RewardIsolation.of(os.environ, ()), workers=2)
    pool.ready()
    print(*[p.pid for p in pool.processes], flush=True)
    prompt = Prompt(idx=0, task_name="t", text="", answer="1")
    pool.score(prompt, ["hang", "hang"])  # both processes in a call that runs for ten minutes
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_processes_go_with_the_controller_however_it_ends(
    make: Callable[..., RewardRunner], sig: signal.Signals
) -> None:
    """SIGKILL (and a SIGTERM nobody handles) leaves no time to close the runner: the processes,
    each busy in a hung call that never reads its pipe, still go."""
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True)
    assert controller.stdout is not None
    pids = [int(p) for p in controller.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(0.5)
    assert all(_alive(p) for p in pids)
    controller.send_signal(sig)
    controller.wait(30)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "a reward process outlived its controller"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_workers_unset_is_one_process_per_cpu_and_a_batched_reward_uses_one(tmp_path: Path) -> None:
    isolation = RewardIsolation.of(os.environ, ())
    pool = RewardRunner(Reward(name="arithmetic_exact"), timeout=20, isolation=isolation)
    batched = RewardRunner(
        Reward(import_path="spotrl_runtime.rewards.builtin:arithmetic_exact", batched=True),
        timeout=20,
        isolation=isolation,
        batched=True,
    )
    try:
        assert pool.workers == len(pool.processes) == min(len(os.sched_getaffinity(0)), 8)
        assert batched.workers == len(batched.processes) == 1
    finally:
        pool.close()
        batched.close()
    with pytest.raises(RewardError, match=r"^reward\.workers: a batched reward scores a group in one call"):
        RewardRunner(Reward(import_path="m:f", batched=True), timeout=1, isolation=isolation, batched=True, workers=2)
