"""The controller's own Ray head (``start_ray``), started for real in a child process (this
pytest process has the session's Ray already, and ``start_ray`` would leave that alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROGRAM = r"""
import json, os, time
from spotrl_runtime.generation.cluster import start_ray

runtime = start_ray(None, False, 2)
import ray

@ray.remote(num_cpus=1)
class Echo:
    def pid(self):
        return os.getpid(), os.environ.get("OMP_NUM_THREADS")

def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
# The workers Ray prestarts for the first driver (one per CPU), before any actor is asked for.
for _ in range(200):
    idle = [int(p) for p in os.listdir("/proc") if p.isdigit() and cmdline(p).startswith("ray::IDLE")]
    if len(idle) >= 2:
        break
    time.sleep(0.1)
actor_pid, omp = ray.get(Echo.remote().pid.remote())
# Ray's processes run in sessions of their own (not this process's descendants once
# re-parented): find them by the folder every one of them is given.
ours = [cmdline(p) for p in os.listdir("/proc") if p.isdigit() and runtime.folder in cmdline(p)]
folder = runtime.folder
runtime.shutdown()
for _ in range(50):
    left = [p for p in os.listdir("/proc") if p.isdigit() and folder in cmdline(p)]
    if not left:
        break
    time.sleep(0.1)
seen = {"actor": actor_pid, "omp": omp, "prestarted": idle, "processes": ours, "left": left}
print(json.dumps({**seen, "folder_left": os.path.exists(folder)}))
"""


def test_the_controllers_ray_head_runs_actors_in_prestarted_workers_without_unused_services(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "SPOTRL_RAY_TMP": "/tmp"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["actor"] > 0
    # The actor took a prestarted worker (a job-wide runtime_env made it wait for a process
    # of its own), and Ray gave it one thread per CPU it holds.
    assert seen["actor"] in seen["prestarted"], seen
    assert seen["omp"] == "1", seen
    started = "\n".join(seen["processes"])
    for needed in ("gcs_server", "raylet"):
        assert needed in started, started
    for unused in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py"):
        assert unused not in started, f"{unused} was started:\n{started}"
    assert seen["left"] == [], "Ray's processes outlived its shutdown"
    assert not seen["folder_left"], "Ray's folder outlived its shutdown"
