"""Which prompts a run admits: the filters a prompt passes when the gate stamps it (pure).

A prompt a filter refuses is *filtered*: it leaves the ledger with its reason (an audit
:class:`~spotrl_runtime.core.audit.DroppedPrompt` in state ``filtered``), its place in the
step is filled as ``preemption.onDroppedPrompt`` says (``shrink`` or ``replace``), and it is
never generated. A filter is a function of the prompt alone (its content, through the one
encoder generation uses) and of settings the cut keeps (:class:`PromptLimit` is part of the
recovery config), so a resume filters exactly the prompts the run it resumes would have.

The one filter today is the prompt's length: a prompt whose tokens leave less than
``maxNewTokens`` of the engine's context (``maxModelLen``, else the model's own
``max_position_embeddings``) could not be generated whole; vLLM refuses one that fills the
context outright. Later filters (dynamic sampling, restarted agent episodes) give other reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spotrl_runtime.core.types import Prompt

AdmissionFilter = Callable[[Prompt], str | None]
"""A prompt -> the reason to filter it, or None to admit it."""

PROMPT_TOO_LONG = "prompt_too_long"

MAX_MODEL_LEN = "maxModelLen"
"""Where the context comes from: ``spec.generation.maxModelLen``."""
MODEL_POSITIONS = "the model's max_position_embeddings"
"""Where the context comes from when maxModelLen is unset: the policy's config."""


@dataclass(frozen=True)
class PromptLimit:
    """The context a prompt and its longest completion must fit together."""

    max_model_len: int
    max_new_tokens: int
    source: str = MAX_MODEL_LEN

    def refusal(self, prompt_tokens: int) -> str | None:
        """Why a prompt of ``prompt_tokens`` tokens is filtered, or None if it fits."""
        if prompt_tokens + self.max_new_tokens <= self.max_model_len:
            return None
        return (
            f"{PROMPT_TOO_LONG}: {prompt_tokens} tokens + maxNewTokens {self.max_new_tokens} > "
            f"{self.source} {self.max_model_len}"
        )

    def filter(self, measure: Callable[[Prompt], int]) -> AdmissionFilter:
        """The admission filter of this limit; ``measure``: a prompt's token count as generation
        encodes it."""
        return lambda prompt: self.refusal(measure(prompt))


def prompt_limit(max_model_len: int | None, max_new_tokens: int, model_positions: int | None) -> PromptLimit | None:
    """The limit a job's prompts are filtered by: ``maxModelLen`` where set, else the model's
    max positions where its config has them, else none (no prompt is filtered for length)."""
    if max_model_len is not None:
        return PromptLimit(max_model_len, max_new_tokens, MAX_MODEL_LEN)
    if model_positions is not None and model_positions > 0:
        return PromptLimit(model_positions, max_new_tokens, MODEL_POSITIONS)
    return None
