"""Ray and the generation pool started on a thread before the controller's imports
(:class:`~spotrl_runtime.controller.prestart.Prestart`): handed over once, errors raised where
they are taken, stopped when nobody takes them, and the starting thread kept alive (Ray's
processes die with the thread that started them). Ray itself is faked here; every
`spotrl run` in the integration tests starts the real one this way."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import spotrl_runtime.generation.cluster as cluster
from spotrl_runtime.controller.prestart import Prestart
from spotrl_runtime.generation.cluster import RayStartError

ROOT = Path(__file__).resolve().parents[3]


class Fake:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def shutdown(self) -> None:
        self.log.append(f"{self.name} stopped")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []

    def start_ray(
        host: Any, remote_workers: bool, num_cpus: Any, *, remote_nodes: bool = False, num_gpus: Any = None
    ) -> Fake:
        assert num_gpus is None, "a CPU job's Ray offers the GPUs it finds (none)"
        by = threading.current_thread().name
        log.append(f"ray on {host} (remote workers {remote_workers}, cpus {num_cpus}) by {by}")
        return Fake("ray", log)

    def generation_pool(spec: Any, device: str, remote_workers: bool) -> Fake:
        log.append(f"pool on {device}")
        return Fake("pool", log)

    monkeypatch.setattr(cluster, "start_ray", start_ray)
    monkeypatch.setattr(cluster, "generation_pool", generation_pool)
    return log


def spec() -> Any:
    import yaml

    from spotrl_runtime.api.rljob import parse_rljob

    return parse_rljob(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())).spec


def prestart(**kw: Any) -> Prestart:
    args: dict[str, Any] = {"host": "127.0.0.1", "remote_workers": False, "num_cpus": None, "device": lambda: "cpu"}
    return Prestart(spec(), **{**args, **kw})


def test_ray_and_the_pool_are_handed_over_once_and_close_then_leaves_them(started: list[str]) -> None:
    p = prestart()
    ray, pool = p.take()
    assert (ray.name, pool.name) == ("ray", "pool")
    assert started == ["ray on 127.0.0.1 (remote workers False, cpus None) by ray-prestart", "pool on cpu"]
    assert p._thread.is_alive(), "the thread that started Ray must outlive the take"
    with pytest.raises(RuntimeError, match="taken already"):
        p.take()
    p.close()
    assert started[-1] == "pool on cpu", "what was taken is the taker's to stop"


def test_what_nobody_took_is_stopped_by_close_and_the_thread_ends(started: list[str]) -> None:
    p = prestart()
    p.close()
    assert started[-2:] == ["pool stopped", "ray stopped"]
    p._thread.join(10)
    assert not p._thread.is_alive()
    p.close()
    assert started.count("ray stopped") == 1


def test_a_failed_start_is_raised_where_it_is_taken(monkeypatch: pytest.MonkeyPatch, started: list[str]) -> None:
    def no_ray(*a: Any, **k: Any) -> Any:
        raise RayStartError("remote generation workers ... need an address")

    monkeypatch.setattr(cluster, "start_ray", no_ray)
    with pytest.raises(RayStartError, match="need an address"):
        prestart().take()


def test_a_pool_that_fails_stops_the_ray_it_started(monkeypatch: pytest.MonkeyPatch, started: list[str]) -> None:
    def no_pool(*a: Any, **k: Any) -> Any:
        raise ValueError("generation.backend: vllm needs a GPU")

    monkeypatch.setattr(cluster, "generation_pool", no_pool)
    p = prestart()
    with pytest.raises(ValueError, match="vllm needs a GPU"):
        p.take()
    assert started[-1] == "ray stopped"


def test_settings_that_changed_after_the_start_do_not_match(started: list[str]) -> None:
    p = prestart(host="10.0.0.5", remote_workers=True)
    assert p.matches("10.0.0.5", True, None)
    assert not p.matches("127.0.0.1", True, None)
    assert not p.matches("10.0.0.5", False, None)
    assert not p.matches("10.0.0.5", True, 4)
    p.close()


def test_an_import_that_fails_on_the_thread_is_raised_by_take_and_close_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "spotrl_runtime.generation.cluster", None)  # import raises
    p = prestart()
    with pytest.raises(ImportError):
        p.take()
    p2 = prestart()
    p2.close()
    p2._thread.join(10)
    assert not p2._thread.is_alive()
