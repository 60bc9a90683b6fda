"""spec.dataset.promptFormat: raw prompts as the tokenizer encodes them, chat prompts through
the tokenizer's own chat template (a user message, a system prompt, or a row's own turns in the
HF messages convention), and the errors that name the field when the two do not fit."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.data import DatasetError, JsonlDataset, collate_for
from spotrl_runtime.generation.rollouts import PromptFormatError, encode_prompt, prompt_encoder

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A byte-level BPE tokenizer with ChatML's special tokens and template, as Qwen's."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(
        ["Natalia sold clips to 48 of her friends. How many?", "system user assistant"] * 20, trainer
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def _prompt(row: dict[str, Any], field: str = "question") -> Any:
    data = json.dumps({"task_name": "gsm8k", "answer": "72", **row}).encode()
    dataset = JsonlDataset.from_bytes(data, "rows.jsonl")
    return collate_for(DatasetSpec(uri="rows.jsonl", promptField=field))(dataset[0])


def _chat(tokenizer: Any, turns: list[dict[str, str]]) -> tuple[int, ...]:
    out = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return tuple(out["input_ids"] if hasattr(out, "keys") else out)


def test_raw_is_the_text_as_the_tokenizer_encodes_it(tokenizer: Any) -> None:
    p = _prompt({"question": "How many clips?"})
    assert encode_prompt(tokenizer, p) == tuple(tokenizer("How many clips?")["input_ids"])
    spec = DatasetSpec(uri="x.jsonl", promptField="question")
    assert prompt_encoder(tokenizer, spec)(p) == encode_prompt(tokenizer, p)


def test_chat_renders_the_user_message_through_the_template(tokenizer: Any) -> None:
    p = _prompt({"question": "How many clips?"})
    encode = prompt_encoder(tokenizer, DatasetSpec(uri="x.jsonl", promptField="question", promptFormat="chat"))
    assert encode(p) == _chat(tokenizer, [{"role": "user", "content": "How many clips?"}])
    assert tokenizer.decode(encode(p)).endswith("<|im_start|>assistant\n"), "the generation prompt is added"


def test_a_system_prompt_goes_first_unless_the_turns_have_one(tokenizer: Any) -> None:
    spec = DatasetSpec(uri="x.jsonl", promptField="messages", promptFormat="chat", systemPrompt="Answer after ####.")
    encode = prompt_encoder(tokenizer, spec)
    user = [{"role": "user", "content": "How many clips?"}]
    assert encode(_prompt({"messages": user}, "messages")) == _chat(
        tokenizer, [{"role": "system", "content": "Answer after ####."}, *user]
    )
    own = [{"role": "system", "content": "Be brief."}, *user]
    assert encode(_prompt({"messages": own}, "messages")) == _chat(tokenizer, own)


def test_a_rows_own_turns_in_the_messages_convention(tokenizer: Any) -> None:
    turns = [
        {"role": "user", "content": "What is 48 / 2?"},
        {"role": "assistant", "content": "24"},
        {"role": "user", "content": "And 48 + 24?"},
    ]
    p = _prompt({"messages": turns}, "messages")
    assert p.turns
    assert json.loads(p.text) == turns
    encode = prompt_encoder(tokenizer, DatasetSpec(uri="x.jsonl", promptField="messages", promptFormat="chat"))
    assert encode(p) == _chat(tokenizer, turns)
    assert p == _prompt({"messages": turns}, "messages"), "the same row rebuilds the same prompt (restore)"


def test_the_errors_name_the_field(tokenizer: Any) -> None:
    turns = _prompt({"messages": [{"role": "user", "content": "hi"}]}, "messages")
    with pytest.raises(PromptFormatError, match=r"set spec\.dataset\.promptFormat: chat"):
        encode_prompt(tokenizer, turns)
    base = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(PromptFormatError, match=r"promptFormat: chat, but the policy's tokenizer has no chat template"):
        prompt_encoder(base, DatasetSpec(uri="x.jsonl", promptFormat="chat"))
    with pytest.raises(DatasetError, match="is a list, but not of chat turns"):
        _prompt({"messages": ["hi", "there"]}, "messages")
