"""Generation with a transformers causal LM and our own sampling loop (the CPU path: tests, demo).

Every group draws from its own ``torch.Generator`` seeded by its request, so a group's samples
do not depend on which other groups share the batch. The recorded log-probabilities are those
of the distribution each token was actually drawn from (:func:`.sampling.sampling_logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.sampling import sampling_logprobs
from spotrl_runtime.generation.types import FINISH_LENGTH, FINISH_STOP, GenerationRequest, GroupGenerated, Sample
from spotrl_runtime.generation.weights import ChannelAddress, ChannelMember, SyncPlan, WeightSyncError, unique_tensors
from spotrl_runtime.models import lora

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class TransformersBackend(GenerationBackend):
    """Batched sampling with a KV cache on any transformers causal LM (CPU or one GPU)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        weight_version: int = 0,
        max_batch_rows: int = 256,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.max_batch_rows = max_batch_rows
        self.device = next(model.parameters()).device
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.pad_id = int(pad)
        self._channel = ChannelMember()

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> TransformersBackend:
        """Loads ``spec.model`` onto ``spec.device`` (see :func:`spotrl_runtime.models.load_policy`)."""
        from spotrl_runtime.models import load_policy

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        model, tokenizer = load_policy(spec.model, spec.device, dtype=spec.dtype)
        if spec.lora is not None:
            lora.add_adapter(model, spec.lora, base="", seed=spec.seed, master=False)
        return cls(model, tokenizer, max_batch_rows=spec.max_batch_rows)

    def context_tokens(self) -> int | None:
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return int(positions) if positions else None

    def join_channel(self, address: ChannelAddress) -> None:
        self._channel.join(address)

    def receive_weights(self, plan: SyncPlan, version: int) -> int:
        """Copies each bucket's tensors into the model's as it arrives. Every tensor of the model
        (of its adapter, with LoRA) must be in ``plan`` (a tied head comes with its embedding),
        and only those."""
        if lora.has_adapter(self.model):
            params = lora.adapter_tensors(self.model, keep_vars=True)
        else:
            params = self.model.state_dict(keep_vars=True)  # the parameters themselves: a tied one once
        names = {t.name for t in plan.tensors}
        unknown = sorted(names - set(params))
        missing = sorted(n for n, _ in unique_tensors(params) if n not in names)
        if unknown or missing:
            raise WeightSyncError(
                f"the weights sent do not fit the worker's {type(self.model).__name__}: names it lacks "
                f"{unknown[:5]}, its tensors not sent {missing[:5]}; do the trainer and workers load the same model?"
            )

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                params[name].copy_(tensor)

        with torch.no_grad():
            got = self._channel.receive(plan, version, load)
        self.weight_version = version
        return got

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        results: list[GroupGenerated] = []
        batch: list[GenerationRequest] = []
        rows = 0
        for request in requests:
            if batch and rows + request.n > self.max_batch_rows:
                results.extend(self._generate_batch(batch))
                batch, rows = [], 0
            batch.append(request)
            rows += request.n
        if batch:
            results.extend(self._generate_batch(batch))
        return results

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        started = time.monotonic()
        version = self.weight_version
        # One row per sample: group g's n rows are contiguous.
        spans: list[tuple[int, int]] = []
        for r in requests:
            start = spans[-1][1] if spans else 0
            spans.append((start, start + r.n))
        token_grid, logprob_grid, lengths = self._sample(requests, spans)
        seconds = time.monotonic() - started
        results = []
        for request, (lo, hi) in zip(requests, spans, strict=True):
            samples = tuple(self._sample_of(token_grid[row], logprob_grid[row], lengths[row]) for row in range(lo, hi))
            results.append(
                GroupGenerated(
                    group_id=request.group_id,
                    prompt_token_ids=request.prompt_token_ids,
                    samples=samples,
                    weight_version=version,
                    seconds=seconds,
                )
            )
        return results

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask), left-padded: every prompt ends at the same column."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    def _sample(
        self, requests: Sequence[GenerationRequest], spans: Sequence[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Decodes every sample of ``requests`` together (each group with its own seeded
        generator); (tokens, logprobs, lengths) per row, on the CPU."""
        device = self.device
        input_ids, attention = self._left_padded([r.prompt_token_ids for r in requests for _ in range(r.n)])
        num_rows = input_ids.shape[0]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.temperature for r in requests for _ in range(r.n)], device=device)
        top_p = torch.tensor([r.top_p for r in requests for _ in range(r.n)], device=device)
        limit = torch.tensor([r.max_new_tokens for r in requests for _ in range(r.n)], device=device)
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
        eos = torch.tensor(sorted(self.eos_ids), device=device)

        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        for _ in range(max(r.max_new_tokens for r in requests)):
            dist = sampling_logprobs(out.logits[:, -1, :], temperature, top_p)
            probs = dist.exp()
            chosen = torch.empty(num_rows, dtype=torch.long, device=device)
            for (lo, hi), gen in zip(spans, generators, strict=True):
                chosen[lo:hi] = torch.multinomial(probs[lo:hi], 1, generator=gen).squeeze(-1)
            chosen = torch.where(finished, torch.full_like(chosen, self.pad_id), chosen)
            tokens.append(chosen)
            logprobs.append(dist.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
            lengths += (~finished).long()
            finished |= torch.isin(chosen, eos) | (lengths >= limit)
            if bool(finished.all()):
                break
            attention = torch.cat([attention, torch.ones((num_rows, 1), dtype=attention.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=chosen.unsqueeze(-1),
                attention_mask=attention,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
        lengths_list: list[int] = lengths.cpu().tolist()
        return torch.stack(tokens, dim=1).cpu(), torch.stack(logprobs, dim=1).float().cpu(), lengths_list

    def _sample_of(self, tokens: torch.Tensor, logprobs: torch.Tensor, n: int) -> Sample:
        """One row of the grids as a sample: its first ``n`` tokens."""
        ids = tuple(int(t) for t in tokens[:n].tolist())
        stopped = bool(ids) and ids[-1] in self.eos_ids
        return Sample(
            completion_token_ids=ids,
            logprobs=tuple(float(x) for x in logprobs[:n].tolist()),
            finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
            text=str(self.tokenizer.decode(list(ids), skip_special_tokens=True)),
        )


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the policy has no eos_token_id in its config or tokenizer; generation could never stop")
    return ids
