"""A small, real run for recovery tests: real loader, owners, cut writer, restore and a tiny torch trainer.

Only generation is scripted: rollout ``i`` of a group is a pure function of the prompt and
``i``, so a regenerated rollout equals the lost one and streams can be compared exactly.

Run as a script, it is the *fresh process* of the worked-example tests:
``python cut_scenarios.py resume-a|resume-b STORE_URI`` restores the newest cut, continues
the run, and prints what it saw as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import (
    CommittedCut,
    CutRequest,
    CutWriter,
    restore_cut,
    restore_rng,
    snapshot_trainer,
)
from spotrl_runtime.core.audit import AuditRecord
from spotrl_runtime.core.owners import Dispatch, Owners, RecoveryConfig
from spotrl_runtime.core.redo import StepFingerprint
from spotrl_runtime.core.types import FinishedGroup, Rollout
from spotrl_runtime.data import ArithmeticDataset, PromptCollate, describe_dataset
from spotrl_runtime.data.dataset import PromptDataset
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.storage import Storage, open_storage

JOB = "default/scenario"


def rollout(d: Dispatch, index: int) -> Rollout:
    """Rollout ``index`` of a dispatched group (deterministic)."""
    completion = tuple(ord(c) for c in f"{d.prompt.answer}#{index}")
    return Rollout(
        group_id=d.group_id,
        index=index,
        prompt_token_ids=tuple(ord(c) for c in d.prompt.text),
        completion_token_ids=completion,
        logprobs=tuple(-0.01 * (k + 1) * (index + 1) for k in range(len(completion))),
        reward=1.0 if index % 2 == 0 else 0.0,
        weight_version=d.weight_version,
        text=f"{d.prompt.answer}#{index}",
        finish_reason="stop",
    )


def loader_for(config: RecoveryConfig, dataset: PromptDataset, *, shuffle: bool = False, seed: int = 0) -> PromptLoader:
    return PromptLoader(dataset, PromptCollate(), batch_size=config.prompts_per_step, shuffle=shuffle, seed=seed)


def dataset_description(dataset: PromptDataset, *, shuffle: bool = False, seed: int = 0) -> dict[str, Any]:
    from spotrl_runtime.api.rljob import Dataset as DatasetSpec

    return describe_dataset(DatasetSpec(uri=dataset.uri, shuffle=shuffle, seed=seed), dataset)


@dataclass
class Run:
    """Owners + a tiny trainer + scripted generation; every dispatch is remembered until finished."""

    owners: Owners
    model: torch.nn.Linear
    optimizer: torch.optim.Optimizer
    writer: CutWriter | None = None
    inflight: dict[str, Dispatch] = field(default_factory=dict)
    dispatched: list[Dispatch] = field(default_factory=list)
    audit: list[AuditRecord] = field(default_factory=list)

    @classmethod
    def new(
        cls,
        config: RecoveryConfig,
        dataset: PromptDataset,
        storage: Storage | None = None,
        *,
        attempt: int = 0,
        **loader: Any,
    ) -> Run:
        torch.manual_seed(1234)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        owners = Owners(config, loader_for(config, dataset, **loader), attempt=attempt)
        return cls(owners, model, optimizer, _writer(storage, dataset, **loader))

    @classmethod
    def restore(
        cls,
        config: RecoveryConfig,
        dataset: PromptDataset,
        storage: Storage,
        cut_id: str | None = None,
        **loader: Any,
    ) -> Run:
        restored = restore_cut(
            storage,
            dataset=dataset,
            collate=PromptCollate(),
            source=loader_for(config, dataset, **loader),
            cut_id=cut_id,
        )
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        trainer = restored.trainer
        assert trainer is not None
        model.load_state_dict(trainer.weights)
        optimizer.load_state_dict(trainer.optimizer)  # type: ignore[arg-type]
        assert trainer.rng is not None
        restore_rng(trainer.rng)
        run = cls(restored.owners, model, optimizer, _writer(storage, dataset, **loader))
        for step in restored.redo:  # a delta: its base's state, then its steps again
            redone = run._step([e.group for e in step.entries])
            assert step.fingerprint.mismatch(redone) is None, step.fingerprint.mismatch(redone)
        if run.writer is not None:
            run.writer.base = restored.base
        return run

    def pump(self) -> list[Dispatch]:
        sent = self.owners.pump()
        for d in sent:
            self.inflight[d.group_id] = d
        self.dispatched.extend(sent)
        return sent

    def targets(self) -> list[str]:
        """In-flight groups in loader order (a canonical order both arms of a comparison share)."""
        return sorted(self.inflight, key=lambda g: int(g[1:]))

    def finish(self, group_id: str, indexes: tuple[int, ...] | None = None) -> bool:
        d = self.inflight[group_id]
        todo = d.rollout_indexes if indexes is None else indexes
        done = None
        for i in todo:
            done = self.owners.add_rollout(group_id, rollout(d, i))
        if done is not None:
            del self.inflight[group_id]
            return True
        self.inflight[group_id] = Dispatch(
            d.group_id, d.prompt, d.target_step, tuple(i for i in d.rollout_indexes if i not in todo), d.weight_version
        )
        return False

    def drop(self, group_id: str, reason: str = "generation failed") -> list[Dispatch]:
        sent = self.owners.drop_group(group_id, reason)
        del self.inflight[group_id]
        for d in sent:
            self.inflight[d.group_id] = d
        self.dispatched.extend(sent)
        return sent

    def train(self) -> AuditRecord:
        """One GRPO-shaped optimizer step on the step's groups (uses the torch RNG, so RNG state matters)."""
        fingerprint = self._step(self.owners.begin_step())
        record = self.owners.commit_step(fingerprint=fingerprint)
        self.audit.append(record)
        return record

    def _step(self, groups: list[FinishedGroup]) -> StepFingerprint:
        x = torch.tensor([[float(g.prompt.idx), float(len(g.prompt.text)), 1.0, 0.5] for g in groups])
        noise = torch.randn(len(groups), 1) * 0.01
        target = torch.tensor([[sum(r.reward for r in g.rollouts)] for g in groups])
        loss = ((self.model(x) + noise - target) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in self.model.parameters()))
        return StepFingerprint(float(loss.detach()), 0.0, params.hexdigest()[:32], "cpu/1")

    def state_fn(self) -> Any:
        return snapshot_trainer(self.model.state_dict(), self.optimizer.state_dict(), step=self.owners.trainer_step)

    def cut(self, kind: str = "periodic") -> CommittedCut:
        """A ``periodic`` or ``barrier`` cut (full), or a ``delta`` barrier cut where the redo log
        covers every step since the writer's base (else a full one, as the controller does)."""
        assert self.writer is not None
        if kind == "delta":
            base = self.writer.base
            steps = [s.step for s in self.owners.redo_steps() if base is not None and s.step >= base.trainer_step]
            if base is not None and steps == list(range(base.trainer_step, self.owners.trainer_step)):
                return self.writer.write(self.owners, CutRequest.barrier(Deadline.after(60), form="delta"))
            kind = "barrier"
        request = CutRequest.barrier(Deadline.after(60)) if kind == "barrier" else CutRequest.periodic()
        committed = self.writer.write(self.owners, request, self.state_fn)
        self.owners.trim_redo(committed.manifest.trainer_step)
        return committed

    def drain(self, until_step: int) -> None:
        """Finish everything in flight and train, until ``until_step`` steps are trained."""
        while self.owners.trainer_step < until_step:
            progress = len(self.pump()) + len(self.inflight)
            for gid in self.targets():
                self.finish(gid)
            while self.owners.step_ready() and self.owners.trainer_step < until_step:
                self.train()
                progress += 1
                self.pump()
            if not progress:
                raise AssertionError(f"the run is stuck at step {self.owners.trainer_step}: nothing to do")

    def weights(self) -> list[float]:
        return [float(v) for p in self.model.parameters() for v in p.detach().flatten()]


