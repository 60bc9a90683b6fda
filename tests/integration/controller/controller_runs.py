"""Running the real controller (`spotrl run`) as a subprocess and reading its audit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.forkserver import FORK_VAR, Child, ForkServer
from spotrl_runtime.checkpoint.layout import newest_committed
from spotrl_runtime.storage import Storage, open_storage

ROOT = Path(__file__).resolve().parents[3]

Process = subprocess.Popen[str] | Child
"""A run: forked by the fork server (the default), or started by ``subprocess`` (``Runs(fork=False)``)."""

_LOGS: weakref.WeakKeyDictionary[Process, Path] = weakref.WeakKeyDictionary()
"""Each run's log (:meth:`Runs.log_of`, and :func:`wait_for`'s failure when the run exits first)."""

_FORKSERVER: ForkServer | None = None
"""The fork server the runs are forked from (:attr:`Runs.forkserver`) and :func:`spotrl` forks
the short commands from, once the session's first run started it."""

TINY_JOB: dict[str, Any] = {
    "apiVersion": "spotrl.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "tiny"},
    "spec": {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "generation": {"groupSize": 8, "promptsPerStep": 16, "lookahead": 1, "maxNewTokens": 8},
        "training": {"totalSteps": 16, "learningRate": 0.0003, "microBatchSize": 64},
        "checkpoint": {"everySteps": 4, "keep": 3},
        "scheduling": {"terminationGracePeriodSeconds": 30},
    },
}


