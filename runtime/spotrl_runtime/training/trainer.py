"""The trainer: one optimizer step per call, over the finished groups stamped for it.

Read top to bottom: advantages per group (:mod:`~spotrl_runtime.training.advantages`), rows of
(prompt, completion, generation-time log-probs, advantage, loss scale), micro-batches (at most
``micro_batch_size`` rollouts and ``micro_batch_tokens`` padded tokens, longest rows first) whose
loss sums are scaled by the step's token count, gradient clipping, AdamW. Parameters and
optimizer state are float32; the passes compute in ``compute_dtype``
(:mod:`~spotrl_runtime.training.precision`). The frozen reference for the KL term is the policy
as the trainer received it (the initial policy); it is rebuilt from the policy spec on restore,
so :meth:`Trainer.state_dict` does not carry it.

With a LoRA adapter (:mod:`~spotrl_runtime.models.lora`) only the adapter trains: the base stays
frozen in its dtype, the adapter's parameters are the float32 masters, the KL reference is the
base itself (the adapter switched off, no second copy), and what leaves the trainer (cuts, the
weight channel) is the adapter alone (:meth:`Trainer.trained_state`).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from spotrl_runtime.checkpoint.lending import Lender
from spotrl_runtime.checkpoint.trainer_state import capture_rng, restore_rng
from spotrl_runtime.core.redo import StepFingerprint
from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.models import lora
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training import precision
from spotrl_runtime.training.advantages import DEFAULT_OBJECTIVE, Objective
from spotrl_runtime.training.losses import LossConfig, Tokens, kl_inside, token_loss_terms
from spotrl_runtime.training.rows import (
    LossSums,
    Row,
    Scored,
    plan_micro_batches,
    score_rows,
    scored_by_group,
    step_metrics,
    step_rows,
    step_updates,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STATE_FORMAT = 1


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's hyperparameters (``spec.training``, plus the sampling temperature and top-p)."""

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_epsilon: float = 0.2
    kl_coef: float = 0.0
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    """A micro-batch's padded tokens at most (rows times its longest row); None: rows alone decide."""
    temperature: float = 1.0
    """The generation temperature: the trainer's log-probs are taken at the same temperature."""
    top_p: float = 1.0
    """The generation top-p: the trainer's log-probs are taken over the same nucleus, the top-p
    nucleus of its own logits at ``temperature``, renormalised (:mod:`~spotrl_runtime.training.logprobs`)."""
    seed: int = 0
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many steps. A fresh AdamW's first updates move every
    weight by about the full learning rate whatever its gradient; a warmup keeps them small."""
    schedule: str = "constant"
    """After the warmup: ``constant``, or ``cosine`` down to 0 at ``total_steps``."""
    total_steps: int = 0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    is_cap: float | None = 2.0
    """The importance weight's cap (``training.importanceSamplingCap``; None, in tests only: no weight)."""
    is_level: str = "token"
    """``training.importanceSampling.level``: the ratio per token or per sequence."""
    is_mode: str = "truncate"
    """``training.importanceSampling.mode``: a ratio above the cap truncated to it, or masked."""
    kl_estimator: str = "k3"
    """``training.kl.estimator``: the KL term's per-token estimator."""
    lm_head: str = "policy"
    """``training.precision.lmHead``: the head's matrix product in ``policy.dtype`` or in ``float32``."""
    packing: str = "off"
    """``training.packing``: ``on``, several rollouts a row of a micro-batch
    (:func:`~spotrl_runtime.training.rows.pack`); ``off``; ``auto``, on where the policy's
    attention takes packed sequences apart (:func:`~spotrl_runtime.training.logprobs.packs_sequences`),
    decided when the trainer is built (:meth:`resolved`)."""
    clip_epsilon_high: float | None = None
    dual_clip: float | None = 3.0
    compute_dtype: str = "float32"
    """``policy.dtype``: what the passes compute in (the parameters stay float32)."""
    activation_checkpointing: str = "auto"
    objective: Objective = DEFAULT_OBJECTIVE
    """The advantage estimator and the loss aggregation (``training.advantage``, ``lossAggregation``)."""
    mini_batches: int = 1
    """Optimizer updates per pass over the step's groups (``training.miniBatches``)."""
    epochs: int = 1
    """Passes over the step's groups (``training.epochs``)."""

    def __post_init__(self) -> None:
        if self.objective.reward_kl and self.objective.reward_kl != self.kl_coef:
            raise ValueError(
                f"objective.reward_kl ({self.objective.reward_kl}) must be kl_coef ({self.kl_coef}): the KL in the "
                "reward is weighed by training.klCoef"
            )

    @property
    def layout(self) -> str:
        """The step's updates and micro-batches as a fingerprint records them: "" for one update
        a step of padded rows (every step before mini-batches and packing), else
        ``miniBatches=M,epochs=E`` and/or ``packed``, comma-separated."""
        parts = [f"miniBatches={self.mini_batches},epochs={self.epochs}"] if self.mini_batches * self.epochs > 1 else []
        return ",".join(parts + (["packed"] if self.packed else []))

    @property
    def packed(self) -> bool:
        return self.packing == "on"

    def resolved(self, model: Any) -> TrainerConfig:
        """This config with ``packing`` ``on`` or ``off`` for ``model`` (``auto`` decided; ``on``
        refused by name for a model that cannot take packed sequences)."""
        fits = lp.packs_sequences(model)
        if self.packing == "on" and not fits:
            raise ValueError(
                f"training.packing: on, but {type(model).__name__}'s attention does not take packed sequences apart "
                "by their position ids (it does not build its mask with transformers' create_causal_mask); set "
                "training.packing to auto or off"
            )
        return replace(self, packing="on" if self.packing == "on" or (self.packing == "auto" and fits) else "off")

    def plan(self, rows: Sequence[Row]) -> list[list[Row]]:
        """``rows`` in this trainer's micro-batches (:func:`~spotrl_runtime.training.rows.plan_micro_batches`)."""
        return plan_micro_batches(rows, self.micro_batch_size, self.micro_batch_tokens, self.packed)

    @classmethod
    def from_rljob(cls, spec: Any) -> TrainerConfig:
        """From ``RLJob.spec`` (its ``training``, ``generation.temperature`` and ``generation.topP``)."""
        t = spec.training
        return cls(
            learning_rate=t.learning_rate,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            clip_epsilon=t.clip_epsilon,
            kl_coef=t.kl_coef,
            micro_batch_size=t.micro_batch_size,
            micro_batch_tokens=t.micro_batch_tokens,
            temperature=spec.generation.temperature,
            top_p=spec.generation.top_p,
            seed=t.seed,
            warmup_steps=t.warmup_steps,
            schedule=t.lr_schedule,
            total_steps=t.total_steps,
            is_cap=t.importance_sampling_cap,
            is_level=t.importance_sampling.level,
            is_mode=t.importance_sampling.mode,
            kl_estimator=t.kl.estimator,
            lm_head=t.precision.lm_head,
            packing=t.packing,
            clip_epsilon_high=t.clip_epsilon_high,
            dual_clip=t.dual_clip,
            compute_dtype=spec.policy.dtype,
            activation_checkpointing=t.activation_checkpointing,
            mini_batches=t.mini_batches,
            epochs=t.epochs,
            objective=Objective(
                estimator=t.advantage.estimator,
                normalize_by_std=t.advantage.normalize_by_std is not False,
                aggregation=t.loss_aggregation,
                max_new_tokens=spec.generation.max_new_tokens,
                overlong_filter=t.overlong.filter,
                soft_penalty=(penalty.buffer, penalty.factor) if (penalty := t.overlong.soft_penalty) else None,
                reward_kl=t.kl_coef if t.kl.in_reward else 0.0,
            ),
        )

    @property
    def sampling(self) -> tuple[float, float, bool]:
        """What every log-prob pass takes besides the batch (:func:`~spotrl_runtime.training.logprobs.call`):
        the generation's temperature and top-p, and whether the head computes in float32."""
        return self.temperature, self.top_p, self.lm_head == "float32"

    @property
    def loss(self) -> LossConfig:
        """The loss's knobs: no KL term where the KL is in the reward (``objective.reward_kl``)."""
        return LossConfig(
            self.clip_epsilon,
            self.clip_epsilon_high,
            self.dual_clip,
            self.is_cap,
            0.0 if self.objective.reward_kl else self.kl_coef,
            self.is_level,
            self.is_mode,
            self.kl_estimator,
        )

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): linear warmup, then the schedule."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if self.schedule == "cosine" and self.total_steps > self.warmup_steps:
            progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            return self.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.learning_rate