def _writer(storage: Storage | None, dataset: PromptDataset, **loader: Any) -> CutWriter | None:
    if storage is None:
        return None
    return CutWriter(storage, job=JOB, dataset=dataset_description(dataset, **loader), keep=3)


# --------------------------------------------------------------- worked examples

EXAMPLE_A = RecoveryConfig(group_size=4, prompts_per_step=1, lookahead=1)
EXAMPLE_B = RecoveryConfig(
    group_size=2, prompts_per_step=3, lookahead=2, on_dropped_prompt="replace", spare_pool_batches=1
)
DATASET = ArithmeticDataset(size=100)
# Example A names its groups g20..g23; in this run they are the groups of prompts 7..10.
A_LABELS = {"g20": "g7", "g21": "g8", "g22": "g9", "g23": "g10"}


def example_a_before_cut(storage: Storage | None) -> Run:
    """Group size 4, lookahead 1, trainer at step 7: g20 finished (stamped 7), g21 2 of 4
    (stamped 8), g22 waiting at the gate, g23 still in the dataset."""
    run = Run.new(EXAMPLE_A, DATASET, storage)
    run.pump()
    while run.owners.trainer_step < 7:
        step = run.owners.trainer_step
        (gid,) = [g for g, d in run.inflight.items() if d.target_step == step]
        run.finish(gid)
        run.train()
        run.pump()
    run.finish(A_LABELS["g20"])
    run.finish(A_LABELS["g21"], (0, 1))
    return run


