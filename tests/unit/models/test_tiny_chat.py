"""``builtin:tiny-chat``: a folder shaped like a Qwen2.5-Instruct checkpoint (architecture,
byte-level BPE, ChatML template, EOS, pad and generation config), and a pre-trained policy
that answers word problems in GSM8K's shape with the flaw RL is meant to remove."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data.word_problems import SYSTEM_PROMPT, split_rows
from spotrl_runtime.generation.rollouts import prompt_encoder
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.generation.types import GenerationRequest
from spotrl_runtime.models import load_policy, resolve_model_dir
from spotrl_runtime.models.tiny_chat import (
    DEFAULT_RECIPE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_bpe_tokenizer,
    target_text,
    tiny_chat_dir,
)
from spotrl_runtime.rewards.builtin import gsm8k, gsm8k_flexible

QUICK = dataclasses.replace(DEFAULT_RECIPE, corpus_rows=60, pretrain_steps=2, batch_size=4)


@pytest.fixture(scope="module")
def small_tokenizer() -> Any:
    return build_bpe_tokenizer(["Ava has 3 apples. How many apples does Ava have now?"] * 10, 300)


def test_the_chat_template_is_chatml_with_the_generation_prompt(small_tokenizer: Any) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"}]
    text = small_tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert text == (f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHow many?{IM_END}\n{IM_START}assistant\n")
    ids = small_tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    specials = {small_tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END)}
    assert sum(i in specials for i in ids) == 5, "each special token is one id, never split into bytes"


def test_eos_pad_digits_and_bytes_as_qwen_has_them(small_tokenizer: Any) -> None:
    assert small_tokenizer.eos_token == IM_END
    assert small_tokenizer.pad_token == ENDOFTEXT
    assert small_tokenizer.bos_token is None
    digits = small_tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5, "one token per digit"
    text = "Zoë owes €1,234 — naïve café 😀"
    ids = small_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert small_tokenizer.decode(ids) == text, "byte-level: any text round-trips"


def test_a_quick_recipe_builds_a_qwen2_folder_that_auto_classes_load(tmp_path: Path) -> None:
    folder = tiny_chat_dir(QUICK, cache_dir=tmp_path)
    assert folder.name == f"tiny-chat-{QUICK.key()}"
    assert QUICK.key() != DEFAULT_RECIPE.key()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(folder).chat_template
    recipe = json.loads((folder / "spotrl-recipe.json").read_text())
    assert recipe["recipe"]["pretrain_steps"] == 2


@pytest.fixture(scope="module")
def built() -> Path:
    folder = resolve_model_dir("builtin:tiny-chat")
    assert isinstance(folder, Path)
    assert folder == tiny_chat_dir()
    return folder


def test_the_built_folder_is_shaped_as_a_qwen_instruct_checkpoint(built: Path) -> None:
    config = AutoConfig.from_pretrained(built)
    assert config.model_type == "qwen2"
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads, "grouped-query attention"
    assert config.hidden_size // config.num_attention_heads == 32
    assert config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(built)
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)
    assert (tok.eos_token_id, tok.pad_token_id) == (eos, pad)
    gen = json.loads((built / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == sorted([eos, pad])
    assert gen["pad_token_id"] == pad
    model, _ = load_policy("builtin:tiny-chat")
    assert TransformersBackend(model, tok).eos_ids == {eos, pad}, "generation stops on either"


def test_prompts_are_encoded_through_its_template(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built)
    spec = DatasetSpec(uri="x.parquet", promptField="question", promptFormat="chat", systemPrompt=SYSTEM_PROMPT)
    prompt = Prompt(idx=0, task_name="add", text="Ava has 3 apples.", answer="3")
    ids = prompt_encoder(tok, spec)(prompt)
    turns = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt.text}]
    assert tok.decode(ids) == tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


def test_pre_training_left_the_answer_shape_and_the_flaw(built: Path) -> None:
    """Sampled answers to held-out questions: GSM8K's shape nearly always, the ``####`` marker in some
    and ``The answer is N.`` in others; the strict reward scores below the flexible one."""
    model, tok = load_policy("builtin:tiny-chat")
    spec = DatasetSpec(uri="x.parquet", promptField="question", promptFormat="chat", systemPrompt=SYSTEM_PROMPT)
    encode = prompt_encoder(tok, spec)
    rows = split_rows("test")[:24]
    prompts = [Prompt(idx=r["idx"], task_name=r["task_name"], text=r["question"], answer=r["answer"]) for r in rows]
    requests = [GenerationRequest(f"g{p.idx}", tuple(encode(p)), n=8, max_new_tokens=32, seed=p.idx) for p in prompts]
    shape = re.compile(r"[A-Z][a-z]+ (has|buys) \d+ [-+*] \d+ = \d+ [a-z]+( left)?\.\n(#### \d+|The answer is \d+\.)")
    strict = flexible = marked = shaped = total = 0
    for p, group in zip(prompts, TransformersBackend(model, tok).generate(requests), strict=True):
        for s in group.samples:
            total += 1
            marked += "####" in s.text
            strict += int(gsm8k(p, s.text))
            flexible += int(gsm8k_flexible(p, s.text))
            shaped += bool(shape.fullmatch(s.text))
    assert shaped / total > 0.7, f"{shaped}/{total} in GSM8K's shape (temperature 1 strays now and then)"
    assert 0.2 < marked / total < 0.8, f"{marked}/{total} marked: the flaw RL has to remove"
    assert 0.03 < strict / total < flexible / total, (strict, flexible, total)


def test_target_text_marks_or_does_not() -> None:
    assert target_text("Ava has 3 + 4 = 7 pens.\n#### 7", "7", True) == "Ava has 3 + 4 = 7 pens.\n#### 7"
    assert target_text("Ava has 3 + 4 = 7 pens.\n#### 7", "7", False) == "Ava has 3 + 4 = 7 pens.\nThe answer is 7."
