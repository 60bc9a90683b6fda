"""``builtin:tiny-chat``: a chat policy shaped like a Qwen2.5-Instruct checkpoint, built from code.

What a Qwen user's run goes through, at a size that trains in seconds on a CPU:

- transformers' own ``Qwen2ForCausalLM`` (grouped-query attention, q/k/v biases, tied embeddings);
- a byte-level BPE tokenizer trained with ``tokenizers`` on its corpus, digits split one per
  token as Qwen's are;
- ChatML special tokens and chat template, ``<|im_end|>`` as the tokenizer's EOS and
  ``<|endoftext|>`` as its pad token, as a Qwen instruct checkpoint sets them, and a
  ``generation_config.json`` that stops on either;
- pre-trained (supervised, on the assistant turn only) on generated word problems in GSM8K's
  format (:mod:`spotrl_runtime.data.word_problems`), with and without the example's system prompt.

Pre-training leaves a flaw on purpose, as tiny-arith's does: about half of its targets end
``The answer is 7.`` instead of ``#### 7``. The model then answers in GSM8K's shape but often
without the marker, and sometimes wrongly; the strict ``gsm8k`` reward scores it well below
what it knows, and RL has one clear habit to unlearn within a few dozen steps.

The built model is an ordinary Hugging Face folder, cached like tiny-arith under a name hashed
from its recipe; vLLM and the transformers backend load it alike.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spotrl_runtime.models.cache import build_once, model_cache_dir, save_model_folder
from spotrl_runtime.models.pretrain import build_seeded, cosine_lr, supervised_step, write_recipe

NAME = "tiny-chat"
# Bump when the build code changes in a way the recipe fields do not capture.
BUILD_CODE_VERSION = 2
BUILD_THREADS = 2
"""Pre-training's thread count: fixed (so the build is the same on every machine), and two
(the smallest machine we support has two cores, and one thread would leave one of them idle)."""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML: each turn ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt opens
the assistant's turn. (Qwen's own template adds a default system turn; this one adds none.)"""


@dataclass(frozen=True)
class TinyChatRecipe:
    """Everything that determines the built weights; its hash names the cache folder."""

    vocab_size: int = 640
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    """Head size 32: a size every attention kernel (vLLM's included) supports."""
    num_kv_heads: int = 2
    max_positions: int = 256
    corpus_seed: int = 7
    corpus_rows: int = 4000
    pretrain_steps: int = 400
    batch_size: int = 64
    learning_rate: float = 3e-3
    unmarked: float = 0.5
    """Fraction of pre-training answers that end ``The answer is N.`` instead of ``#### N``."""
    with_system: float = 0.5
    """Fraction of pre-training prompts that carry the example's system turn."""
    seed: int = 1234

    def key(self) -> str:
        blob = json.dumps({"recipe": asdict(self), "code": BUILD_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_RECIPE = TinyChatRecipe()


def tiny_chat_dir(recipe: TinyChatRecipe = DEFAULT_RECIPE, cache_dir: Path | None = None) -> Path:
    """The local folder of the built model, building and caching it first if needed."""
    target = (cache_dir or model_cache_dir()) / f"{NAME}-{recipe.key()}"
    return build_once(target, lambda tmp: _build(recipe, tmp))


def chat_turns(question: str, system: bool) -> list[dict[str, str]]:
    from spotrl_runtime.data.word_problems import SYSTEM_PROMPT

    turns = [{"role": "user", "content": question}]
    return [{"role": "system", "content": SYSTEM_PROMPT}, *turns] if system else turns


def target_text(solution: str, answer: str, marked: bool) -> str:
    """The assistant's turn pre-training teaches: the worked solution, ending ``#### N`` when
    ``marked``, else ``The answer is N.`` (the habit RL is meant to remove)."""
    work = solution.rsplit("\n####", 1)[0]
    return f"{work}\n#### {answer}" if marked else f"{work}\nThe answer is {answer}."


def build_bpe_tokenizer(
    texts: list[str], vocab_size: int, added: tuple[str, ...] = (), template: str = CHAT_TEMPLATE
) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ChatML's special tokens, Qwen's
    EOS and pad tokens, ``added`` as whole tokens that are not special (Qwen's tool-call
    markers are such), and ``template`` as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # Digits one per token (numbers compose from them, as in Qwen's tokenizer), then bytes.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
    )
    if added:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.chat_template = template
    return tokenizer


def _corpus(recipe: TinyChatRecipe, rng: Any) -> list[tuple[list[dict[str, str]], str]]:
    """(chat turns, assistant text) pairs: the pre-training corpus."""
    from spotrl_runtime.data.word_problems import word_problem

    pairs = []
    for i in range(recipe.corpus_rows):
        row = word_problem(recipe.corpus_seed, i)
        turns = chat_turns(row["question"], rng.random() < recipe.with_system)
        pairs.append((turns, target_text(row["solution"], row["answer"], rng.random() >= recipe.unmarked)))
    return pairs


def _build(recipe: TinyChatRecipe, out_dir: Path) -> None:
    import random

    build_chat_model(recipe, out_dir, NAME, _corpus(recipe, random.Random(recipe.seed)))


def build_chat_model(
    recipe: TinyChatRecipe,
    out_dir: Path,
    name: str,
    corpus: list[tuple[list[dict[str, str]], str]],
    added: tuple[str, ...] = (),
    template: str = CHAT_TEMPLATE,
) -> None:
    """A Qwen2-shaped chat model pre-trained on ``corpus`` ((chat turns, the assistant's reply)
    pairs), its tokenizer trained on the corpus with ``added`` tokens and ``template``, saved
    in ``out_dir`` with its recipe file."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    started = time.monotonic()
    texts = [
        "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in turns) + f"{IM_START}assistant\n{reply}"
        for turns, reply in corpus
    ]
    # Train the BPE on the text between the special tokens (they are added whole).
    plain = [t.replace(IM_START, "\n").replace(IM_END, "\n") for t in texts]
    tokenizer = build_bpe_tokenizer(plain, recipe.vocab_size, added, template)
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        max_window_layers=recipe.num_layers,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    model = build_seeded(
        Qwen2ForCausalLM,
        config,
        recipe.seed,
        BUILD_THREADS,
        lambda m, generator: _pretrain(m, tokenizer, corpus, recipe, generator),
    )
    # As a Qwen instruct checkpoint: stop on <|im_end|> or <|endoftext|>, pad with <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True, temperature=0.7, top_p=0.8
    )
    save_model_folder(model, tokenizer, out_dir)
    write_recipe(out_dir, name, recipe, BUILD_CODE_VERSION, started)


def _pretrain(model: Any, tokenizer: Any, corpus: list[Any], recipe: TinyChatRecipe, generator: Any) -> None:
    """Supervised training on the assistant's turn (its text and the closing ``<|im_end|>``)."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    prompts = [_ids(tokenizer.apply_chat_template(turns, add_generation_prompt=True)) for turns, _ in corpus]
    replies = [tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos] for _, reply in corpus]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    model.train()
    for step in range(recipe.pretrain_steps):
        rows = torch.randint(len(corpus), (recipe.batch_size,), generator=generator).tolist()
        lr = cosine_lr(recipe.learning_rate, step, recipe.pretrain_steps)
        supervised_step(model, optimizer, [(prompts[r], replies[r]) for r in rows], tokenizer.pad_token_id, lr)


def _ids(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids, whichever shape this transformers returns."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
