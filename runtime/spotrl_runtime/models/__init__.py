"""Policies: the built-in demo model, and loading any Hugging Face model folder or s3:// prefix."""

from spotrl_runtime.models.cache import model_cache_dir
from spotrl_runtime.models.char_tokenizer import build_char_tokenizer
from spotrl_runtime.models.loading import (
    PolicyError,
    PrefixDownloader,
    load_policy,
    load_tokenizer,
    resolve_model_dir,
    storage_downloader,
)
from spotrl_runtime.models.tiny_arith import DEFAULT_RECIPE, TinyArithRecipe, arithmetic_problems, tiny_arith_dir

__all__ = [
    "DEFAULT_RECIPE",
    "PolicyError",
    "PrefixDownloader",
    "TinyArithRecipe",
    "arithmetic_problems",
    "build_char_tokenizer",
    "load_policy",
    "load_tokenizer",
    "model_cache_dir",
    "resolve_model_dir",
    "storage_downloader",
    "tiny_arith_dir",
]
