"""The fork server the suites start `spotrl` commands from (`spotrl_e2e.forkserver`): a forked
command gets its own argv, environment (and nothing of the server's), working directory,
``PYTHONPATH``, log and session, and the test sees its exit status as ``Popen`` reports it,
signals included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrl_e2e.forkserver import ForkServer

PROBE = """
import json, os, sys, time
if sys.argv[1] == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
if sys.argv[1] == "crash":
    __import__("ctypes").string_at(0)  # SIGSEGV
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "pgid": os.getpgid(0),
    "own": os.environ.get("OWN"), "server_only": os.environ.get("SERVER_ONLY"),
    "helper": __import__("probe_helper").VALUE, "tmp": __import__("tempfile").gettempdir(),
    "preloaded": os.environ.get("SET_BY_A_PRELOADED_MODULE"), "path": sys.path,
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    env = {**os.environ, "SERVER_ONLY": "the server's"}
    (tmp_path / "preloaded").mkdir()
    (tmp_path / "preloaded" / "sets_env.py").write_text(
        "import os, tempfile\ntempfile.gettempdir()\nos.environ['SET_BY_A_PRELOADED_MODULE'] = 'yes'\n"
    )
    env["PYTHONPATH"] = str(tmp_path / "preloaded")
    s = ForkServer(env, tmp_path, preload=("json", "sets_env"))
    yield s
    s.close()


def _command(tmp_path: Path, code: str) -> tuple[list[str], dict[str, str], Path]:
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "probe_cmd.py").write_text(PROBE)
    (tmp_path / "mods" / "probe_helper.py").write_text("VALUE = 'found on PYTHONPATH'\n")
    env = {"PATH": os.environ["PATH"], "OWN": "the command's", "PYTHONPATH": str(tmp_path / "mods")}
    env["TMPDIR"] = str(tmp_path)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return [sys.executable, "-m", "probe_cmd", code], env, work


def test_a_forked_command_has_its_own_argv_env_cwd_path_and_log_and_its_exit_code(
    server: ForkServer, tmp_path: Path
) -> None:
    argv, env, work = _command(tmp_path, "3")
    log = tmp_path / "out.log"
    child = server.spawn(argv, env, work, log)
    assert child.wait(timeout=30) == 3
    assert (child.poll(), child.returncode) == (3, 3)
    first, second = log.read_text().splitlines()
    seen = json.loads(first)
    assert seen["argv"] == ["3"]
    assert (seen["cwd"], seen["path0"]) == (str(work), str(work))
    assert (seen["own"], seen["server_only"]) == ("the command's", None)
    assert seen["helper"] == "found on PYTHONPATH"
    assert seen["tmp"] == str(tmp_path), "the command's $TMPDIR, not the one the server's imports asked for"
    assert seen["preloaded"] == "yes", "what a preloaded module put in the environment, as in a process of its own"
    assert str(tmp_path / "preloaded") not in seen["path"], "the server's PYTHONPATH is not the command's"
    assert seen["pgid"] != child.pid, "no session of its own unless asked"
    assert second == "to stderr"


def test_signals_reach_the_command_and_its_death_reads_as_popen_reports_it(server: ForkServer, tmp_path: Path) -> None:
    argv, env, work = _command(tmp_path, "sleep")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        log = tmp_path / f"{sig}.log"
        child = server.spawn(argv, env, work, log, new_session=True)
        deadline = time.monotonic() + 30
        while "sleeping" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.getpgid(child.pid) == child.pid, "the leader of a session of its own"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
        assert child.poll() is None
        child.send_signal(sig)
        assert child.wait(timeout=30) == -sig


def test_a_commands_stderr_can_go_to_a_file_of_its_own(server: ForkServer, tmp_path: Path) -> None:
    argv, env, work = _command(tmp_path, "0")
    out, err = tmp_path / "out", tmp_path / "err"
    assert server.spawn(argv, env, work, out, stderr=err).wait(timeout=30) == 0
    assert json.loads(out.read_text())["argv"] == ["0"], "stdout alone"
    assert err.read_text() == "to stderr\n"


def test_a_command_that_crashes_leaves_its_stacks_in_its_own_log(server: ForkServer, tmp_path: Path) -> None:
    """The suites set ``PYTHONFAULTHANDLER`` (tests/conftest.py): the server's handler writes
    to file descriptor 2, which in the fork is the command's log."""
    assert os.environ.get("PYTHONFAULTHANDLER"), "tests/conftest.py sets it for every test"
    argv, env, work = _command(tmp_path, "crash")
    log = tmp_path / "crash.log"
    child = server.spawn(argv, env, work, log)
    assert child.wait(timeout=30) == -signal.SIGSEGV
    text = log.read_text()
    assert "Fatal Python error: Segmentation fault" in text
    assert "probe_cmd.py" in text, text


def test_it_forks_python_dash_m_and_the_spotrl_script_and_refuses_anything_else(server: ForkServer) -> None:
    bin_dir = Path(sys.executable).parent
    assert server.module_of([sys.executable, "-m", "spotrl_runtime.cli", "run"]) == "spotrl_runtime.cli"
    assert server.module_of([str(bin_dir / "spotrl"), "controller"]) == "spotrl_runtime.cli"
    assert server.module_of(["/usr/bin/python3", "-m", "x"]) is None, "another Python"
    assert server.module_of(["spotrl", "run"], path=f"/nowhere:{bin_dir}") == "spotrl_runtime.cli", "found on PATH"
    assert server.module_of(["spotrl", "run"], path="/nowhere") is None
    assert server.module_of(["/bin/sh", "-c", "true"]) is None
    with pytest.raises(ValueError, match="python -m MODULE"):
        server.spawn(["/bin/sh", "-c", "true"], {}, Path("/"), Path("/dev/null"))