def chat_example(name: str = "cpu-chat-gsm8k.yaml") -> dict[str, Any]:
    """``examples/cpu-chat-gsm8k.yaml`` (or its twin ``name``), its dataset paths made absolute
    (runs start elsewhere)."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["spec"]["dataset"]["uri"] = str(ROOT / doc["spec"]["dataset"]["uri"])
    doc["spec"]["validation"]["dataset"] = str(ROOT / doc["spec"]["validation"]["dataset"])
    return doc


def run_example(runs: Runs, name: str, folder: str) -> tuple[Path, Path, int]:
    """(job file, store, steps) of ``examples/<name>`` (:func:`chat_example`) run once to its
    end under ``runs.base / folder``, never stopped."""
    doc = chat_example(name)
    job = runs.job(base=doc)
    store = runs.base / folder
    rc, log = runs.run(job, store)
    assert rc == 0, log
    steps = doc["spec"]["training"]["totalSteps"]
    assert [s for s, _ in stream(store)] == list(range(steps))
    return job, store, steps


def accuracy_before_and_after(
    runs: Runs, example: tuple[Path, Path, int], model: str, split: Path, prompts: int, limit: int | None = None
) -> tuple[float, float]:
    """Held-out accuracy (mean@4 over ``prompts`` rows of ``split``: its first ``limit``, or all)
    of ``model`` and of what ``example`` trained (`spotrl ckpt export`, then `spotrl eval`)."""
    job, store, steps = example
    exported = store.with_name(f"{store.name}-trained")
    out = spotrl(
        "ckpt", "export", str(store), "-f", str(job), "--out", str(exported), "--json",
        timeout=300, env=runs.env(), cwd=runs.base,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["trainer_step"] == steps
    found = []
    for policy in (model, str(exported)):
        args = ["eval", "-f", str(job), "--dataset", str(split), "--model", policy, "--samples", "4", "--json"]
        out = spotrl(*args, *(["--limit", str(limit)] if limit else []), timeout=300, env=runs.env(), cwd=runs.base)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["prompts"] == prompts
        assert result["completions"] == 4 * prompts
        assert result["reward_failed"] == 0
        found.append(float(result["accuracy"]))
    print(f"held-out accuracy (mean@4, {prompts} prompts): {found[0]:.3f} -> {found[1]:.3f}")
    return found[0], found[1]


def fsdp(ranks: int) -> dict[str, Any]:
    """:meth:`Runs.job` overrides for a trainer group of ``ranks`` FSDP2 ranks (gloo on CPU)."""
    # The controller's Ray has 2 CPUs and the generation worker takes one: the ranks share the other.
    return {"training.parallelism": {"strategy": "fsdp", "ranks": ranks, "cpusPerRank": round(1 / ranks, 3)}}


class Runs:
    """Starts `spotrl run` processes that share one model cache and short Ray folders. The demo
    policy comes prebuilt, as the runtime image ships it (``SPOTRL_PREBUILT_MODELS``): built
    once into the user's model cache (under its lock) for every suite that runs at the same
    time, not again in each session's cache, where a cold build (its CPU time, more beside
    another lane) counted against the first test's wait for its run."""

    def __init__(self, base: Path, fork: bool = os.environ.get(FORK_VAR, "1") != "0"):
        self.base = base
        self.cache = base / "cache"
        self.ray_tmp = Path(os.environ.get("SPOTRL_TEST_RAY_TMP", "/tmp"))
        self.n = 0
        self.markers: dict[int, str] = {}
        self.fork = fork

    def job(self, overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> Path:
        """A job file: ``base`` (default: :data:`TINY_JOB`) with ``overrides`` (``"a.b": value``
        under ``spec``)."""
        doc = json.loads(json.dumps(base or TINY_JOB))
        for path, value in (overrides or {}).items():
            node = doc["spec"]
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        self.n += 1
        path = self.base / f"job-{self.n}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    @cached_property
    def prebuilt(self) -> dict[str, str]:
        from spotrl_e2e.cluster import runtime_image_env

        return runtime_image_env()

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SPOTRL_CACHE=str(self.cache),
            **self.prebuilt,
            SPOTRL_RAY_TMP=str(self.ray_tmp),
            RAY_AUTH_MODE="disabled",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def start(self, job: Path, storage: Path | str, *args: str, new_session: bool = False, **env: str) -> Process:
        """`spotrl run` in the background. ``new_session``: as the leader of a process group of
        its own (its pid is the group's id), as a shell starts a command, for ``os.killpg``."""
        self.n += 1
        path = self.base / f"run-{self.n}.log"
        marker = f"{self.base}#{self.n}"
        argv = [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(job), "--storage", str(storage), *args]
        run_env = self.env(**env, SPOTRL_TEST_RUN=marker)
        proc: Process
        if self.fork:
            proc = self.forkserver.spawn(argv, run_env, self.base, path, new_session=new_session)
        else:
            with open(path, "w") as log:
                proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=run_env,
                    cwd=self.base,
                    start_new_session=new_session,
                )
        _LOGS[proc] = path
        self.markers[proc.pid] = marker
        return proc

    @property
    def forkserver(self) -> ForkServer:
        """The warm parent the runs are forked from (:mod:`spotrl_e2e.forkserver`), started
        with the first run; :func:`spotrl` forks the short commands from it too."""
        global _FORKSERVER
        if _FORKSERVER is None:
            _FORKSERVER = ForkServer(self.env(), self.base, marker="SPOTRL_TEST_RUN")
        return _FORKSERVER

    def close(self) -> None:
        global _FORKSERVER
        if _FORKSERVER is not None:
            _FORKSERVER.close()
            _FORKSERVER = None

    def run(self, job: Path, storage: Path | str, *args: str, timeout: float = 420, **env: str) -> tuple[int, str]:
        proc = self.start(job, storage, *args, **env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return rc, self.log_of(proc)

    def log_of(self, proc: Process) -> str:
        return _LOGS[proc].read_text()

    def processes_of(self, proc: Process) -> list[int]:
        """The live processes of the run ``proc`` started (Ray's, the generation workers, the
        trainer ranks, wherever they were reparented): those with its ``SPOTRL_TEST_RUN``, the
        Ray workers the fork server forked for it (their ``/proc`` environment is the server's),
        and its reward's process, whose environment has none (its command line ends with the run's pid)."""
        entry = f"SPOTRL_TEST_RUN={self.markers[proc.pid]}".encode()
        found = _FORKSERVER.workers_with(self.markers[proc.pid]) if _FORKSERVER else []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            except OSError:
                continue  # gone, or not ours to read
            reward = "spotrl_runtime.rewards.child" in argv and argv[-1] == str(proc.pid)
            if int(pid) != proc.pid and (entry in environ.split(b"\0") or reward):
                found.append(int(pid))
        return found

    def assert_nothing_left(self, proc: Process, timeout: float = 30) -> None:
        """Waits until no process of the run that ``proc`` (exited) started is alive."""
        left: list[int] = []

        def gone() -> bool:
            left[:] = self.processes_of(proc)
            return not left

        try:
            wait_for(gone, timeout, "the run's processes to stop")
        except AssertionError:
            names = [_command(pid) for pid in left]
            raise AssertionError(f"still running {timeout:.0f} s after the run exited: {names}") from None


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120] or str(pid)
    except OSError:
        return str(pid)