class StepInterruptedError(Exception):
    """:meth:`Trainer.train_step` was asked to stop (a barrier came) before its optimizer step:
    nothing of the step was applied (weights, optimizer, step count and RNG are as before it),
    and its groups are trained by a later step."""


class Trainer:
    """GRPO on a transformers causal LM. ``step`` counts optimizer steps taken (= weight version)."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        *,
        pad_token_id: int = 0,
        reference: PreTrainedModel | None = None,
        adapter: lora.AdapterIdentity | None = None,
    ) -> None:
        """``model``'s parameters become float32 masters if they are not. ``reference``: the KL
        term's frozen policy, when the caller built it (a rank shards its own); by default a copy
        of ``model`` when ``kl_coef`` is set. ``adapter``: the identity of the LoRA adapter
        ``model`` carries (:func:`~spotrl_runtime.models.lora.add_adapter`), which its cuts record."""
        torch.manual_seed(config.seed)
        self.compute_dtype = precision.compute_dtype(config.compute_dtype)
        if lora.has_adapter(model) != (adapter is not None):
            raise ValueError("a model with a LoRA adapter needs its identity (adapter=), and only such a model")
        self.adapter = adapter
        if adapter is None and any(p.dtype != precision.MASTER_DTYPE for p in model.parameters()):
            model = cast(Any, model).to(precision.MASTER_DTYPE)
        self.model = lp.attach(model)
        self.config = config.resolved(model)
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.step = 0
        self.activation_checkpointing = precision.wants_activation_checkpointing(config.activation_checkpointing, model)
        if self.activation_checkpointing:
            precision.enable_activation_checkpointing(model)
        self.reference = reference
        if reference is None and config.kl_coef > 0 and adapter is None:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.lender = Lender()
        """Lends the weights and optimizer state to cuts; the optimizer step waits for it."""

    def use_packing(self, packed: bool) -> None:
        """Packs the next steps' micro-batches or not, whatever ``training.packing`` said: a delta
        cut's redo trains each step as its record says it was trained."""
        self.config = replace(self.config, packing="on" if packed else "off")

    # ------------------------------------------------------------------ the step

    def train_step(
        self, groups: Sequence[FinishedGroup], interrupted: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """One step on ``groups``: ``epochs`` passes over its ``miniBatches`` updates
        (:func:`~spotrl_runtime.training.rows.step_updates`); returns its metrics.

        Groups whose rewards are all equal contribute nothing (zero advantage). If no group
        contributes, the weights stay as they are but the step still counts, so the weight
        version keeps matching the step number.

        ``interrupted`` is asked between micro-batches until the step's first update: once it
        says yes, the step stops there with :class:`StepInterruptedError`, having changed nothing
        (a barrier then waits one micro-batch, not a whole step). After the first update the
        step runs to its end (a barrier waits for it).
        """
        started = time.monotonic()
        scored = self.score_groups(groups, interrupted) if self.config.objective.reward_kl else None
        plan = step_rows(groups, self.config.objective, scored)
        runs = step_updates(groups, plan, self.config.objective, self.config.mini_batches)
        sums, grad_norm, lr = self.run_updates([(u.rows, u.tokens, None) for u in runs], interrupted=interrupted)
        metrics = step_metrics(plan, sums, epochs=self.config.epochs)
        metrics.update(grad_norm=grad_norm, learning_rate=lr, step=float(self.step), seconds=time.monotonic() - started)
        return metrics

    def run_updates(
        self,
        updates: Sequence[tuple[Sequence[Row], int, int | None]],
        *,
        loss_scale: float = 1.0,
        interrupted: Callable[[], bool] | None = None,
    ) -> tuple[LossSums, float, float]:
        """The step itself, one process's or one FSDP rank's: ``epochs`` passes over ``updates``
        (rows, their loss's token count over every rank, the passes every rank runs), each an
        optimizer update (:meth:`optimizer_step`); the step count goes up by one. With more than
        one update, every row's proximal log-probs are taken first, before any update
        (decoupled PPO's proximal policy: the ratio and its clips act from the second update on).
        Returns (loss sums over every update, mean grad norm, learning rate)."""
        count = len(updates) * self.config.epochs
        if count == 1:
            rows, tokens, passes = updates[0]
            sums, grad_norm, lr = self.optimizer_step(
                rows, tokens, micro_batches=passes, loss_scale=loss_scale, interrupted=interrupted
            )
            self.step += 1
            return sums, grad_norm, lr
        if not self.config.objective.reward_kl:  # else the scoring pass took them (every rank alike)
            updates = [(self.proximal(rows, passes, interrupted), t, passes) for rows, t, passes in updates]
        total, norms = LossSums(), []
        for _ in range(self.config.epochs):
            for rows, tokens, passes in updates:
                sums, grad_norm, lr = self.optimizer_step(
                    rows, tokens, micro_batches=passes, loss_scale=loss_scale, interrupted=interrupted
                )
                interrupted = None  # the first update is applied: the step runs to its end
                if tokens:
                    sums.loss /= tokens  # this update's loss
                total.merge(sums)
                norms.append(grad_norm)
        # the reported loss is the mean of the updates' (step_metrics divides by tokens x epochs)
        total.loss *= sum(t for _, t, _ in updates) * self.config.epochs / count
        self.step += 1
        return total, sum(norms) / len(norms), lr

    def optimizer_step(
        self,
        rows: Sequence[Row],
        total_tokens: int,
        *,
        micro_batches: int | None = None,
        loss_scale: float = 1.0,
        interrupted: Callable[[], bool] | None = None,
    ) -> tuple[LossSums, float, float]:
        """One optimizer update: the gradients of ``rows`` (:meth:`accumulate`), clipping, AdamW
        at this step's learning rate. Returns (loss sums, grad norm, learning rate). A rank
        passes the update's ``total_tokens`` over every rank, the passes every rank runs and its
        world size as ``loss_scale``; FSDP makes clipping and AdamW collective."""
        rng = capture_rng() if interrupted is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        try:
            sums = self.accumulate(
                rows, max(total_tokens, 1), micro_batches=micro_batches, loss_scale=loss_scale, interrupted=interrupted
            )
            if interrupted is not None and interrupted():
                raise StepInterruptedError(f"step {self.step} interrupted before its optimizer step")
        except StepInterruptedError:
            self.optimizer.zero_grad(set_to_none=True)
            if rng is not None:
                restore_rng(rng)  # a dropout's draws are made again when the step is
            raise
        lr = self.learning_rate_at(self.step)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        grad_norm = 0.0
        if total_tokens:
            params = [p for p in self.model.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor on ranks
            self.wait_for_cuts()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums, grad_norm, lr

    def compute_gradients(
        self, groups: Sequence[FinishedGroup], interrupted: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """Accumulates the step's loss gradient into ``.grad`` (no optimizer step) and returns the
        loss metrics. Each micro-batch's loss sum is divided by the step's token count, so the
        gradient is the same whatever ``micro_batch_size`` is."""
        plan = step_rows(groups, self.config.objective)
        sums = self.accumulate(plan.rows, plan.tokens, interrupted=interrupted)
        return step_metrics(plan, sums)

    def accumulate(
        self,
        rows: Sequence[Row],
        total_tokens: int,
        *,
        micro_batches: int | None = None,
        loss_scale: float = 1.0,
        interrupted: Callable[[], bool] | None = None,
    ) -> LossSums:
        """Backward passes over ``rows`` in micro-batches, each micro-batch's loss sum divided by
        ``total_tokens`` (the whole step's, over every rank) and multiplied by ``loss_scale``.

        ``micro_batches`` pads the count with passes that contribute nothing: with FSDP every rank
        must run as many forward/backward passes (each one gathers parameters with the others),
        whatever its share of the step's rows. ``interrupted``: asked before each micro-batch
        (:class:`StepInterruptedError`); one process only, since ranks must run the same passes.
        """
        chunks = self.config.plan(rows)
        padding = max(0, (micro_batches or 0) - len(chunks))
        sums = LossSums()
        self.model.train()
        try:
            for i, chunk in enumerate(chunks):
                if interrupted is not None and interrupted():
                    raise StepInterruptedError(f"step {self.step} interrupted after {i} of {len(chunks)} micro-batches")
                terms, batch = self._micro_batch(chunk)
                (terms.loss_sum * (loss_scale / total_tokens)).backward()
                sums.add(terms, batch.padded_tokens, batch.real_tokens)
            for _ in range(padding):
                terms, _ = self._micro_batch([Row((self.pad_token_id,), (self.pad_token_id,), (0.0,), 0.0)])
                (terms.loss_sum * 0.0).backward()
        finally:
            self.model.eval()
        return sums

    def proximal(
        self, rows: Sequence[Row], passes: int | None = None, interrupted: Callable[[], bool] | None = None
    ) -> list[Row]:
        """``rows`` with their proximal log-probs (:meth:`score`'s, without the reference)."""
        scores = self.score(rows, passes, interrupted, kl=False)
        return [replace(r, proximal=s.logprobs) for r, s in zip(rows, scores, strict=True)]

    def score_groups(
        self, groups: Sequence[FinishedGroup], interrupted: Callable[[], bool] | None = None
    ) -> list[list[Scored]]:
        """Every rollout of ``groups`` scored (:meth:`score`), per group, per rollout."""
        by_group = score_rows(groups)
        return scored_by_group(groups, self.score([r for g in by_group for r in g], interrupted=interrupted))

    def score(
        self,
        rows: Sequence[Row],
        passes: int | None = None,
        interrupted: Callable[[], bool] | None = None,
        *,
        kl: bool = True,
    ) -> list[Scored]:
        """``rows``' completions as the policy sees them before any update of the step, one pass
        without gradients (in eval mode, as veRL's ``old_log_prob``; no dropout, so no RNG drawn)
        in the micro-batches an update would run: their log-probs (the proximal ones) and, with
        ``kl``, the KL estimator against the reference summed over each (``training.kl.inReward``;
        a token outside either's nucleus counts 0, as in the loss). ``passes`` pads the count
        for a rank: every rank's collectives line up with the others'."""
        chunks = self.config.plan(rows)
        sampling = self.config.sampling
        out: dict[int, Scored] = {}
        with torch.no_grad(), precision.autocast(self.device, self.compute_dtype):
            for chunk in chunks:
                if interrupted is not None and interrupted():
                    raise StepInterruptedError(f"step {self.step} interrupted before its first update")
                batch = self._token_batch(chunk)
                logprobs, _ = lp.call(self.model, batch, *sampling)
                lengths = [r.trained for r in chunk]
                sums = self._kl_sums(logprobs, batch, lengths) if kl else [0.0] * len(chunk)
                for row, values, total in zip(chunk, logprobs.float().cpu().split(lengths), sums, strict=True):
                    out[id(row)] = Scored(total, tuple(values.tolist()))
            for _ in range(max(0, (passes or 0) - len(chunks))):
                pad = lp.token_batch([((self.pad_token_id,), (self.pad_token_id,))], self.pad_token_id, self.device)
                logprobs, _ = lp.call(self.model, pad, *sampling)
                if kl:
                    self._kl_sums(logprobs, pad, [1])
        return [out[id(r)] for r in rows]

    def _kl_sums(self, logprobs: torch.Tensor, batch: lp.TokenBatch, lengths: Sequence[int]) -> list[float]:
        """The KL estimator of ``logprobs`` against the reference's, summed per row of ``lengths``."""
        reference = self._reference(batch)
        if reference is None:
            raise ValueError("training.kl.inReward needs a reference policy (training.klCoef above 0)")
        values = kl_inside(logprobs, reference, self.config.kl_estimator)
        return [float(v.sum()) for v in values.float().cpu().split(list(lengths))]

    def _reference(self, batch: lp.TokenBatch) -> torch.Tensor | None:
        """The frozen reference's log-probs of ``batch`` (None: no reference): the copy, or with
        LoRA the base itself, the adapter switched off."""
        with torch.no_grad():
            if self.reference is not None:
                return lp.call(self.reference, batch, *self.config.sampling)[0]
            if self.adapter is not None and self.config.kl_coef > 0:
                with lora.base_only(self.model):
                    return lp.call(self.model, batch, *self.config.sampling)[0]
        return None

    def warm_up(self, rows: int = 2, tokens: int = 16) -> float:
        """One forward and backward pass over ``rows`` dummy rows of ``tokens`` tokens, nothing
        kept: the weights, the optimizer, the step count, the gradients (None, as before any
        step) and the RNG are as they were. Returns its seconds.

        A process's first pass pays once for what later ones reuse (kernels chosen and set up,
        thread pools, lazily imported code): the first step of the tiny policy costs many times
        what the next ones do (docs/benchmarks.md). The controller warms up while its
        generation workers start, so the first step after a resume does not pay it."""
        started = time.monotonic()
        rng = capture_rng()
        half = max(1, tokens // 2)
        row = Row((self.pad_token_id,) * half, (self.pad_token_id,) * half, (0.0,) * half, 0.0)
        self.model.train()
        try:
            terms, _ = self._micro_batch([row] * max(1, rows))
            (terms.loss_sum * 0.0).backward()
        finally:
            self.model.eval()
            self.optimizer.zero_grad(set_to_none=True)
            restore_rng(rng)
        return time.monotonic() - started

    def learning_rate_at(self, step: int) -> float:
        return self.config.learning_rate_at(step)

    def _micro_batch(self, rows: Sequence[Row]) -> tuple[Any, lp.TokenBatch]:
        """One forward pass over ``rows`` (right-padded): the loss terms at their completion tokens."""
        batch = self._token_batch(rows)
        per_row = [r.trained for r in rows]
        behaviour = torch.tensor([x for r in rows for x in r.old_logprobs], dtype=torch.float32, device=self.device)
        advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32).repeat_interleave(
            torch.tensor(per_row)
        )
        scale = torch.tensor([r.scale for r in rows], dtype=torch.float32).repeat_interleave(torch.tensor(per_row))
        fresh = torch.tensor([r.weight_version == self.step for r in rows]).repeat_interleave(torch.tensor(per_row))
        proximal = None
        if rows[0].proximal is not None:
            proximal = torch.tensor(
                [x for r in rows for x in r.proximal or ()], dtype=torch.float32, device=self.device
            )
        with precision.autocast(self.device, self.compute_dtype):
            sampling = self.config.sampling
            logprobs, entropy = lp.call(self.model, batch, *sampling)
            reference = self._reference(batch) if self.config.loss.kl_coef > 0 else None
        tokens = Tokens(
            logprobs=logprobs,
            proximal=proximal if proximal is not None else logprobs.detach(),
            behaviour=behaviour,
            advantages=advantages.to(self.device),
            fresh=fresh.to(self.device),
            reference=reference,
            scale=scale.to(self.device),
            rows=torch.arange(len(rows)).repeat_interleave(torch.tensor(per_row)).to(self.device),
        )
        terms = token_loss_terms(tokens, self.config.loss)
        return replace(terms, entropy_sum=float(entropy.sum())), batch

    def _token_batch(self, rows: Sequence[Row]) -> lp.TokenBatch:
        """``rows`` on the device, their observations as context only."""
        pairs = [(r.prompt_ids, r.completion_ids) for r in rows]
        observed = [r.observed for r in rows]
        return lp.token_batch(pairs, self.pad_token_id, self.device, self.config.packed, observed)

    def fingerprint(self, metrics: Mapping[str, float]) -> StepFingerprint:
        """The fingerprint of the step just taken (``metrics``: what :meth:`train_step` returned):
        its loss, its gradient norm and a digest of the first values of four trained parameters
        (the first, the last and two between), which a redone step must reproduce."""
        params = list(self.model.named_parameters()) if self.adapter is None else list(self.trained_state().items())
        digest = hashlib.sha256()
        for i in sorted({0, len(params) // 3, 2 * len(params) // 3, len(params) - 1}):
            name, p = params[i]
            digest.update(name.encode())
            digest.update(p.detach().reshape(-1)[:256].to("cpu", torch.float32).numpy().tobytes())
        where = f"{self.device.type}/1"
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        return StepFingerprint(loss, grad_norm, digest.hexdigest()[:32], where, self.config.layout)

    # ------------------------------------------------------------------ state

    def weight_sender(self, bucket_bytes: int, timeout: float, transport: str = "gloo") -> Any:
        """The weight channel's sender of this trainer's live weights (never copied whole: each
        bucket is cast to the compute dtype as it is packed), served from this process.
        ``transport``: what the workers' places need (:mod:`~spotrl_runtime.generation.transport`)."""
        from spotrl_runtime.generation.weights import ChannelHost, WeightSender, channel_host_address

        channel = ChannelHost(channel_host_address(), backend=transport, timeout=timeout)
        dtype = str(self.compute_dtype).removeprefix("torch.")
        # The trainer's own GPU (cuda:N): NCCL's buffers must be on the GPU it trains on.
        return WeightSender(
            lambda: self.trained_state(keep_vars=True), dtype, channel, bucket_bytes, device=str(self.device)
        )

    def trained_state(self, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """What this trainer trains, by name: the model's ``state_dict()``, or the adapter's
        parameters alone with LoRA. Cuts, the weight channel and redone steps see only this."""
        if self.adapter is not None:
            return lora.adapter_tensors(self.model, keep_vars=keep_vars)
        return dict(self.model.state_dict(keep_vars=keep_vars))

    def load_trained_state(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Loads :meth:`trained_state`'s output (every name, and only those)."""
        if self.adapter is None:
            self.model.load_state_dict(weights, strict=True)
            return
        own = self.trained_state(keep_vars=True)
        if set(weights) != set(own):
            missing, unknown = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
            raise ValueError(f"the adapter state does not fit: missing {missing[:3]}, unexpected {unknown[:3]}")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(weights[name])

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the trained weights in the compute dtype: what a resume keeps of an older
        version its relaunched groups ask for (:mod:`~spotrl_runtime.checkpoint.resume`)."""
        state = {k: v.to("cpu", copy=True) for k, v in self.trained_state().items()}
        return precision.to_compute_dtype(state, self.compute_dtype)

    def snapshot(self, meta: Mapping[str, Any], *, last: bool = False) -> Any:
        """The trainer's part of a cut (call it between steps, under the cut's lock): its tensors,
        lent (:class:`~spotrl_runtime.checkpoint.lending.Lender`); with LoRA, the adapter's
        identity in its meta."""
        if self.adapter is not None:
            meta = {**meta, "adapter": self.adapter.to_json()}
        return self.lender.lend(self.trained_state(), self.optimizer, self.step, meta, last=last)

    def wait_for_cuts(self) -> float:
        """Waits until no cut holds this trainer's live tensors; returns the seconds waited."""
        return self.lender.wait()

    @property
    def cut_copy(self) -> str:
        """How :meth:`snapshot` takes the tensors: ``"background"`` or ``"locked"``."""
        return self.lender.mode

    @cut_copy.setter
    def cut_copy(self, mode: str) -> None:
        self.lender.mode = mode

    @property
    def cut_wait_seconds(self) -> float:
        return self.lender.wait_seconds

    def load_sharded(self, cut: Any, *, storage: Any = None) -> None:
        """Loads a ``dcp/v1`` cut (a :class:`~spotrl_runtime.checkpoint.sharded.ShardedCut`, written
        by a trainer group of any size) into this one process: weights, optimizer state and step.
        The cut's RNG states are not restored (a sharded cut holds none). ``storage``: the store
        the cut is in (default: opened from ``cut.storage_uri``, S3 settings from the environment)."""
        from spotrl_runtime.checkpoint.sharded import apply_sharded, load_sharded, sharded_state
        from spotrl_runtime.storage import open_storage

        self.wait_for_cuts()
        state = sharded_state(self.model, self.optimizer)
        store = storage if storage is not None else open_storage(cut.storage_uri)
        load_sharded(state, store, cut.folder, cut.files, no_dist=True)
        apply_sharded(self.model, self.optimizer, state)
        self.step = int(cut.meta["trainer_step"])

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed trainer needs: step, model, optimizer and RNG states."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "model": {k: v.to("cpu", copy=True) for k, v in self.trained_state().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": rng,
            "config": asdict(self.config),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into a trainer built from the same policy spec."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"trainer state format {state.get('format')!r} is not {STATE_FORMAT}; it comes from another version"
            )
        self.wait_for_cuts()
        self.load_trained_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step = int(state["step"])
