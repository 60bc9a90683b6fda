"""Small checks tests share: is a process alive, has a file said something yet."""

from __future__ import annotations

import os
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_file(file: Path, text: str, timeout: float = 20) -> str:
    """Waits until ``file`` contains ``text``; returns the file's content."""
    deadline = time.monotonic() + timeout
    while True:
        content = file.read_text() if file.exists() else ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise TimeoutError(f"{file} did not contain {text!r} within {timeout:.0f} s; it holds:\n{content[-2000:]}")
        time.sleep(0.1)


def assert_adapter_alone(index: bytes, shard_bytes: int, model: str, rank: int) -> None:
    """A sharded LoRA cut holds ``model``'s rank-``rank`` adapter and its AdamW state alone.
    ``index`` is the cut's DCP index (``trainer/dcp/.metadata``), ``shard_bytes`` its shards'
    total size. The adapter is built here, apart from the trainer, so the check does not take
    its expectation from the writer: the index lists exactly the adapter's tensors and their
    optimizer state (no tensor of the frozen base), and the shards hold those tensors' float32
    bytes (weights and two moments) plus torch.save's framing of each stored piece (about 1.6 KB;
    3 KB allowed), nothing more. A fixed bound could not tell: the tiny base is 530 KB in float32."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from spotrl_runtime.api.rljob import Lora
    from spotrl_runtime.models import load_policy, lora

    policy, _ = load_policy(model)
    lora.add_adapter(policy, Lora(rank=rank), base="")
    adapter = lora.adapter_tensors(policy)
    want = {f"model.{n}" for n in adapter} | {
        f"optimizer.state.{n}.{s}" for n in adapter for s in ("step", "exp_avg", "exp_avg_sq")
    }
    metadata = pickle.loads(index)  # the cut's own index, its digest checked by the manifest
    assert isinstance(metadata, Metadata), type(metadata)
    listed = {k for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    assert listed == want, f"not the adapter's: {sorted(listed - want)[:5]}; missing: {sorted(want - listed)[:5]}"
    data = 12 * sum(t.numel() for t in adapter.values()) + 4 * len(adapter)  # + a float32 step each
    framing = 3 << 10
    assert data <= shard_bytes <= data + framing * len(metadata.storage_data), (shard_bytes, data)