def example_b_before_cut(storage: Storage | None) -> Run:
    """Group size 2, 3 groups a step, lookahead 2, replace; prompt 1 given up on after 0, 2
    and steps 1 and 2 finished: step 0 borrows group 9, spare 3 is dispatched for step 2."""
    run = Run.new(EXAMPLE_B, DATASET, storage)
    run.pump()
    for gid in ("g0", "g2", "g6", "g7", "g8", "g9", "g10", "g11"):
        run.finish(gid)
    run.drop("g1", "generation failed after retries")
    return run


def continue_a(run: Run) -> dict[str, Any]:
    """After restore: what is dispatched, in order, and the stream of steps 7..10."""
    start = len(run.audit)
    first = run.pump()
    out: dict[str, Any] = {
        "first_pump": [[d.group_id, d.target_step, list(d.rollout_indexes), d.relaunch] for d in first],
        "step_7_ready_without_generation": run.owners.step_ready(),
    }
    run.train()
    out["after_step_7_pump"] = [[d.group_id, d.target_step, d.relaunch] for d in run.pump()]
    out["reserved_after_step_7"] = [r.group_id for r in run.owners.capture().ledger if r.target_step is None]
    run.drain(11)
    out["stream"] = {str(r.step): list(r.idxs) for r in run.audit[start:]}
    out["group_ids"] = {str(r.step): list(r.group_ids) for r in run.audit[start:]}
    out["counters"] = run.owners.counters.__dict__
    out["weights"] = run.weights()
    out["regenerated"] = sorted({d.group_id for d in run.dispatched})
    return out


def continue_b(run: Run) -> dict[str, Any]:
    start = len(run.audit)
    first = run.pump()
    out: dict[str, Any] = {
        "first_pump": [[d.group_id, d.target_step, list(d.rollout_indexes), d.relaunch] for d in first]
    }
    out["trainer_step"] = run.owners.trainer_step
    out["cursor"] = run.owners.dispatch_index
    run.train()  # step 0: 0, 2, 9 were all finished before the cut
    out["after_step_0_pump"] = [[d.group_id, d.target_step, d.relaunch] for d in run.pump()]
    run.drain(4)
    snap = run.owners.capture()
    out["stream"] = {str(r.step): list(r.idxs) for r in run.audit[start:]}
    out["dropped"] = {str(r.step): [d.idx for d in r.dropped] for r in run.audit[start:] if r.dropped}
    out["spares"] = [s.idx for s in snap.spares]
    out["counters"] = run.owners.counters.__dict__
    out["weights"] = run.weights()
    return out


def main(argv: list[str]) -> int:
    action, uri = argv
    storage = open_storage(uri)
    if action == "resume-a":
        result = continue_a(Run.restore(EXAMPLE_A, DATASET, storage))
    elif action == "resume-b":
        result = continue_b(Run.restore(EXAMPLE_B, DATASET, storage))
    elif action == "crash-b":
        # Commit one cut, then die (SIGKILL-like: no cleanup) after the second cut's files
        # are written and before its manifest is.
        run = example_b_before_cut(storage)
        first = run.cut()
        print(json.dumps({"committed": first.cut_id}), flush=True)
        assert run.writer is not None
        run.writer.progress = lambda phase, step: os._exit(137) if phase == "files_written" else None
        run.cut("barrier")
        raise SystemExit("unreachable: the process should have died before committing")
    else:
        raise SystemExit(f"unknown action {action}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
