"""``builtin:random-100m``: a policy of about 100M parameters with random weights, for timing.

It learns nothing useful; benchmarks and the GPU check use it to measure generation and
training at a realistic size without a model hub. The tokenizer is the character tokenizer
padded to the model's vocabulary, so every sampled id decodes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from spotrl_runtime.models.cache import build_once, model_cache_dir, save_model_folder

BUILD_CODE_VERSION = 1


@dataclass(frozen=True)
class RandomPolicyShape:
    """A Llama shape; :meth:`num_parameters` counts what it will have."""

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 1792
    num_layers: int = 12
    num_heads: int = 12
    max_positions: int = 2048
    seed: int = 0

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return self.vocab_size * h + self.num_layers * per_layer + h  # tied embeddings, final norm

    def key(self) -> str:
        import hashlib

        blob = json.dumps({"shape": asdict(self), "code": BUILD_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


RANDOM_100M = RandomPolicyShape()


def random_policy_dir(shape: RandomPolicyShape = RANDOM_100M, cache_dir: Path | None = None) -> Path:
    """The local folder of a random-weight policy of ``shape``, built once and cached."""
    target = (cache_dir or model_cache_dir()) / f"random-{shape.key()}"
    return build_once(target, lambda tmp: _build(shape, tmp))


def _build(shape: RandomPolicyShape, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from spotrl_runtime.models.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(pad_to=shape.vocab_size)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_model_folder(model, tokenizer, out_dir)
    (out_dir / "spotrl-recipe.json").write_text(json.dumps({"name": "random", "shape": asdict(shape)}, indent=2))
