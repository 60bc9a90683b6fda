"""How a `spotrl` command ends (`spotrl_runtime.cli.exit_process`): as ``sys.exit`` would for
everything a command relies on (its code, the threads that are not daemons finished, the
``atexit`` functions run, its output flushed), without the interpreter's finalization, where a
controller stopped during start-up crashed beside Ray's threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from spotrl_runtime.cli import exit_process

out = Path(sys.argv[1])

def late():
    time.sleep(0.3)
    with out.open("a") as f:
        f.write("thread\\n")

class Finalized:
    def __del__(self):
        with out.open("a") as f:
            f.write("finalized\\n")

threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)  # never shut down: its idle worker is a thread that is not a daemon
pool.submit(print, end="")
atexit.register(lambda: out.open("a").write("atexit\\n"))
keep = Finalized()  # a module global: only the interpreter's finalization collects it
print("unflushed", end="")
sys.stderr.write("to stderr")
exit_process(7)
"""


def test_it_exits_with_the_code_after_the_threads_and_atexit_flushed_and_without_finalizing(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(marks)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert (done.stdout, done.stderr) == ("unflushed", "to stderr"), "buffered output is flushed"
    assert marks.read_text().splitlines() == ["thread", "atexit"], "the thread finished first; no finalization"
    # (An executor never shut down does not hold the exit: it is told to stop, as at any exit.)


SITECUSTOMIZE = """
import sys
class Finalized:
    def __del__(self):
        sys.__stderr__.write("finalized")
keep = Finalized()  # collected by the interpreter's finalization only
"""


def test_the_console_script_and_python_dash_m_end_through_it(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    job = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml")
    script = str(Path(sys.executable).with_name("spotrl"))
    for argv in ([sys.executable, "-m", "spotrl_runtime.cli"], [script]):
        done = subprocess.run([*argv, "validate", "-f", job], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "finalized" not in done.stderr, argv
    # The probe itself works: a plain exit finalizes.
    plain = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, env=env, timeout=60)
    assert "finalized" in plain.stderr
