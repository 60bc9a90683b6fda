"""An observation in the chat template's words, as tokens to append after a generated turn.

Token in, token out: the episode's context is the prompt, then each turn's tokens exactly as
the policy generated them, then each observation's tokens. Nothing already in the context is
rendered again (a template may render history differently from how it was generated, e.g.
Qwen3 drops earlier turns' thinking), so the trainer scores the very tokens that were sampled.

The template renders the observation: the text between the end of an assistant turn and the
start of the next assistant turn, taken as the difference between two renderings of a fixed
conversation, one with the observation's messages and the generation prompt, one without.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"}]


class ObservationRenderer:
    """Renders observation messages (``{"role": "tool", "content": ...}``) with ``tokenizer``'s
    chat template, to follow a turn that ended with ``end_token`` (the template's end of turn)."""

    def __init__(self, tokenizer: Any, end_token: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("spec.environment needs a chat model: the policy's tokenizer has no chat template")
        self.tokenizer = tokenizer
        base = self._render(_PROBE, generation_prompt=False)
        end = end_token or tokenizer.eos_token
        if not end or end not in base:
            raise ValueError(f"the chat template does not close an assistant turn with {end!r}")
        self._base = base
        self._after_end = base[base.rindex(end) + len(end) :]
        """What the template writes after a turn's end token (ChatML: a newline)."""

    def render(self, messages: Sequence[dict[str, Any]]) -> tuple[int, ...]:
        """The tokens that follow a turn's end token: ``messages`` and the next assistant turn's
        opening, as the template writes them."""
        full = self._render([*_PROBE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier turns differently once an observation follows")
        text = self._after_end + full[len(self._base) :]
        return tuple(int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        )
