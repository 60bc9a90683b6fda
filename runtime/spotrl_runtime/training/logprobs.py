"""The policy's log-probabilities of the tokens a step trains on, and nothing more.

A micro-batch is right-padded rows of prompt + completion. Only completion tokens are trained,
so the language-model head runs only where they are predicted: the decoder's hidden states are
gathered at those positions first (``[tokens, hidden]``), then the head and an fp32 log-softmax
run over them a chunk at a time (:data:`LOGITS_CHUNK_ELEMENTS`). ``[rows, seq, vocab]`` logits
are never built, in any dtype: with Qwen's 151,936-entry vocabulary a micro-batch of 8 rows of
512 tokens would be 2.5 GB of fp32 logits for the log-softmax alone, most of them at prompt and
padding positions. In a backward pass each chunk's logits are recomputed from its hidden states
(a checkpoint around the head), so what a step keeps is ``[tokens, hidden]``, not
``[tokens, vocab]``.

The log-probs are those of the distribution generation samples from
(:func:`~spotrl_runtime.generation.sampling.sampling_logprobs`, the one definition of it): the
logits divided by the temperature and, with ``generation.topP < 1``, restricted to the trainer's
own top-p nucleus of them and renormalised. A sampled token outside that nucleus (the trainer's
and the generator's numerics differ, and so may their nuclei at the edge) gets -inf; the loss
leaves such tokens out and counts them (:func:`~spotrl_runtime.training.losses.token_loss_terms`).

Models whose causal-LM head does more than ``lm_head(hidden)`` (a logit scale or soft-capping)
would get wrong log-probs from this path, and are refused (:func:`check_plain_head`); Llama,
Qwen2/2.5/3, Mistral and their kin are plain heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from spotrl_runtime.core.types import generated_offsets
from spotrl_runtime.generation.sampling import sampling_logprobs
from spotrl_runtime.training.rows import micro_batch_rows

LOGITS_CHUNK_ELEMENTS = 2**26
"""Logit entries one chunk of the head computes at once: 256 MB in fp32, ~440 positions of a
151,936-entry vocabulary. With top-p, half as many: the nucleus' sort (values and int64 indices)
and the renormalised copy about double what a chunk holds at its peak."""

METHOD = "spotrl_token_logprobs"
"""The name under which :func:`attach` puts :func:`token_logprobs` on a model, so that FSDP2 runs
its hooks around it as around ``forward`` (the root unit holds the embeddings and the head)."""


@dataclass(frozen=True)
class TokenBatch:
    """A micro-batch on the device: the padded rows, and where each trained token is."""

    input_ids: torch.Tensor
    """[rows, width] right-padded prompt + completion ids."""
    attention: torch.Tensor
    """[rows, width] 1 on real tokens."""
    rows: torch.Tensor
    """[tokens] the row of each trained (completion) token."""
    positions: torch.Tensor
    """[tokens] the position whose hidden state predicts it (its own position minus one)."""
    targets: torch.Tensor
    """[tokens] the token ids."""
    position_ids: torch.Tensor | None = None
    """[rows, width] packed rows (``training.packing``): each sequence's positions from 0, so the
    model attends within each sequence alone; None: one sequence a row, right-padded."""

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention.sum())


def token_batch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    device: Any,
    packed: bool = False,
    observed: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> TokenBatch:
    """(prompt ids, completion ids) pairs as a :class:`TokenBatch` on ``device``: one a row,
    right-padded to the longest; or ``packed``, several a row where that computes fewer positions
    (:func:`~spotrl_runtime.training.rows.micro_batch_rows`), each with positions from 0 (the
    padding left at a row's end too). ``observed``: per sequence, the spans of its completion
    that are observations (:attr:`~spotrl_runtime.training.rows.Row.observed`): in the rows as
    context, not among the trained tokens."""
    lengths = [len(p) + len(c) for p, c in sequences]
    layout = micro_batch_rows(lengths, packed)
    packed = any(len(members) > 1 for members in layout)
    width = max(sum(lengths[i] for i in members) for members in layout)
    input_ids = torch.full((len(layout), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(layout), width), dtype=torch.long)
    position_ids = torch.zeros((len(layout), width), dtype=torch.long)
    at: dict[int, tuple[int, int]] = {}  # sequence -> (row, offset)
    for r, members in enumerate(layout):
        offset = 0
        for i in members:
            prompt, completion = sequences[i]
            input_ids[r, offset : offset + lengths[i]] = torch.tensor([*prompt, *completion], dtype=torch.long)
            attention[r, offset : offset + lengths[i]] = 1
            position_ids[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
            at[i] = (r, offset)
            offset += lengths[i]
        position_ids[r, offset:] = torch.arange(width - offset)
    rows: list[int] = []
    positions: list[int] = []
    for i, (prompt, completion) in enumerate(sequences):  # the trained tokens in the sequences' order
        r, offset = at[i]
        first = offset + len(prompt) - 1  # position t predicts token t + 1
        trained = generated_offsets(len(completion), observed[i] if observed is not None else ())
        rows += [r] * len(trained)
        positions += (first + k for k in trained)
    rows_t = torch.tensor(rows, dtype=torch.long)
    positions_t = torch.tensor(positions, dtype=torch.long)
    targets = input_ids[rows_t, positions_t + 1]
    return TokenBatch(
        input_ids.to(device),
        attention.to(device),
        rows_t.to(device),
        positions_t.to(device),
        targets.to(device),
        position_ids.to(device) if packed else None,
    )


def token_logprobs(
    model: Any, batch: TokenBatch, temperature: float, top_p: float = 1.0, float32_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [tokens] in fp32, entropies [tokens] in nats, no gradient) of ``batch``'s trained
    tokens under the sampling distribution: ``sampling_logprobs(logits, temperature, top_p)``,
    the tempered softmax restricted to its top-p nucleus and renormalised. A token outside the
    nucleus gets -inf. The entropy is that distribution's too (the nucleus', renormalised; the
    tempered softmax's at ``top_p == 1``): the entropy of what the policy samples. Differentiable
    in the log-probs when gradients are enabled. ``float32_head`` (``training.precision.lmHead:
    float32``): the head's matrix product in float32, outside autocast, from float32 weights
    (:func:`_head_logits`). Call it through :func:`call` (FSDP2 needs its hooks around it)."""
    decoder = model.get_decoder()
    if batch.position_ids is None:
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention, use_cache=False).last_hidden_state
    else:  # packed: no mask, so transformers takes the sequences apart by their positions
        hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).last_hidden_state
    picked = hidden[batch.rows, batch.positions]
    head = model.get_output_embeddings()
    elements = LOGITS_CHUNK_ELEMENTS if top_p >= 1 else LOGITS_CHUNK_ELEMENTS // 2
    chunk = max(1, elements // head.weight.shape[0])
    keep_graph = torch.is_grad_enabled() and picked.requires_grad
    logps, entropies = [], []
    for start in range(0, picked.shape[0], chunk):
        args = (
            head,
            picked[start : start + chunk],
            batch.targets[start : start + chunk],
            temperature,
            top_p,
            float32_head,
        )
        if keep_graph:
            logp, entropy = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            logp, entropy = _head_logprobs(*args)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty + hidden.sum() * 0.0, empty
    return torch.cat(logps), torch.cat(entropies)


def _head_logits(head: torch.nn.Module, hidden: torch.Tensor, float32_head: bool) -> torch.Tensor:
    """The head's logits: in the compute dtype (under autocast), or, with ``float32_head``, a
    float32 product of the float32 weights and the hidden states cast up. Its bias, where it has
    one, is added in float32 too."""
    if not float32_head:
        return head(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        weight: torch.Tensor = head.weight  # type: ignore[assignment]
        bias: torch.Tensor | None = getattr(head, "bias", None)
        return torch.nn.functional.linear(hidden.float(), weight.float(), bias.float() if bias is not None else None)


def _head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: float,
    float32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = sampling_logprobs(_head_logits(head, hidden, float32_head), temperature, top_p)
    with torch.no_grad():
        # Tokens outside the nucleus have p = 0: 0 * (a finite floor) adds nothing, 0 * -inf would be NaN.
        entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose logits are more than ``lm_head(hidden)`` (Gemma 2's soft-capping,
Cohere's and Granite's scales)."""


def packs_sequences(model: Any) -> bool:
    """Whether ``model`` attends within each sequence of a packed row (:func:`token_batch`): its
    decoder, a transformers model, builds its mask with transformers' ``create_causal_mask``,
    which takes the sequences apart by their position ids when no mask is given (SDPA and eager
    attention; flash-attention's varlen kernel takes them from the same position ids)."""
    import sys

    for cls in type(model.get_decoder()).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return "create_causal_mask" in vars(sys.modules[cls.__module__])
    return False


def check_plain_head(model: Any) -> None:
    """Raises ValueError, naming the field, for a model whose logits this path would get wrong."""
    config = getattr(model, "config", None)
    for name in HEAD_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"policy.model: {type(model).__name__} transforms its logits ({name}={value}), which SpotRL's "
                "trainer does not apply; train a model with a plain language-model head (Llama, Qwen, Mistral)"
            )


def attach(model: Any) -> Any:
    """Puts :func:`token_logprobs` on ``model`` as a method (:data:`METHOD`), once, after
    :func:`check_plain_head`; returns the model. FSDP2 then registers it as a forward method
    (:func:`spotrl_runtime.training.fsdp.shard_policy`)."""
    import types

    if not hasattr(model, METHOD):
        check_plain_head(model)
        setattr(model, METHOD, types.MethodType(token_logprobs, model))
    return model


def call(
    model: Any, batch: TokenBatch, temperature: float, top_p: float = 1.0, float32_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` through the model's own method (attached on first use)."""
    return getattr(attach(model), METHOD)(batch, temperature, top_p, float32_head)


def full_softmax_logprobs(model: Any, batch: TokenBatch, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The same log-probs the plain way: the model's whole ``[rows, seq, vocab]`` logits, the
    sampling distribution over all of them at once. Only for tests and benchmarks: it is what
    the chunked path must equal."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
    logp = sampling_logprobs(logits[batch.rows, batch.positions], temperature, top_p)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
