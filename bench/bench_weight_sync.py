"""What a weight sync costs: the trainer sends a Qwen-shaped policy to its generation workers.

    PYTHONPATH=e2e python bench/bench_weight_sync.py [--model builtin:random-0.5b] [--syncs 3] [--check]

In one run of this file, on this machine, for each dtype (float32, bfloat16), backend
(transformers, vLLM's CPU build) and number of workers (2, then 1):

- **channel**: the sync as a run does it (``GenerationPool.sync`` with the trainer's
  ``WeightSender``): buckets of ``generation.weightBucketMiB`` straight from the trainer's live
  weights over gloo, each worker loading each bucket as it arrives;
- **broadcast**: the baseline, a plain gloo broadcast of the same bytes as one flat tensor to as
  many receivers (Ray actors that only receive): what the wire allows. Goal: the channel
  within 1.5x the broadcast;
- **object store**: the path the channel replaced, rebuilt here: a CPU copy of the state dict in
  the policy's dtype, ``ray.put`` in 64 MB parts, every receiver pulling all of them and copying
  them into its own buffer.

Per row: median seconds per sync, bytes the trainer sent per sync, and the growth of the
sending process's resident memory during the sync (peak over before, sampled every 2 ms). The
sender here is the process that trains, as in a single-process run, where it is the controller.
A second table does the same with a trainer group of two FSDP ranks (``--fsdp``): rank 0 sends,
and the controller sends nothing; its memory and rank 0's are both sampled.

A third (``--kill``, on by default; ``--only-kill`` runs it alone): a member SIGKILLed mid-sync on
gloo. Two transformers workers; worker 0's process holds after its first bucket (a failpoint)
and is SIGKILLed there. Measured: the seconds from the kill to the failed sync's return (the
sender's send ends, the epoch is aborted) and to the next successful sync (the survivor in a new
epoch), against ``generation.weightSyncTimeoutSeconds`` (``--kill-timeout``). Target: the next
successful sync within the timeout, the sender alive and the channel's groups destroyed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _recovery_state import table
from _targets import Targets, add_check
from spotrl_runtime.generation import BackendSpec
from spotrl_runtime.generation.pool import GenerationPool
from spotrl_runtime.generation.weights import ChannelHost, WeightSender, live_links, open_group
from spotrl_runtime.models import load_policy

PUT_BYTES = 64 << 20
MIB = 1 << 20


def rss(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The peak resident memory of ``pids`` over a block, sampled every 2 ms, over the start."""

    def __init__(self, *pids: int | None) -> None:
        self.pids = pids or (None,)
        self.start = [rss(p) for p in self.pids]
        self.peak = list(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = [max(a, rss(p)) for a, p in zip(self.peak, self.pids, strict=True)]

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self) -> list[int]:
        return [p - s for p, s in zip(self.peak, self.start, strict=True)]


class Receiver:
    """A Ray actor that only receives: over the channel's group (the broadcast baseline) or
    from the object store (the old path)."""

    def __init__(self) -> None:
        self.group: Any = None

    def join(self, address: dict[str, Any]) -> bool:
        import datetime as dt

        import torch.distributed as dist

        from spotrl_runtime.generation.weights import ChannelAddress

        a = ChannelAddress(**address)
        store = dist.TCPStore(a.host, a.port, is_master=False, timeout=dt.timedelta(seconds=a.timeout))
        self.group = open_group(a, store)
        return True

    def receive(self, nbytes: int) -> int:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        return nbytes

    def pull(self, *parts: dict[str, torch.Tensor]) -> int:
        """What the old worker did: every part pulled from the object store (Ray deserialises
        each into this process) before the backend copied them into its model."""
        return sum(t.numel() * t.element_size() for part in parts for t in part.values())


def timed(fn: Callable[[], Any], peak_of: tuple[int | None, ...] = (None,)) -> tuple[float, Any, list[int]]:
    with PeakRss(*peak_of) as peak:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return seconds, out, peak.growth()


