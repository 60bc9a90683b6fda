"""Rewards scored in their own process (rewards/runner.py): math-verify on the answers models
write, a pathological answer that would hang a step cut off at the timeout, a reward that
raises or returns no number recorded as a failure naming the type (never the value or the
exception's message), batched rewards, no process left behind; the reward imported only in
its process, whose environment holds no storage keys."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards import RewardError
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.runner import RewardFailure, RewardRunner

pytestmark = pytest.mark.slow  # each runner starts a process


def _prompt(answer: str) -> Prompt:
    return Prompt(idx=0, task_name="math", text="...", answer=answer)


def Runner(  # noqa: N802
    reward: Reward, *, timeout: float, batched: bool = False, workers: int | None = 1, **isolation: Any
) -> RewardRunner:
    """A runner as a controller with this process's environment makes it (``isolation``:
    :meth:`RewardIsolation.of`'s ``runtime_env_names``, or the whole ``isolation``); one
    process unless ``workers`` says otherwise."""
    made = isolation.get("isolation") or RewardIsolation.of(os.environ, isolation.get("runtime_env_names", ()))
    return RewardRunner(reward, timeout=timeout, batched=batched, isolation=made, workers=workers)


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def workers(request: pytest.FixtureRequest) -> int:
    """The isolation tests hold for every process of a pool as for the one."""
    return int(request.param)


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module of rewards that misbehave, on the path of this process and its children."""
    (tmp_path / "odd_rewards.py").write_text(
        textwrap.dedent(
            """
            import os
            import time

            def raises(prompt, completion):
                if completion == "boom":
                    raise ZeroDivisionError("the reward divided by zero")
                return 1.0

            def not_a_number(prompt, completion):
                return float("nan") if completion == "nan" else 0.5

            def sleeps(prompt, completion):
                time.sleep(float(completion))
                return 1.0

            def by_length(prompts, completions):
                return [float(len(c)) for c in completions]

            def short_list(prompts, completions):
                return [1.0]

            def leaks(prompt, completion):
                # Whatever it can read, returned: a str, refused by its type and never echoed.
                return os.environ.get("AWS_SECRET_ACCESS_KEY") or open("/proc/self/environ").read()

            def raises_what_it_read(prompt, completion):
                raise PermissionError("cannot use key " + completion)

            def reads_the_controllers_environ(prompt, completion):
                with open(f"/proc/{os.getppid()}/environ", "rb") as f:
                    return 1.0 if b"PATH=" in f.read() else 0.0

            def scores_unless_it_sees_keys(prompt, completion):
                env = open("/proc/self/environ", "rb").read()
                return os.environ.get("AWS_SECRET_ACCESS_KEY", 1.0 if b"AWS_" not in env else env)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return "odd_rewards"


@pytest.fixture
def runners() -> Iterator[list[RewardRunner]]:
    made: list[RewardRunner] = []
    yield made
    for r in made:
        r.close()


def test_math_verify_reads_boxed_latex_and_plain_answers(runners: list[RewardRunner]) -> None:
    runner = Runner(Reward(name="math_verify"), timeout=20)
    runners.append(runner)
    assert runner.score(_prompt("1/2"), [r"so \boxed{0.5}", r"\boxed{\frac{1}{2}}", "0.5", r"\boxed{1}", ""]) == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert runner.score(_prompt(r"\frac{3}{4}"), ["The answer is $0.75$.", "3/5"]) == [1.0, 0.0]
    assert runner.score(_prompt("1,000"), [r"\boxed{1000}"]) == [1.0]


def test_a_pathological_answer_times_out_and_the_next_call_is_scored(runners: list[RewardRunner]) -> None:
    runner = Runner(Reward(name="math_verify"), timeout=2)
    runners.append(runner)
    (first,) = runner.processes
    t0 = time.monotonic()
    scores = runner.score(_prompt("1"), [r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{1}"])
    assert time.monotonic() - t0 < 60
    assert scores == [RewardFailure("reward 'math_verify' timed out after 2 s")]
    assert runner.score(_prompt("1"), [r"\boxed{1}"]) == [1.0], "a fresh process scores the next group"
    assert first.poll() is not None, "the process that hung was killed"


def test_a_reward_that_raises_or_returns_no_number_fails_naming_the_type(
    module: str, runners: list[RewardRunner]
) -> None:
    raises = Runner(Reward(import_path=f"{module}:raises"), timeout=20)
    nan = Runner(Reward(import_path=f"{module}:not_a_number"), timeout=20)
    runners += [raises, nan]
    assert raises.score(_prompt("1"), ["ok", "boom", "ok"]) == [
        1.0,
        RewardFailure(f"reward '{module}:raises' raised ZeroDivisionError"),
    ], "scoring stops at the first failure: the group is dropped"
    assert raises.score(_prompt("1"), ["ok", "ok"]) == [1.0, 1.0], "and goes on with the next group"
    failure = RewardFailure(f"reward '{module}:raises' raised ZeroDivisionError")
    assert raises.score(_prompt("1"), ["boom", "ok", "boom"], stop_at_failure=False) == [failure, 1.0, failure], (
        "with onError score every completion gets its own score or failure"
    )
    assert nan.score(_prompt("1"), ["x"]) == [0.5]
    (out,) = nan.score(_prompt("1"), ["nan", "x"])
    assert isinstance(out, RewardFailure)
    assert "must return a finite float" in out.message


def test_each_call_has_its_own_timeout(module: str, runners: list[RewardRunner]) -> None:
    runner = Runner(Reward(import_path=f"{module}:sleeps"), timeout=1.5)
    runners.append(runner)
    assert runner.score(_prompt("1"), ["0.8", "0.8"]) == [1.0, 1.0], "two calls of 0.8 s, each under 1.5 s"
    assert runner.score(_prompt("1"), ["5", "0"]) == [RewardFailure(f"reward '{module}:sleeps' timed out after 1.5 s")]
    assert runner.score(_prompt("1"), ["0"]) == [1.0], "a fresh process scores the next group"


def test_a_batched_reward_scores_a_group_in_one_call(module: str, runners: list[RewardRunner]) -> None:
    runner = Runner(Reward(import_path=f"{module}:by_length", batched=True), timeout=20, batched=True)
    short = Runner(Reward(import_path=f"{module}:short_list", batched=True), timeout=20, batched=True)
    runners += [runner, short]
    assert runner.score(_prompt("1"), ["a", "abc", ""]) == [1.0, 3.0, 0.0]
    (out,) = short.score(_prompt("1"), ["a", "b"])
    assert isinstance(out, RewardFailure)
    assert "a list of 2 floats" in out.message


def test_a_reward_that_cannot_load_fails_the_start_not_the_first_step(module: str) -> None:
    with pytest.raises(RewardError, match="has no attribute 'missing'"):
        Runner(Reward(import_path=f"{module}:missing"), timeout=5).ready()
    with pytest.raises(RewardError, match="batched"):
        Runner(Reward(name="gsm8k"), timeout=5, batched=True)


def test_close_leaves_no_process(module: str) -> None:
    runner = Runner(Reward(import_path=f"{module}:raises"), timeout=5)
    assert runner.score(_prompt("1"), ["ok"]) == [1.0]
    (proc,) = runner.processes
    runner.close()
    assert proc.poll() is not None
    assert runner.processes == []


def test_the_reward_process_is_not_in_the_controllers_process_group(
    module: str, runners: list[RewardRunner], workers: int
) -> None:
    """A Ctrl-C or SIGTERM to the controller's group is the controller's (it takes a barrier cut)."""
    runner = Runner(Reward(import_path=f"{module}:raises"), timeout=5, workers=workers)
    runners.append(runner)
    runner.score(_prompt("1"), ["ok"] * 4)
    assert len(runner.processes) == workers
    assert all(os.getpgid(p.pid) != os.getpgid(0) for p in runner.processes)


ALLOWED_ENV = {
    *("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED"),
    *("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"),
}
STORAGE_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIA-the-key-id",
    "AWS_SECRET_ACCESS_KEY": "the-secret-access-key",
    "AWS_ENDPOINT_URL": "http://s3:9000",
    "SPOTRL_STORAGE": "s3://bucket/team/job",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(kv.split("=", 1) for kv in raw.split("\0") if kv)


def test_the_reward_process_holds_the_jobs_runtime_env_and_no_storage_keys(
    module: str, runners: list[RewardRunner], monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The controller holds the credentials Secret (envFrom); its reward's process starts with
    the allow-list and the job's runtimeEnv names only: the reward scores without the keys."""
    for name, value in {**STORAGE_ENV, "HF_TOKEN": "hf-of-the-job", "NOT_THE_JOBS": "x"}.items():
        monkeypatch.setenv(name, value)
    runner = Runner(
        Reward(import_path=f"{module}:scores_unless_it_sees_keys"),
        timeout=20,
        runtime_env_names=["HF_TOKEN"],
        workers=workers,
    )
    runners.append(runner)
    assert runner.score(_prompt("1"), ["x"] * 4) == [1.0] * 4, "no AWS_ variable, in os.environ or /proc/self/environ"
    assert len(runner.processes) == workers
    for proc in runner.processes:
        env = _environ_of(proc.pid)
        assert env["HF_TOKEN"] == "hf-of-the-job"
        assert env["PYTHONPATH"] == os.environ["PYTHONPATH"]
        assert {n for n in env if not n.startswith("LC_")} <= ALLOWED_ENV | {"HF_TOKEN"}, sorted(env)
        assert not {n for n in env if n.startswith(("AWS_", "SPOTRL_", "KUBERNETES_"))}


def test_what_a_reward_returns_or_raises_is_named_by_type_its_message_only_on_its_own_stderr(
    module: str,
    runners: list[RewardRunner],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    workers: int,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", STORAGE_ENV["AWS_SECRET_ACCESS_KEY"])
    leaks = Runner(Reward(import_path=f"{module}:leaks"), timeout=20, workers=workers)
    raises = Runner(Reward(import_path=f"{module}:raises_what_it_read"), timeout=20, workers=workers)
    runners += [leaks, raises]
    assert leaks.score(_prompt("1"), ["x"]) == [
        RewardFailure(f"reward '{module}:leaks' returned a str, not a number; it must return a float")
    ], "its environment, read and returned: the type is named, the value is not"
    assert raises.score(_prompt("1"), ["the-key-it-read"]) == [
        RewardFailure(f"reward '{module}:raises_what_it_read' raised PermissionError")
    ]
    err = capfd.readouterr().err
    assert "PermissionError: cannot use key the-key-it-read" in err, "its author debugs from the pod's log"
    assert err.strip().splitlines()[-1] == (
        f"spotrl: reward '{module}:raises_what_it_read' raised PermissionError (traceback above, from the reward's "
        "process)"
    ), "not the message: a crash now would make the log's last line the pod's termination message"


def test_the_controller_never_imports_the_reward(module: str, runners: list[RewardRunner], workers: int) -> None:
    runner = Runner(Reward(import_path=f"{module}:raises"), timeout=20, workers=workers)
    runners.append(runner)
    runner.ready()
    assert runner.score(_prompt("1"), ["ok"] * 4) == [1.0] * 4
    assert module not in sys.modules, "only the reward's process imported it"


def test_an_import_path_the_admin_does_not_allow_fails_before_any_process_starts(
    module: str, runners: list[RewardRunner]
) -> None:
    only_builtins = RewardIsolation(os.environ, ("spotrl_runtime.rewards",))
    with pytest.raises(RewardError, match=rf"^spec\.reward\.importPath '{module}:raises': module '{module}' is not"):
        Runner(Reward(import_path=f"{module}:raises"), timeout=5, isolation=only_builtins)
    builtin = Runner(
        Reward(import_path="spotrl_runtime.rewards.builtin:arithmetic_exact"), timeout=20, isolation=only_builtins
    )
    runners.append(builtin)
    assert builtin.score(_prompt("7"), ["7", "8"]) == [1.0, 0.0]


def test_the_process_is_no_security_boundary_a_reward_can_read_the_controllers_environ(
    module: str, runners: list[RewardRunner]
) -> None:
    """As docs/operations/security.md says: the reward runs as the pod's user, so it reads the
    environment the controller started with (in a pod: the credentials Secret's keys), and the
    admission policy, not this process, keeps a job's pods to what its author may read."""
    runner = Runner(Reward(import_path=f"{module}:reads_the_controllers_environ"), timeout=20)
    runners.append(runner)
    assert runner.score(_prompt("1"), ["x"]) == [1.0]


def test_a_reward_process_prints_its_traceback_and_line_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes of a pool share the pod's stderr: one write each (atomic on a pipe up to 4 KiB),
    so two printing at once never splice one's line into the other's traceback."""
    from spotrl_runtime.rewards.runner import _print_traceback

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    try:
        raise PermissionError("cannot use what the reward read")
    except PermissionError as err:
        _print_traceback(err, "reward 'probe' raised PermissionError")
    assert len(writes) == 1, writes
    (text,) = writes
    assert text.startswith("Traceback (most recent call last):\n")
    assert text.endswith(
        "PermissionError: cannot use what the reward read\n"
        "spotrl: reward 'probe' raised PermissionError (traceback above, from the reward's process)\n"
    )
