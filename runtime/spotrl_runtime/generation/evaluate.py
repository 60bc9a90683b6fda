"""Scoring a policy on a held-out split: what ``spotrl eval`` runs.

The job's own parts do the work, so that an evaluation asks the model exactly what training
asks it: the dataset's reader and fields, the prompt encoder (raw or through the chat
template, with the system prompt), the transformers backend, and the job's reward in its own
process under its timeout. Decoding is greedy by default (a nucleus of one token), as veRL and
TRL validate; ``samples`` > 1 with a temperature gives mean@k instead. A completion the reward
cannot score is counted as failed, and never as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GREEDY_TOP_P = 1e-9
"""A nucleus that holds only the most likely token: greedy decoding through the sampler."""


@dataclass
class EvalResult:
    prompts: int = 0
    completions: int = 0
    reward_sum: float = 0.0
    correct: int = 0
    """Completions whose reward is 1 (the accuracy of a verifiable reward)."""
    failed: int = 0
    response_tokens: int = 0
    clipped: int = 0
    """Completions cut off at ``maxNewTokens``."""
    by_task: dict[str, list[int]] = field(default_factory=dict)
    """Task → [correct, completions]."""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        scored = self.completions - self.failed
        return {
            "prompts": self.prompts,
            "completions": self.completions,
            "accuracy": self.correct / self.completions if self.completions else 0.0,
            "reward_mean": self.reward_sum / scored if scored else 0.0,
            "reward_failed": self.failed,
            "response_length_mean": self.response_tokens / self.completions if self.completions else 0.0,
            "response_clip_ratio": self.clipped / self.completions if self.completions else 0.0,
            "accuracy_by_task": {t: c / n for t, (c, n) in sorted(self.by_task.items())},
        }


def evaluate(
    job: Any,
    *,
    limit: int | None = None,
    samples: int = 1,
    temperature: float = 1.0,
    device: str = "cpu",
    batch_prompts: int = 32,
    examples: int = 3,
) -> EvalResult:
    """Scores the job's ``spec.policy.model`` on its ``spec.dataset`` (point them at an exported
    cut and a held-out split) with its prompt format, generation limits and reward: the first
    ``limit`` rows (all by default), in file order."""
    from spotrl_runtime.data import collate_for, open_dataset
    from spotrl_runtime.generation.rollouts import prompt_encoder
    from spotrl_runtime.generation.transformers_backend import TransformersBackend
    from spotrl_runtime.generation.types import FINISH_LENGTH, GenerationRequest
    from spotrl_runtime.models import load_policy
    from spotrl_runtime.rewards.runner import RewardFailure, RewardRunner

    spec = job.spec
    dataset = open_dataset(spec.dataset)
    collate = collate_for(spec.dataset)
    policy, tokenizer = load_policy(spec.policy, device)
    encode = prompt_encoder(tokenizer, spec.dataset)
    backend = TransformersBackend(policy, tokenizer)
    top_p = GREEDY_TOP_P if samples == 1 else spec.generation.top_p
    rows = range(min(len(dataset), limit) if limit else len(dataset))
    result = EvalResult()
    runner = RewardRunner(spec.reward, timeout=spec.reward.timeout_seconds, batched=spec.reward.batched)
    try:
        for start in range(0, len(rows), batch_prompts):
            prompts = [collate(dataset[i]) for i in rows[start : start + batch_prompts]]
            requests = [
                GenerationRequest(
                    group_id=f"eval-{p.idx}",
                    prompt_token_ids=tuple(encode(p)),
                    n=samples,
                    max_new_tokens=spec.generation.max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=p.idx,
                )
                for p in prompts
            ]
            for prompt, group in zip(prompts, backend.generate(requests), strict=True):
                texts = [s.text for s in group.samples]
                scores = runner.score(prompt, texts)
                result.prompts += 1
                tally = result.by_task.setdefault(prompt.task_name, [0, 0])
                for i, sample in enumerate(group.samples):
                    score = scores[i] if i < len(scores) else RewardFailure("not scored: an earlier sample failed")
                    result.completions += 1
                    tally[1] += 1
                    result.response_tokens += len(sample.completion_token_ids)
                    result.clipped += sample.finish_reason == FINISH_LENGTH
                    if isinstance(score, RewardFailure):
                        result.failed += 1
                        continue
                    result.reward_sum += score
                    if score == 1.0:
                        result.correct += 1
                        tally[0] += 1
                    if len(result.examples) < examples:
                        result.examples.append({"idx": prompt.idx, "completion": sample.text, "reward": score})
    finally:
        runner.close()
    return result
