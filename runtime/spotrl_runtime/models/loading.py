"""From ``spec.policy`` to a model and its tokenizer: built-in, local folder, or s3:// prefix.

``spec.policy.model`` may be:

- ``builtin:tiny-arith`` — the demo policy, built from code and cached (:mod:`.tiny_arith`);
- ``builtin:tiny-chat`` — the chat demo policy, a Qwen2-shaped instruct model (:mod:`.tiny_chat`);
- ``builtin:tiny-agent`` — tiny-chat's shape, pre-trained to call a calculator sometimes (:mod:`.tiny_agent`);
- ``builtin:random-100m`` — random weights of about 100M parameters, for timing (:mod:`.random_policy`);
- ``builtin:random-0.5b`` — random weights in Qwen2.5-0.5B's shape, for benchmarks (:mod:`.random_policy`);
- a local folder in Hugging Face format (``config.json``, weights, tokenizer files);
- a PEFT LoRA folder (``spotrl ckpt export`` of a LoRA run): its base with the adapter merged in;
- ``s3://bucket/prefix`` — such a folder in object storage, downloaded once into the cache;
- a model id, for users whose machines reach a model hub (transformers resolves it).

Workers that need a folder on disk (vLLM) call :func:`resolve_model_dir`; the trainer and the
transformers backend call :func:`load_policy`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from spotrl_runtime.models.cache import build_once, model_cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-arith", "tiny-chat", "tiny-agent", "random-100m", "random-0.5b")

PrefixDownloader = Callable[[str, Path], None]
"""Copies every object under a URI prefix into a local folder, keeping the relative keys."""


class PolicyError(ValueError):
    """``spec.policy`` names something that cannot be loaded; the message says what to change."""


class PolicyLike(Protocol):
    """What :func:`load_policy` reads from ``spec.policy`` (the RLJob ``Policy`` model fits)."""

    @property
    def model(self) -> str: ...

    @property
    def dtype(self) -> str: ...


def storage_downloader(uri: str, dest: Path) -> None:
    """The default :data:`PrefixDownloader`: reads through :func:`spotrl_runtime.storage.open_storage`
    (S3 settings from the environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)."""
    from spotrl_runtime.storage import download_prefix, open_storage

    if download_prefix(open_storage(uri), dest) == 0:
        raise PolicyError(f"policy.model: {uri!r} holds no objects; upload the model folder there first")


def resolve_model_dir(model: str, *, downloader: PrefixDownloader | None = None) -> Path | str:
    """The local folder holding ``model`` (building or downloading it into the cache if needed).

    Returns the string unchanged for a model id that is neither built in, nor a folder, nor an
    s3:// URI: only transformers (with a hub) can resolve it.
    """
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX) :]
        if name == "tiny-arith":
            from spotrl_runtime.models.tiny_arith import tiny_arith_dir

            return tiny_arith_dir()
        if name == "tiny-chat":
            from spotrl_runtime.models.tiny_chat import tiny_chat_dir

            return tiny_chat_dir()
        if name == "tiny-agent":
            from spotrl_runtime.models.tiny_agent import tiny_agent_dir

            return tiny_agent_dir()
        if name in ("random-100m", "random-0.5b"):
            from spotrl_runtime.models.random_policy import RANDOM_0_5B, RANDOM_100M, random_policy_dir

            return random_policy_dir(RANDOM_100M if name == "random-100m" else RANDOM_0_5B)
        raise PolicyError(
            f"policy.model: unknown built-in model {model!r}; the built-in models are "
            + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        )
    if model.startswith("s3://"):
        digest = hashlib.sha256(model.rstrip("/").encode()).hexdigest()[:16]
        target = model_cache_dir() / "s3" / digest
        fetch = downloader or storage_downloader
        return build_once(target, lambda tmp: fetch(model.rstrip("/"), tmp))
    path = Path(model).expanduser()
    if path.exists():
        from spotrl_runtime.models import lora

        if lora.is_adapter_folder(path):
            return lora.merged_dir(path)
        if not (path / "config.json").is_file():
            raise PolicyError(
                f"policy.model: {str(path)!r} has no config.json; point it at a Hugging Face model folder "
                "(config.json, weights, tokenizer files)"
            )
        return path
    if model.startswith(("/", "./", "../", "~")) or "://" in model:
        raise PolicyError(
            f"policy.model: {model!r} does not exist; give an existing folder, an s3:// URI or builtin:<name>"
        )
    return model


def load_policy(
    policy: PolicyLike | str,
    device: str | torch.device = "cpu",
    *,
    dtype: str | None = None,
    downloader: PrefixDownloader | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads ``spec.policy`` as (causal LM on ``device``, tokenizer). Nothing is trained here.

    ``policy`` is the RLJob ``Policy`` (``model`` and ``dtype``) or just the model string
    (float32). The tokenizer gets a pad token (its eos) if it has none, since batching needs one.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_ref = policy if isinstance(policy, str) else policy.model
    dtype_name = dtype or ("float32" if isinstance(policy, str) else policy.dtype)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name)
    if torch_dtype is None:
        raise PolicyError(f"policy.dtype: {dtype_name!r} is not one of float32, bfloat16, float16")
    where = resolve_model_dir(model_ref, downloader=downloader)
    tokenizer = load_tokenizer(model_ref, where)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype)
    except OSError as err:
        raise _unloadable(model_ref, err) from err
    cast(Any, model).to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(model_ref: str, where: Path | str | None = None) -> PreTrainedTokenizerBase:
    """The policy's tokenizer alone (a controller whose ranks hold the model loads no weights);
    it gets a pad token (its eos) if it has none, since batching needs one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where if where is not None else resolve_model_dir(model_ref))
    except OSError as err:
        raise _unloadable(model_ref, err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def max_positions(model_ref: str) -> int | None:
    """The policy's context as its config states it (``max_position_embeddings``, or GPT-2's
    ``n_positions``; a multimodal model's text config), or None where it states none or cannot be
    read (the prompt filter then filters nothing for length; vLLM reads the same key)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_dir(model_ref))
    except (OSError, ValueError, PolicyError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _unloadable(model_ref: str, err: Exception) -> PolicyError:
    return PolicyError(
        f"policy.model: cannot load {model_ref!r} ({err}); give a local folder, an s3:// URI or builtin:<name> "
        "(no model hub is reached at run time)"
    )