def broadcast_baseline(receivers: list[Any], nbytes: int, syncs: int) -> float:
    import ray

    host = ChannelHost("127.0.0.1", timeout=300)
    joins = [r.join.remote(host.address(1, len(receivers) + 1, i + 1).to_dict()) for i, r in enumerate(receivers)]
    group = host.group(1, len(receivers) + 1)
    ray.get(joins)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(syncs):
        t0 = time.perf_counter()
        refs = [r.receive.remote(nbytes) for r in receivers]
        group.broadcast(flat, 0).wait()
        ray.get(refs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def object_store_path(model: Any, dtype: torch.dtype, receivers: list[Any], syncs: int) -> tuple[float, int, int]:
    import ray

    from spotrl_runtime.checkpoint.trainer_state import weight_parts

    def once() -> int:
        state = {k: v.detach().to("cpu", dtype=dtype, copy=True) for k, v in model.state_dict().items()}
        refs = [ray.put(p) for p in weight_parts(state, PUT_BYTES, 1024)]
        return sum(ray.get([r.pull.remote(*refs) for r in receivers])) // len(receivers)

    results = [timed(once) for _ in range(syncs)]
    return statistics.median(r[0] for r in results), results[0][1], max(r[2][0] for r in results)


def channel_path(
    pool: GenerationPool, sender: Any, first_version: int, syncs: int, peak_of: tuple[int | None, ...]
) -> tuple[float, int, list[int], int]:
    times, growth = [], [0] * len(peak_of)
    sent = members = 0
    for v in range(first_version, first_version + syncs):
        pool.give(v)
        seconds, result, grew = timed(lambda v=v: pool.sync(v, sender), peak_of)
        assert not result.failed, result.failed
        times.append(seconds)
        sent, members = result.bytes, result.members
        growth = [max(a, b) for a, b in zip(growth, grew, strict=True)]
    return statistics.median(times), sent, growth, members


def single_process(
    model_name: str,
    dtypes: list[str],
    backends: list[str],
    syncs: int,
    bucket_mib: int,
    rows: list[tuple[Any, ...]],
    targets: Targets,
) -> None:
    import ray

    receiver_cls = ray.remote(num_cpus=0.25)(Receiver)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        model, _ = load_policy(model_name, "cpu", dtype="float32")  # the trainer's float32 masters
        for backend in backends:
            # A channel per pool: a new pool numbers its epochs from 1 again.
            sender = WeightSender(
                lambda model=model: model.state_dict(keep_vars=True),
                dtype_name,
                ChannelHost("127.0.0.1", timeout=300),
                bucket_mib * MIB,
            )
            nbytes = sender.plan.nbytes
            # A short context: vLLM's CPU build would reserve a KV cache for the model's 32k.
            spec = BackendSpec(kind=backend, model=model_name, dtype=dtype_name, torch_threads=1, max_model_len=2048)  # type: ignore[arg-type]
            pool = GenerationPool(spec, num_workers=2, max_restarts=0, actor_options={"num_cpus": 0.5})
            try:
                pool.wait_ready(timeout=900)
                version = 1
                for n in (2, 1):
                    if n == 1:
                        # An idle worker's death is noticed at the next sync, which fails at once
                        # for it; the one after goes to the survivor alone.
                        ray.kill(pool.actor("gen-1"))
                        while True:
                            pool.give(version)
                            result = pool.sync(version, sender)
                            pool.sync_joiners(sender, version)  # the survivor, torn by the failed sync
                            version += 1
                            if not result.failed and result.members == 1:
                                break
                    seconds, sent, growth, members = channel_path(pool, sender, version, syncs, (None,))
                    version += syncs
                    assert members == n, (members, n)
                    receivers = [receiver_cls.remote() for _ in range(n)]
                    base = broadcast_baseline(receivers, nbytes, syncs)
                    old_s, old_bytes, old_growth = object_store_path(model, dtype, receivers, syncs)
                    for r in receivers:
                        ray.kill(r)
                    targets.at_most(
                        f"{dtype_name}, {backend}, {n} workers: channel / gloo broadcast", seconds / base, 1.5
                    )
                    rows.append(
                        (
                            dtype_name,
                            backend,
                            n,
                            f"{seconds:.3f}",
                            f"{base:.3f}",
                            f"{seconds / base:.2f}",
                            f"{sent / MIB:.0f}",
                            f"{growth[0] / MIB:.0f}",
                            f"{old_s:.3f}",
                            f"{old_bytes / MIB:.0f}",
                            f"{old_growth / MIB:.0f}",
                        )
                    )
                    print(rows[-1], flush=True)
            finally:
                pool.shutdown()


def fsdp_group(model_name: str, dtypes: list[str], syncs: int, bucket_mib: int, rows: list[tuple[Any, ...]]) -> None:
    import ray

    from spotrl_runtime.checkpoint.trainer_state import weight_parts
    from spotrl_runtime.training import TrainerConfig
    from spotrl_runtime.training.group import TrainerGroup

    for dtype_name in dtypes:
        group = TrainerGroup(model_name, TrainerConfig(compute_dtype=dtype_name), ranks=2, cpus_per_rank=0.5)
        spec = BackendSpec(kind="transformers", model=model_name, dtype=dtype_name, torch_threads=1)
        pool = GenerationPool(spec, num_workers=2, max_restarts=0, actor_options={"num_cpus": 0.5})
        try:
            group.start(timeout=900)
            pool.wait_ready(timeout=900)
            sender = group.weight_sender(bucket_mib * MIB, 300)
            rank0 = group.pids[0]
            seconds, sent, growth, _ = channel_path(pool, sender, 1, syncs, (None, rank0))

            def old(group: TrainerGroup = group) -> int:
                state = group.policy_state_dict()  # gathered on rank 0, returned to this process
                refs = [ray.put(p) for p in weight_parts(state, PUT_BYTES, 1024)]
                del state
                return len(refs)

            old_results = [timed(old, (None, rank0)) for _ in range(syncs)]
            old_s = statistics.median(r[0] for r in old_results)
            old_growth = [max(r[2][i] for r in old_results) for i in range(2)]
            rows.append(
                (
                    dtype_name,
                    f"{seconds:.3f}",
                    f"{sent / MIB:.0f}",
                    f"{growth[0] / MIB:.0f}",
                    f"{growth[1] / MIB:.0f}",
                    f"{old_s:.3f}",
                    f"{old_growth[0] / MIB:.0f}",
                    f"{old_growth[1] / MIB:.0f}",
                )
            )
            print(rows[-1], flush=True)
        finally:
            pool.shutdown()
            group.shutdown()


def killed_mid_sync(
    model_name: str, dtype_name: str, timeout: float, bucket_mib: int, rows: list[tuple[Any, ...]], targets: Targets
) -> None:
    """A member SIGKILLed after its first bucket: kill → failed sync, kill → next successful sync."""

    marks = Path(tempfile.mkdtemp(prefix="bench-kill-"))
    env = {"SPOTRL_FAILPOINTS": "weights.received@1=600", "SPOTRL_FAILPOINT_DIR": str(marks), "OMP_NUM_THREADS": "1"}
    model, _ = load_policy(model_name, "cpu", dtype="float32")
    host = ChannelHost("127.0.0.1", timeout=timeout)
    sender = WeightSender(lambda: model.state_dict(keep_vars=True), dtype_name, host, bucket_mib * MIB)
    spec = BackendSpec(kind="transformers", model=model_name, dtype=dtype_name, torch_threads=1)
    options = {"num_cpus": 0.5, "runtime_env": {"env_vars": env}}
    pool = GenerationPool(spec, num_workers=2, max_restarts=1, actor_options=options)
    try:
        pool.wait_ready(timeout=900)
        pid = pool.workers()[0]["pid"]
        pool.give(1)
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(result=pool.sync(1, sender)), daemon=True)
        thread.start()
        while not (marks / "weights.received").exists():
            if not thread.is_alive():
                raise SystemExit(f"the sync ended before worker 0 held after its first bucket: {out}")
            time.sleep(0.01)
        assert json.loads((marks / "weights.received").read_text())["pid"] == pid
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        (marks / "weights.received.release").touch()  # the replacement passes the point
        thread.join(timeout * 2)
        failed_after = time.monotonic() - killed
        if thread.is_alive() or not out.get("result") or not out["result"].failed:
            raise SystemExit(f"the sync with a killed member did not fail within {2 * timeout:.0f} s: {out}")
        next_ok = float("nan")
        while time.monotonic() - killed < 2 * timeout:
            result = pool.sync_joiners(sender, 1)
            if result is not None and not result.failed:
                next_ok = time.monotonic() - killed
                break
            pool.poll(timeout=0.1)
        host.close()
        deadline = time.monotonic() + timeout
        while live_links() and time.monotonic() < deadline:
            time.sleep(0.05)
        # The sender is this process: it sent the next sync itself, so it is alive and not hung.
        alive = math.isfinite(next_ok)
        name = f"killed member ({dtype_name})"
        targets.at_most(f"{name}: kill → next successful sync / weightSyncTimeoutSeconds", next_ok / timeout, 1.0)
        targets.at_most(f"{name}: the sender's channel groups left", live_links(), 0)
        rows.append(
            (
                model_name,
                dtype_name,
                f"{sender.plan.nbytes / MIB:.0f}",
                f"{timeout:g}",
                f"{failed_after:.2f}",
                f"{next_ok:.2f}",
                f"{next_ok / timeout:.3f}",
                "yes" if alive else "no",
                str(live_links()),
            )
        )
        print(rows[-1], flush=True)
    finally:
        pool.shutdown()