def spotrl(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`spotrl ARGS` in ``env`` (default: the tests') and ``cwd``, its output captured: forked
    from the runs' fork server once it started (`spotrl ckpt verify`, `eval` and `export` import
    torch: seconds of CPU each, beside another lane), else a process of its own."""
    argv = [sys.executable, "-m", "spotrl_runtime.cli", *args]
    env = dict(os.environ) if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if _FORKSERVER is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="spotrl-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = _FORKSERVER.spawn(argv, env, cwd, out, stderr=err)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)
            raise
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())


def audit(storage: Path, *extra: str) -> list[dict[str, Any]]:
    """`spotrl audit` of a run; [] before its first trained step."""
    out = spotrl("audit", str(storage), *extra)
    if out.returncode == 1 and "holds no audit records" in out.stderr:
        return []
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def audit_summary(storage: Path) -> dict[str, Any]:
    """`spotrl audit --summary --json` of a run: its accounting and the rollout gap."""
    (summary,) = audit(storage, "--summary", "--json")
    return summary


def verify(job: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """`spotrl ckpt verify ROOT -f JOB --json`: the newest cut of a store, against its job."""
    return spotrl("ckpt", "verify", str(root), "-f", str(job), "--json")


def stream(storage: Path) -> list[tuple[int, list[int]]]:
    """The effective stream: (step, prompt idxs) per step."""
    return [(d["step"], d["prompts"]) for d in audit(storage)]


def wait_for(predicate: Any, timeout: float, what: str, proc: Process | None = None, interval: float = 0.05) -> None:
    """Polls ``predicate`` every ``interval`` s (longer for one that reads a store: the other lane
    needs the CPU) until it holds; fails on the timeout or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}; its log ends:\n{_log_tail(proc)}")
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def _log_tail(proc: Process, lines: int = 60) -> str:
    """The last ``lines`` of the log of a run :class:`Runs` started (a crash's stacks among them)."""
    path = _LOGS.get(proc)
    if path is None:
        return "(not a run of Runs: no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: Process, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def newest_cut(storage: Path) -> tuple[str, str, int]:
    """(id, kind, trainer step) of the newest committed cut."""
    store = open_storage(str(storage))
    cut_id = newest_committed(store)
    assert cut_id is not None
    manifest = json.loads(store.get_bytes(f"cuts/{cut_id}/manifest.json"))
    return cut_id, manifest["kind"], manifest["trainer_step"]


def final_weights(store: Path | Storage, *, optimizer: bool = False) -> dict[str, Any]:
    """The weights of the store's newest cut (a finished run's final, full cut), a local folder or
    any store (S3). With ``optimizer``, its optimizer's state too, flattened under ``optimizer/``
    (each parameter's moments and step count, the param groups): the trainer state a resume
    must restore besides the weights, for :func:`assert_same_weights`."""
    import io

    import torch

    storage = open_storage(str(store)) if isinstance(store, Path) else store
    cut_id = newest_committed(storage)
    assert cut_id is not None
    manifest = json.loads(storage.get_bytes(f"cuts/{cut_id}/manifest.json"))
    assert manifest["form"] == "full", manifest

    def load(path: str) -> Any:
        data = io.BytesIO(storage.get_bytes(f"cuts/{cut_id}/{path}"))
        return torch.load(data, map_location="cpu", weights_only=True)

    weights: dict[str, Any] = {}
    for f in sorted(manifest["files"], key=lambda f: f["path"]):
        if f["role"] == "weights":
            weights.update(load(f["path"]))
    assert weights
    if optimizer:
        (path,) = [f["path"] for f in manifest["files"] if f["role"] == "optimizer"]
        weights.update(_flat(load(path), "optimizer"))
    return weights


