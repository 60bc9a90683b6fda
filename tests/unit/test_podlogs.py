"""The kind harness's pod log keeper (spotrl_e2e.podlogs): which ``kubectl logs`` a pod needs,
where they write, and the keeper against a fake kubectl."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from spotrl_e2e.podlogs import LogTask, PodLogKeeper, log_path, safe_name, tasks_for


def pod(*statuses: dict[str, Any], init: tuple[dict[str, Any], ...] = (), name: str = "job-controller-0") -> dict:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": "u1"},
        "status": {"initContainerStatuses": list(init), "containerStatuses": list(statuses)},
    }


def running(name: str, cid: str, restarts: int = 0, last: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"name": name, "containerID": cid, "restartCount": restarts, "state": {"running": {}}}
    if last:
        status["lastState"] = {"terminated": {"exitCode": 1, "containerID": last}}
    return status


def terminated(name: str, cid: str) -> dict[str, Any]:
    return {"name": name, "containerID": cid, "restartCount": 0, "state": {"terminated": {"exitCode": 1}}}


def waiting(name: str) -> dict[str, Any]:
    return {"name": name, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}


def test_a_running_pod_gets_a_follower_for_each_container() -> None:
    tasks = tasks_for(pod(running("controller", "c://1"), running("sidecar", "c://2")), set())
    assert [(t.container, t.previous, t.restarts) for t in tasks] == [
        ("controller", False, 0),
        ("sidecar", False, 0),
    ]
    assert {(t.namespace, t.pod) for t in tasks} == {("ns", "job-controller-0")}


def test_a_terminated_container_not_followed_yet_gets_one_and_a_waiting_one_none() -> None:
    tasks = tasks_for(pod(terminated("controller", "c://1"), waiting("sidecar")), set())
    assert [(t.container, t.previous) for t in tasks] == [("controller", False)]


def test_an_already_followed_container_gets_none() -> None:
    p = pod(running("controller", "c://1"))
    started = {t.key for t in tasks_for(p, set())}
    assert tasks_for(p, started) == []
    # ended since: the same instance, nothing new
    assert tasks_for(pod(terminated("controller", "c://1")), started) == []


def test_a_restarted_container_gets_its_new_instance_followed_and_the_previous_fetched_once() -> None:
    started = {t.key for t in tasks_for(pod(running("operator", "c://1")), set())}
    after = pod(running("operator", "c://2", restarts=1, last="c://1"))
    tasks = tasks_for(after, started)
    assert [(t.previous, t.restarts) for t in tasks] == [(False, 1), (True, 1)]
    started |= {t.key for t in tasks}
    assert tasks_for(after, started) == []
    # a second restart: the next instance, and its previous once more
    again = tasks_for(pod(running("operator", "c://3", restarts=2, last="c://2")), started)
    assert [(t.previous, t.restarts) for t in again] == [(False, 2), (True, 2)]


def test_init_containers_are_included_first() -> None:
    p = pod(waiting("controller"), init=(terminated("fetch", "c://0"),))
    assert [t.container for t in tasks_for(p, set())] == ["fetch"]


def test_a_pod_recreated_under_the_same_name_is_followed_again() -> None:
    first = pod(running("controller", "c://1"))
    started = {t.key for t in tasks_for(first, set())}
    second = pod(running("controller", "c://1"))
    second["metadata"]["uid"] = "u2"
    assert len(tasks_for(second, started)) == 1


def test_paths_follow_the_layout() -> None:
    out = Path("/out")
    assert log_path(out, LogTask("k", "ns", "p", "c", 0)) == out / "ns/p/c.log"
    assert log_path(out, LogTask("k", "ns", "p", "c", 2)) == out / "ns/p/c.restart-2.log"
    assert log_path(out, LogTask("k", "ns", "p", "c", 2, previous=True)) == out / "ns/p/c.previous-2.log"


def test_paths_stay_under_the_folder_whatever_the_names() -> None:
    out = Path("/out")
    for name in ("..", ".", "", "a/../../b", "/etc/passwd", "x" * 400, "é ü\n"):
        path = log_path(out, LogTask("k", name, name, name, 0))
        assert path.parts[: len(out.parts)] == out.parts
        assert len(path.parts) == len(out.parts) + 3
        assert all(part not in ("", ".", "..") and len(part) < 255 for part in path.parts[len(out.parts) :])
    assert safe_name("job-controller-0") == "job-controller-0"


FAKE_KUBECTL = """#!/bin/sh
# get: pods.json beside it; logs: its own arguments, as the container's log.
case " $* " in
  *" get "*) cat "$(dirname "$0")/pods.json" ;;
  *" logs "*) echo "log of: $*" ;;
esac
"""


def test_the_keeper_writes_each_containers_log_and_stops(tmp_path: Path) -> None:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(0o755)
    pods = {"items": [pod(running("operator", "c://2", restarts=1, last="c://1"), name="spotrl-0")]}
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    out = tmp_path / "out"
    keeper = PodLogKeeper(tmp_path / "kubeconfig", kubectl, out, interval=0.05).start()
    try:
        follow, previous = out / "ns/spotrl-0/operator.restart-1.log", out / "ns/spotrl-0/operator.previous-1.log"
        deadline = time.monotonic() + 10
        while not (_ends_with_log(follow) and _ends_with_log(previous)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        keeper.stop()
    assert not keeper._thread.is_alive()
    # started once each, though the pod was listed many times
    assert follow.read_text().count("log of:") == 1
    assert "--follow" in follow.read_text()
    assert "--previous" in previous.read_text()
    assert follow.read_text().startswith("# spotrl pod-logs: ")


def _ends_with_log(path: Path) -> bool:
    return path.exists() and "log of:" in path.read_text()
