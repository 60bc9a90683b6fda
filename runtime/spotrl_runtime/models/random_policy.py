"""Policies with random weights, for timing: ``builtin:random-100m`` (a Llama of about 100M
parameters) and ``builtin:random-0.5b`` (Qwen2ForCausalLM in Qwen2.5-0.5B's shape: 151,936-entry
vocabulary, 24 layers, grouped-query attention, tied embeddings), plus :data:`RANDOM_1_5B`
(Qwen2.5-1.5B's shape) for the GPU check.

They learn nothing useful; benchmarks and the GPU check use them to measure generation and
training at the users' shapes without a model hub. The tokenizer is the character tokenizer
padded to the model's vocabulary, so every sampled id decodes. The Qwen shapes are saved in
bfloat16, as Qwen's own checkpoints are.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from spotrl_runtime.models.cache import build_once, model_cache_dir, save_model_folder

BUILD_CODE_VERSION = 1


@dataclass(frozen=True)
class RandomPolicyShape:
    """A Llama or Qwen2 shape (tied embeddings); :meth:`num_parameters` counts what it will have."""

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 1792
    num_layers: int = 12
    num_heads: int = 12
    max_positions: int = 2048
    seed: int = 0
    architecture: str = "llama"
    """``llama`` (LlamaForCausalLM) or ``qwen2`` (Qwen2ForCausalLM: biases on q, k and v)."""
    num_kv_heads: int | None = None
    """Grouped-query attention's key/value heads (None: one per head)."""

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        kv = h // self.num_heads * (self.num_kv_heads or self.num_heads)
        bias = h + 2 * kv if self.architecture == "qwen2" else 0
        per_layer = 2 * h * h + 2 * h * kv + bias + 3 * h * i + 2 * h
        return self.vocab_size * h + self.num_layers * per_layer + h  # tied embeddings, final norm

    def key(self) -> str:
        import hashlib

        shape = asdict(self)
        if self.architecture == "llama" and self.num_kv_heads is None:  # the key it had before Qwen shapes
            del shape["architecture"], shape["num_kv_heads"]
        blob = json.dumps({"shape": shape, "code": BUILD_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


RANDOM_100M = RandomPolicyShape()
RANDOM_0_5B = RandomPolicyShape(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    max_positions=32768,
    architecture="qwen2",
)
"""Qwen2.5-0.5B's shape: 494M parameters."""
RANDOM_1_5B = RandomPolicyShape(
    vocab_size=151_936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    max_positions=32768,
    architecture="qwen2",
)
"""Qwen2.5-1.5B's shape: 1.54B parameters."""


def random_policy_dir(shape: RandomPolicyShape = RANDOM_100M, cache_dir: Path | None = None) -> Path:
    """The local folder of a random-weight policy of ``shape``, built once and cached."""
    target = (cache_dir or model_cache_dir()) / f"random-{shape.key()}"
    return build_once(target, lambda tmp: _build(shape, tmp))


def _build(shape: RandomPolicyShape, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from spotrl_runtime.models.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(pad_to=shape.vocab_size)
    qwen = shape.architecture == "qwen2"
    common: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads or shape.num_heads,
        "max_position_embeddings": shape.max_positions,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": True,
    }
    model: Any
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        if qwen:
            rope = {"rope_type": "default", "rope_theta": 1_000_000.0}  # Qwen2.5's
            model = cast(Any, Qwen2ForCausalLM(Qwen2Config(**common, rope_parameters=rope))).to(torch.bfloat16)
        else:
            model = LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_model_folder(model, tokenizer, out_dir)
    (out_dir / "spotrl-recipe.json").write_text(json.dumps({"name": "random", "shape": asdict(shape)}, indent=2))