WORKER = """
import json, os, signal, sys, time
# The handler is in place before the line the test waits for: the test signals once it has read it.
if sys.argv[1] == "sleep":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
print(json.dumps({
    "argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
    "own": os.environ.get("OWN"), "path0": sys.path[0], "stdin": sys.stdin.readline().strip(),
}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _ray_worker(tmp_path: Path) -> Path:
    """A stand-in for Ray's worker script, at the path the shim recognises."""
    script = tmp_path / "site" / "ray" / "_private" / "workers" / "default_worker.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(WORKER)
    return script


def _start_worker(server: ForkServer, tmp_path: Path, arg: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """Starts the worker as Ray's raylet does: ``sys.executable`` (the launcher) SCRIPT ARGS."""
    assert server.python is not None
    env = {"PATH": os.environ["PATH"], "OWN": "the worker's", "MARK": "run-1"}
    shim = subprocess.Popen(
        [server.python, str(_ray_worker(tmp_path)), arg],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shim.stdin is not None
    assert shim.stdout is not None
    shim.stdin.write("through the shim's stdin\n")
    shim.stdin.flush()
    return shim, json.loads(shim.stdout.readline())


@pytest.fixture
def ray_server(tmp_path: Path) -> Iterator[ForkServer]:
    s = ForkServer(dict(os.environ), tmp_path, preload=("json",), ray_workers=True, marker="MARK")
    s._await_ready()
    yield s
    s.close()


def test_a_ray_worker_is_forked_from_the_server_with_the_shims_argv_env_cwd_and_streams(
    ray_server: ForkServer, tmp_path: Path
) -> None:
    shim, seen = _start_worker(ray_server, tmp_path, "5")
    assert seen["pid"] != shim.pid, "a process of its own, not the shim exec'd"
    assert seen["ppid"] == ray_server._proc.pid, "a fork of the server"
    assert seen["argv"] == [str(_ray_worker(tmp_path)), "5"]
    assert (seen["cwd"], seen["own"]) == (str(tmp_path), "the worker's")
    assert seen["path0"] == str(_ray_worker(tmp_path).parent), "a script's folder first, as `python SCRIPT`"
    assert seen["stdin"] == "through the shim's stdin"
    assert shim.wait(timeout=30) == 5, "the shim exits as its worker did"


def test_the_shim_forwards_signals_and_its_death_ends_the_worker(ray_server: ForkServer, tmp_path: Path) -> None:
    shim, seen = _start_worker(ray_server, tmp_path, "sleep")
    worker = int(seen["pid"])  # type: ignore[call-overload]
    # The server's note of the fork comes on its own stream, maybe after the worker's first line.
    deadline = time.monotonic() + 30
    while ray_server.workers_with("run-1") != [worker] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ray_server.workers_with("run-1") == [worker]
    assert ray_server.workers_with("run-2") == []
    shim.send_signal(signal.SIGTERM)
    assert shim.stdout is not None
    assert shim.stdout.readline().strip() == "got SIGTERM"
    assert shim.wait(timeout=30) == 7

    shim, seen = _start_worker(ray_server, tmp_path, "sleep")
    worker = int(seen["pid"])  # type: ignore[call-overload]
    shim.kill()
    assert shim.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while ray_server.workers_with("run-1") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ray_server.workers_with("run-1") == [], "killed and reaped with its shim"
    assert not Path(f"/proc/{worker}").exists()


def test_a_worker_killed_by_a_signal_ends_its_shim_by_the_same_signal(ray_server: ForkServer, tmp_path: Path) -> None:
    shim, seen = _start_worker(ray_server, tmp_path, "sleep")
    os.kill(int(seen["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    assert shim.wait(timeout=30) == -signal.SIGKILL


def test_the_launcher_execs_anything_but_a_ray_worker_and_adds_nothing_to_its_environment(
    ray_server: ForkServer, tmp_path: Path
) -> None:
    assert ray_server.python is not None
    probe = "import json, os, sys; print(json.dumps([os.getppid(), sys.flags.isolated, sorted(os.environ)]))"
    out = subprocess.run(
        [ray_server.python, "-c", probe],
        env={"PATH": os.environ["PATH"], "ONLY": "this"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    ppid, isolated, names = json.loads(out.stdout)
    assert ppid == os.getpid(), "exec'd in place: this test's child"
    assert isolated == 0, "with the flags it was given, not the shim's"
    # Under the C locale Python sets LC_CTYPE for itself (PEP 538), shim or not.
    names = [name for name in names if name != "LC_CTYPE"]
    assert names == ["ONLY", "PATH"], "the environment it was given, nothing added (a shell adds PWD)"


def test_a_forked_commands_python_is_the_launcher(ray_server: ForkServer, tmp_path: Path) -> None:
    _argv, env, work = _command(tmp_path, "0")
    (tmp_path / "mods" / "exe_probe.py").write_text("import sys; print(sys.executable)\n")
    log = tmp_path / "exe.log"
    child = ray_server.spawn([sys.executable, "-m", "exe_probe"], env, work, log)
    assert child.wait(timeout=30) == 0
    assert log.read_text().strip() == ray_server.python
