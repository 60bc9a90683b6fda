"""`spotrl worker`: the `ray start` it runs joins the head as a node of its own, bound to the
pod's address, with the worker resource and no fixed port; wildcards are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spotrl_runtime.cli import build_parser, main
from spotrl_runtime.commands.worker import ray_start_argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_ray_node_joins_the_head_on_the_pods_address_with_the_worker_resource() -> None:
    argv = ray_start_argv("127.0.1.2:40001", "127.0.2.7", "/tmp/ray-w-x", num_cpus=2, num_gpus=1)
    assert argv[1:4] == ["-m", "ray.scripts.scripts", "start"]
    assert flag(argv, "--address") == "127.0.1.2:40001"
    assert flag(argv, "--node-ip-address") == "127.0.2.7"
    assert json.loads(flag(argv, "--resources")) == {"spotrl.dev/worker": 1}
    assert (flag(argv, "--num-cpus"), flag(argv, "--num-gpus")) == ("2", "1")
    assert "--block" in argv
    assert "--head" not in argv
    assert "0.0.0.0" not in argv
    # Ray chooses every port: two worker pods on one host never both want the same one.
    for name in ("--dashboard-agent-listen-port", "--min-worker-port", "--max-worker-port"):
        assert flag(argv, name) == "0"
    assert "--port" not in argv


def test_a_trainer_node_offers_one_trainer_rank_slot_and_no_worker_slot() -> None:
    argv = ray_start_argv("127.0.1.2:40001", "127.0.2.7", "/tmp/ray-w-x", 1, 0, role="trainer")
    assert json.loads(flag(argv, "--resources")) == {"spotrl.dev/trainer": 1}
    assert build_parser().parse_args(["worker", "--address", "h:1"]).role == "worker"
    assert build_parser().parse_args(["worker", "--address", "h:1", "--role", "trainer"]).role == "trainer"


def test_cpus_and_gpus_are_left_to_ray_unless_given() -> None:
    argv = ray_start_argv("10.0.0.1:6379", "10.0.0.9", "/tmp/r", num_cpus=None, num_gpus=None)
    assert "--num-cpus" not in argv
    assert "--num-gpus" not in argv


def test_the_command_needs_an_address_and_refuses_a_wildcard_node_ip(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    assert "--address" in capsys.readouterr().err
    assert main(["worker", "--address", "127.0.1.2:1", "--node-ip", "0.0.0.0"]) == 2
    assert "not a wildcard" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--address", "head"], "--address"),
        (["--address", "head:0"], "--address"),
        (["--address", "head:6379", "--num-cpus", "0"], "--num-cpus"),
        (["--address", "head:6379", "--num-gpus", "-1"], "--num-gpus"),
        (["--address", "head:6379", "--node-ip", "my-pod"], "--node-ip"),
        (["--address", "head:6379", "--role", "learner"], "--role"),
    ],
)
def test_bad_worker_flags_are_one_line_and_exit_2_before_ray_starts(flags: list[str], named: str) -> None:
    spotrl = str(Path(sys.executable).parent / "spotrl")
    out = subprocess.run([spotrl, "worker", *flags], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert named in line
    assert "joining the Ray head" not in out.stdout