def _flat(value: Any, key: str) -> dict[str, Any]:
    """A nested state dict's leaves by their path (``optimizer/state/0/exp_avg``)."""
    if isinstance(value, dict):
        return {k: v for name, item in value.items() for k, v in _flat(item, f"{key}/{name}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{key}/{i}").items()}
    return {key: value}


def assert_same_weights(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit (one CPU process each); values that are not tensors (an optimizer's learning
    rate, its step counts) equal."""
    import torch

    assert got.keys() == want.keys()

    def same(a: Any, b: Any) -> bool:
        return torch.equal(a, b) if isinstance(b, torch.Tensor) else bool(a == b)

    differ = [k for k in want if not same(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ from the uninterrupted run's: {differ[:5]}"


def assert_same_trainer_state(store: Path | Storage, baseline: Path) -> None:
    """The final cut of ``store`` holds the weights and optimizer state of the uninterrupted
    run's (in ``baseline``), bit for bit: a resume restored the trainer state it cut, as the
    stream alone (which does not depend on the weights) cannot tell.

    Unless a group was generated by other weights than its admission version, which the run
    counts (``version_mismatches``, docs/concepts/delta-cuts.md): a barrier cut taken while the
    trainer waited for its groups cannot rebuild the older version a relaunched group asks for,
    and a group generated by newer weights rightly trains other tokens. Whether that happens is
    the timing of the stop; both runs of the same timing end in the same state."""
    from spotrl_runtime.controller.audit_store import AuditStore

    storage = open_storage(str(store)) if isinstance(store, Path) else store
    mismatched = sum(int(d.get("version_mismatches") or 0) for d in AuditStore(storage).documents())
    if mismatched:
        print(f"{mismatched} group(s) generated by newer weights than admitted: the trainer state may rightly differ")
        return
    assert_same_weights(final_weights(store, optimizer=True), final_weights(baseline, optimizer=True))


def assert_admission_versions(storage: Path) -> None:
    """Every trained step's groups were generated by the weights they were admitted with."""
    from spotrl_runtime.controller.audit_store import AuditStore

    steps = AuditStore(open_storage(str(storage))).documents()
    assert steps
    bad = [(d["step"], d["attempt"], d.get("version_mismatches")) for d in steps if d.get("version_mismatches") != 0]
    assert not bad, f"steps with groups generated by other weights than their admission version: {bad}"


def kill_rng() -> tuple[int, random.Random]:
    """(seed, RNG) of a test's random kill points: ``SPOTRL_KILL_SEED`` replays a run's; else one
    is drawn, and printed so that a failure can be replayed."""
    seed = int(os.environ.get("SPOTRL_KILL_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"SPOTRL_KILL_SEED={seed}")
    return seed, random.Random(seed)


def killed_in_step(
    runs: Runs, job: Path, storage: Path, marks: Path, step: int, rng: random.Random, hold: float = 30
) -> Process:
    """A run held in step ``step`` (up to ``hold`` s) and SIGKILLed there at a random moment;
    nothing of it is left running."""
    marks.mkdir()
    proc = runs.start(job, storage, SPOTRL_FAILPOINTS=f"train.step@{step}={hold:g}", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, f"step {step}", proc)
    time.sleep(rng.uniform(0, 0.3))
    assert stop(proc, signal.SIGKILL) == -signal.SIGKILL
    runs.assert_nothing_left(proc)
    return proc
