"""The operator's flags and their environment fallbacks."""

from __future__ import annotations

import argparse

import pytest

from spotrl_operator.settings import DEFAULT_DEADLINE_CAPS, add_arguments, from_args


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTRL_WATCH_NAMESPACES", raising=False)
    s = from_args(
        parse(
            [
                "--runtime-image=reg/rt:1",
                "--default-storage=s3://b/p",
                "--extra-taint-key=a/*",
                "--extra-taint-key=b",
                "--deadline-cap=karpenter=60",
                "--namespace=x",
                "--runtime-env=HF_HOME=/cache",
                "--no-leader-election",
                "--reconcile-interval=0.5",
            ]
        )
    )
    assert s.runtime_image == "reg/rt:1"
    assert s.default_storage == "s3://b/p"
    assert s.extra_taint_keys == ("a/*", "b")
    assert s.deadline_caps == {**DEFAULT_DEADLINE_CAPS, "karpenter": 60}
    assert s.namespaces == ("x",)
    assert s.extra_env == {"HF_HOME": "/cache"}
    assert s.leader_election is False
    assert s.reconcile_interval == 0.5


def test_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_DEFAULT_STORAGE", "s3://env/root")
    monkeypatch.setenv("SPOTRL_WATCH_NAMESPACES", "a, b")
    monkeypatch.setenv("POD_NAMESPACE", "spotrl-system")
    monkeypatch.setenv("POD_NAME", "spotrl-operator-abc")
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    s = from_args(parse([]))
    assert s.default_storage == "s3://env/root"
    assert s.namespaces == ("a", "b")
    assert s.lease_namespace == "spotrl-system"
    assert s.identity == "spotrl-operator-abc"
    assert s.metrics_address == "10.0.0.7"


def test_malformed_flags_name_themselves() -> None:
    with pytest.raises(SystemExit, match="--deadline-cap gke=soon"):
        from_args(parse(["--deadline-cap=gke=soon"]))
    with pytest.raises(SystemExit, match="--runtime-env"):
        from_args(parse(["--runtime-env=NOVALUE"]))


def test_a_service_link_variable_in_a_numeric_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Service named spotrl-metrics injects into a pod with service links on (seen on kind)."""
    monkeypatch.setenv("SPOTRL_METRICS_PORT", "tcp://10.96.6.209:9400")
    with pytest.raises(SystemExit, match=r"\$SPOTRL_METRICS_PORT='tcp://10.96.6.209:9400' is not an integer"):
        parse([])
    monkeypatch.setenv("SPOTRL_METRICS_PORT", "9500")
    monkeypatch.setenv("SPOTRL_RECONCILE_INTERVAL", "0.5")
    s = from_args(parse([]))
    assert (s.metrics_port, s.reconcile_interval) == (9500, 0.5)


def test_the_reliability_knobs_and_their_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_NODE_LOST_SECONDS", "45")
    s = from_args(parse(["--unhealthy-node-share=0.7", "--finalizer-seconds=60", "--kube-qps=5", "--log-writes"]))
    assert (s.node_lost_seconds, s.unhealthy_node_share, s.finalizer_seconds) == (45.0, 0.7, 60.0)
    assert (s.kube_qps, s.kube_burst, s.log_writes) == (5.0, 100, True)
    d = from_args(parse([]))
    assert (d.reconcile_interval, d.unhealthy_node_share, d.finalizer_seconds) == (30.0, 0.55, 900.0)


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--unhealthy-node-share=0", "--unhealthy-node-share"),
        ("--unhealthy-node-share=1.5", "--unhealthy-node-share"),
        ("--node-lost-seconds=-1", "--node-lost-seconds"),
        ("--finalizer-seconds=0", "--finalizer-seconds"),
        ("--finalizer-seconds=3001", "--finalizer-seconds"),  # past Kopf's own bound, less a margin
        ("--kube-burst=0", "--kube-burst"),
    ],
)
def test_a_knob_out_of_bounds_is_refused_by_name(flag: str, named: str) -> None:
    with pytest.raises(SystemExit) as refused:
        from_args(parse([flag]))
    assert named in str(refused.value)


def test_refused_namespaces_are_none_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart names kube-system and the operator's own; the bare operator refuses none."""
    assert from_args(parse([])).refused_namespaces == ()
    s = from_args(parse(["--refused-namespace=kube-system", "--refused-namespace=spotrl-system"]))
    assert s.refused_namespaces == ("kube-system", "spotrl-system")
    monkeypatch.setenv("SPOTRL_REFUSED_NAMESPACES", "kube-system,ops")
    assert from_args(parse([])).refused_namespaces == ("kube-system", "ops")