def main() -> None:
    import faulthandler
    import signal

    import ray

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a slow run is: kill -USR1 <pid>

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:random-0.5b")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--backends", default="transformers,vllm")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--fsdp", action="store_true", help="also the trainer group of two ranks")
    parser.add_argument("--bucket-mib", type=int, default=512, help="generation.weightBucketMiB")
    parser.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True, help="the killed-member run")
    parser.add_argument("--only-kill", action="store_true", help="the killed-member run alone")
    parser.add_argument("--kill-model", default="builtin:random-100m", help="the killed-member run's policy")
    parser.add_argument("--kill-timeout", type=float, default=120.0, help="generation.weightSyncTimeoutSeconds")
    parser.add_argument("--kill-bucket-mib", type=int, default=64, help="its buckets: several, so it dies mid-sync")
    add_check(parser)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows: list[tuple[Any, ...]] = []
    targets = Targets()
    try:
        dtypes = args.dtypes.split(",")
        if args.kill or args.only_kill:
            kill_rows: list[tuple[Any, ...]] = []
            for dtype_name in dtypes:
                killed_mid_sync(
                    args.kill_model, dtype_name, args.kill_timeout, args.kill_bucket_mib, kill_rows, targets
                )
            table(
                f"A member SIGKILLed mid-sync on gloo ({args.kill_bucket_mib} MiB buckets, 2 transformers workers)",
                (
                    "model",
                    "dtype",
                    "MiB a sync",
                    "timeout s",
                    "kill → failed sync s",
                    "kill → next successful sync s",
                    "/ timeout",
                    "sender alive",
                    "channel groups left",
                ),
                kill_rows,
            )
        if not args.only_kill:
            backends = [b for b in args.backends.split(",") if b]
            single_process(args.model, dtypes, backends, args.syncs, args.bucket_mib, rows, targets)
            table(
                f"Weight sync of {args.model}: the trainer's process sends, {args.bucket_mib} MiB buckets "
                f"(median of {args.syncs})",
                (
                    "dtype",
                    "backend",
                    "workers",
                    "channel s",
                    "gloo broadcast s",
                    "channel / broadcast",
                    "MiB sent",
                    "sender RSS growth MiB",
                    "object store s (before)",
                    "MiB moved (before)",
                    "sender RSS growth MiB (before)",
                ),
                rows,
            )
            if args.fsdp:
                group_rows: list[tuple[Any, ...]] = []
                fsdp_group(args.model, dtypes, args.syncs, args.bucket_mib, group_rows)
                table(
                    f"Weight sync of {args.model} from 2 FSDP ranks to 2 transformers workers (median of {args.syncs})",
                    (
                        "dtype",
                        "channel s",
                        "MiB sent",
                        "controller RSS growth MiB",
                        "rank 0 RSS growth MiB",
                        "object store s (before)",
                        "controller RSS growth MiB (before)",
                        "rank 0 RSS growth MiB (before)",
                    ),
                    group_rows,
                )
    finally:
        ray.shutdown()
    targets.report(args.check)


if __name__ == "__main__":
    main()
