"""A 1 GiB weights file through the cut writer vs. a plain boto3 upload of the same bytes.

    PYTHONPATH=e2e python bench/bench_cut_weights.py [--gib 1.0] [--repeat 2]

Against one S3 server (versitygw on loopback, started here), in one run:

- boto3 upload_file: the serialised state_dict (a local file), with boto3's defaults;
- S3Storage.put_file: the same file through our storage interface;
- torch.save to a file, then boto3 upload_file: the plain way to write a weights file;
- streamed weights file: what the cut writer does for weights.pt, torch.save straight into
  the store while hashing (no local copy), so serialising overlaps the upload;
- whole cut: CutWriter.write with the 1 GiB model, including the capture (a CPU copy of
  the state_dict under the lock), the small owner files, the manifest, the pointer and
  retention. Metadata overhead = whole cut - capture - weights file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _recovery_state import table
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import CutRequest, CutWriter, snapshot_trainer
from spotrl_runtime.checkpoint.trainer_state import HashingWriter
from spotrl_runtime.core.owners import Owners, RecoveryConfig
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.storage.s3 import S3Storage

GiB = 1024**3


def state_dict(gib: float) -> dict[str, torch.Tensor]:
    """``gib`` GiB of float32 weights in 64 MiB tensors (a transformer's layer matrices)."""
    per = 16 * 1024 * 1024  # floats: 64 MiB
    n = max(1, round(gib * GiB / (per * 4)))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from spotrl_e2e.s3 import S3Server

    sd = state_dict(args.gib)
    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp) / "weights.pt"
        torch.save(sd, spool)
        size = spool.stat().st_size
        server = S3Server(Path(tmp) / "s3").start()
        try:
            bucket = server.create_bucket("bench")
            client = bucket.client()
            storage = S3Storage(
                bucket.bucket,
                "job",
                endpoint_url=bucket.endpoint,
                region=bucket.region,
                access_key=bucket.access_key,
                secret_key=bucket.secret_key,
            )

            def clean() -> None:
                for info in list(storage.list("")):
                    storage.delete(info.key)
                for info in client.list_objects_v2(Bucket=bucket.bucket).get("Contents", []):
                    client.delete_object(Bucket=bucket.bucket, Key=info["Key"])

            def plain_boto3() -> float:
                t0 = time.perf_counter()
                client.upload_file(str(spool), bucket.bucket, "plain/weights.pt")
                return time.perf_counter() - t0

            def save_then_boto3() -> float:
                t0 = time.perf_counter()
                torch.save(sd, Path(tmp) / "naive.pt")
                client.upload_file(str(Path(tmp) / "naive.pt"), bucket.bucket, "naive/weights.pt")
                (Path(tmp) / "naive.pt").unlink()
                return time.perf_counter() - t0

            def put_file() -> float:
                t0 = time.perf_counter()
                storage.put_file("put/weights.pt", spool)
                return time.perf_counter() - t0

            def streamed() -> float:
                t0 = time.perf_counter()
                with storage.open_write("streamed/weights.pt") as f:
                    torch.save(sd, HashingWriter(f))  # type: ignore[arg-type]
                return time.perf_counter() - t0

            owners = Owners(
                RecoveryConfig(group_size=4, prompts_per_step=8, lookahead=1),
                PromptLoader(ArithmeticDataset(100), PromptCollate(), batch_size=8),
            )
            owners.pump()
            writer = CutWriter(storage, job="bench", dataset={"uri": "builtin:arithmetic?size=100", "size": 100})
            cut_parts: dict[str, list[float]] = {}

            def whole_cut() -> float:
                t0 = time.perf_counter()
                cut = writer.write(
                    owners,
                    CutRequest.barrier(Deadline.after(120)),
                    lambda: snapshot_trainer(sd, None, step=owners.trainer_step, with_rng=False),
                )
                total = time.perf_counter() - t0
                for k, v in cut.timings.items():
                    cut_parts.setdefault(k, []).append(v)
                return total

            results: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                for name, fn in (
                    ("boto3 upload_file", plain_boto3),
                    ("S3Storage.put_file", put_file),
                    ("torch.save to a file, then boto3 upload_file", save_then_boto3),
                    ("streamed weights file", streamed),
                    ("whole cut", whole_cut),
                ):
                    clean()
                    results.setdefault(name, []).append(fn())
            clean()
        finally:
            server.stop()

    base = statistics.median(results["boto3 upload_file"])
    rows: list[tuple[Any, ...]] = []
    for name, times in results.items():
        t = statistics.median(times)
        rows.append((name, f"{t:.2f} s", f"{size / t / 1e6:.0f} MB/s", f"{t / base:.2f}"))
    table(
        f"{size / GiB:.2f} GiB weights file to S3 (versitygw on loopback), median of {args.repeat}",
        ("path", "time", "throughput", "ratio to boto3 upload_file"),
        rows,
    )
    parts = {k: statistics.median(v) for k, v in cut_parts.items()}
    overhead = parts["total"] - parts["capture"] - statistics.median(results["streamed weights file"])
    meta = parts.get("manifest", 0) + parts.get("pointer", 0) + parts.get("retention", 0)
    table(
        "Whole cut, by phase (median)",
        ("capture (lock held)", "files", "manifest", "pointer", "retention", "total", "manifest+pointer+retention"),
        [
            (
                f"{parts['capture'] * 1e3:.0f} ms",
                f"{parts['files']:.2f} s",
                f"{parts['manifest'] * 1e3:.1f} ms",
                f"{parts['pointer'] * 1e3:.1f} ms",
                f"{parts['retention'] * 1e3:.1f} ms",
                f"{parts['total']:.2f} s",
                f"{meta * 1e3:.1f} ms",
            )
        ],
    )
    print(f"\nwhole cut - capture - streamed weights file: {overhead * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
