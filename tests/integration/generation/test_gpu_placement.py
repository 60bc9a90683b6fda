"""Every example with GPUs or pods of its own places its Ray actors, with the GPUs its pods
request as Ray's logical GPUs.

Each example becomes a real multi-node Ray cluster on this machine (``ray.cluster_utils``): the
controller pod as the head, with the GPUs the operator requests for it
(:func:`~spotrl_runtime.api.placement.controller_pod_gpus`) less the single trainer's, and a
node per worker pod and per trainer pod, with their GPUs and the resource that marks them.
Then the generation workers are placed with the actor options the controller gives them, and
the FSDP ranks with the trainer group's own bundles. No GPU is needed: Ray counts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from spotrl_runtime.api.placement import controller_pod_gpus, ray_gpus
from spotrl_runtime.api.rljob import RLJobSpec, parse_spec, quantity_value
from spotrl_runtime.generation.cluster import TRAINER_RESOURCE, WORKER_RESOURCE, worker_placement
from spotrl_runtime.training.group import TrainerGroup

REPO = Path(__file__).resolve().parents[3]


def _places_anything(path: Path) -> bool:
    """Whether an example asks for GPUs or pods of its own. The others (one CPU worker beside
    the trainer) are placed by every test that runs them (the tiny job, the chat example)."""
    spec = parse_spec(yaml.safe_load(path.read_text())["spec"])
    gen, par = spec.generation, spec.training.parallelism
    return bool(controller_pod_gpus(spec) or gen.resources.gpu or gen.worker_pods or par.trainer_pods)


EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.yaml") if _places_anything(p))

POD_GPUS = {
    # example: (the controller pod's nvidia.com/gpu, of them the GPUs its Ray hands actors),
    # read off each file by hand, not from the code under test.
    "gpu-qwen-7b-lora.yaml": (2, 1),  # the trainer's 1 + 1 vLLM worker x 1; the trainer's kept from Ray
    "gpu-qwen-fsdp.yaml": (0, 0),  # 4 ranks and 4 workers, each in a pod of its own with 1
    "gpu-qwen-gsm8k.yaml": (3, 2),  # the trainer's 1 + 2 vLLM workers x 1; the trainer's kept from Ray
}


def example(name: str) -> RLJobSpec:
    return parse_spec(yaml.safe_load((REPO / "examples" / name).read_text())["spec"])


def _cpus(quantity: str | None, default: int) -> int:
    return max(1, int(quantity_value(quantity))) if quantity else default


@pytest.fixture
def ray_cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()  # the module's shared Ray, if any: each example gets a cluster of its own
    cluster = Cluster()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def build(cluster: Cluster, spec: RLJobSpec, controller_gpus: int) -> str:
    """The example's Ray cluster: the head as the controller pod with ``controller_gpus``, a
    node per worker pod and trainer pod. Returns the controller's device."""
    device = "cuda" if controller_gpus else "cpu"
    kept = ray_gpus(spec, controller_gpus) if controller_gpus else None
    head_cpus = 0 if spec.generation.worker_pods else _cpus(spec.training.resources.cpu, 4)
    cluster.add_node(num_cpus=head_cpus, num_gpus=controller_gpus if kept is None else kept)
    gen, par = spec.generation, spec.training.parallelism
    pods = [(gen.workers if gen.worker_pods else 0, gen.resources, WORKER_RESOURCE)]
    pods += [(par.ranks if par.trainer_pods else 0, par.resources, TRAINER_RESOURCE)]
    for count, res, marker in pods:  # a Ray node per worker pod and per trainer pod
        for _ in range(count):
            cluster.add_node(num_cpus=_cpus(res.cpu, 1), num_gpus=res.gpu, resources={marker: 1}, wait=False)
    cluster.wait_for_nodes()  # the pods' nodes started together
    ray.init(address=cluster.address, log_to_driver=False)
    return device


def place(spec: RLJobSpec, device: str, timeout: float = 60.0) -> tuple[int, int]:
    """Places the example's ranks and workers as the controller does; returns how many of each
    placed within ``timeout``."""
    par = spec.training.parallelism
    ranks_placed = 0
    pg = None
    if par.strategy == "fsdp":
        group = TrainerGroup.from_rljob(spec, device, pad_token_id=0)
        pg = placement_group(group.bundles(), strategy="SPREAD" if par.trainer_pods else "PACK")
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        ranks_placed = par.ranks if ready else 0
    _, options, _ = worker_placement(spec, device, spec.generation.worker_pods)

    class Probe:  # local: Ray's workers get it by value (they cannot import a test module)
        def gpus(self) -> list[int]:
            return [int(i) for i in ray.get_gpu_ids()]

    actors = [ray.remote(Probe).options(**options).remote() for _ in range(spec.generation.workers)]
    done, _ = ray.wait([a.gpus.remote() for a in actors], num_returns=len(actors), timeout=timeout)
    placed = [ray.get(ref) for ref in done]  # an actor that died would raise here
    assert all(len(ids) == math.ceil(options.get("num_gpus", 0)) for ids in placed), placed
    for a in actors:
        ray.kill(a)
    if pg is not None:
        remove_placement_group(pg)
    return ranks_placed, len(placed)


def test_every_example_that_places_anything_has_its_gpus_written_down() -> None:
    assert sorted(POD_GPUS) == EXAMPLES, "a new example's GPUs: add its row to POD_GPUS"


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_examples_actors_place_on_the_gpus_its_pods_request(ray_cluster: Cluster, name: str) -> None:
    spec = example(name)
    pod, offered = POD_GPUS[name]
    assert controller_pod_gpus(spec) == pod, "the controller pod's request"
    device = build(ray_cluster, spec, pod)
    ranks, workers = place(spec, device)
    par, gen = spec.training.parallelism, spec.generation
    assert ranks == (par.ranks if par.strategy == "fsdp" else 0)
    assert workers == gen.workers
    # The head's GPUs, and a GPU per pod of its own: the trainer's GPU is never Ray's to hand a worker.
    pods = (gen.workers * gen.resources.gpu if gen.worker_pods else 0) + (
        par.ranks * par.resources.gpu if par.trainer_pods else 0
    )
    assert ray.cluster_resources().get("GPU", 0) == offered + pods


def test_the_gpu_example_did_not_place_with_the_pod_it_used_to_request(ray_cluster: Cluster) -> None:
    """The controller pod of gpu-qwen-gsm8k asked for the trainer's GPU only: with Ray's GPUs
    what that pod had, the second vLLM worker never placed (and the controller waited for it)."""
    spec = example("gpu-qwen-gsm8k.yaml")
    assert controller_pod_gpus(spec) == spec.training.resources.gpu + spec.generation.workers
    ray_cluster.add_node(num_cpus=4, num_gpus=spec.training.resources.gpu)
    ray.init(address=ray_cluster.address, log_to_driver=False)
    _, workers = place(spec, "cuda", timeout=5.0)
    assert workers < spec.generation.workers


def test_a_spec_whose_in_pod_vllm_workers_have_no_gpus_is_refused() -> None:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "gpu-qwen-gsm8k.yaml").read_text())["spec"]
    doc["generation"]["resources"] = {}
    with pytest.raises(ValueError, match=r"generation\.resources\.gpu"):
        parse_spec(doc)
    doc["generation"]["resources"] = {"gpu": 1}
    doc["generation"]["tensorParallelSize"] = 2
    with pytest.raises(ValueError, match=r"tensorParallelSize"):
        parse_spec(doc)
