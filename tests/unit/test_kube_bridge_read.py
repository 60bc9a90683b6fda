"""A controller starting up reads its RLJob: an API server it cannot reach yet is tried again
for a while (a node given back routes to it seconds after it says Ready); a refusal is not."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_runtime.controller import kube_bridge
from spotrl_runtime.controller.kube_bridge import KubeBridge
from spotrl_runtime.kube import KubeError


class FlakyApi:
    def __init__(self, errors: list[KubeError]):
        self.errors = errors
        self.calls = 0

    def get_job(self) -> dict[str, Any]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"metadata": {"name": "tiny"}}


def bridge(api: FlakyApi) -> KubeBridge:
    b = KubeBridge("tiny", "ns", 1, api_client=object())
    b._api = api  # type: ignore[assignment]
    return b


def unreachable() -> KubeError:
    return KubeError("GET", "/apis/...", 0, "Unreachable", "SSLError: connection broken")


def test_an_api_server_not_reachable_yet_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(kube_bridge.time, "sleep", waits.append)
    api = FlakyApi([unreachable(), KubeError("GET", "/x", 503, "ServiceUnavailable", ""), unreachable()])
    assert bridge(api).read_job()["metadata"]["name"] == "tiny"
    assert api.calls == 4
    assert waits == [0.5, 1.0, 2.0]


def test_a_refusal_is_not_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_bridge.time, "sleep", lambda s: pytest.fail("a 403 waited"))
    api = FlakyApi([KubeError("GET", "/x", 403, "Forbidden", "")])
    with pytest.raises(KubeError) as err:
        bridge(api).read_job()
    assert err.value.status == 403
    assert api.calls == 1


def test_it_gives_up_after_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_bridge.time, "sleep", lambda s: None)
    api = FlakyApi([unreachable() for _ in range(100)])
    with pytest.raises(KubeError):
        bridge(api).read_job(wait=0.0)
    assert api.calls == 1


def test_a_barrier_request_with_a_newer_operators_field_is_still_answered() -> None:
    barrier = kube_bridge._read_barrier({"requestId": "b-1", "state": "Requested", "priority": "high"})
    assert barrier is not None
    assert (barrier.request_id, barrier.state) == ("b-1", "Requested")


@pytest.mark.parametrize("doc", [{"requestId": "b-1", "state": "Withdrawn"}, {"state": "Requested"}, None, {}])
def test_a_barrier_this_version_cannot_read_is_no_request(doc: Any) -> None:
    assert kube_bridge._read_barrier(doc) is None
