"""LoRA adapters on a frozen base (``policy.lora``), through peft.

The adapter is injected into the transformers model in place (``model.add_adapter``, peft's
LoRA layers around the targeted ``nn.Linear`` modules), so the model keeps its class, its FSDP
blocks and its decoder/head methods; its trainable parameters are the adapter's alone, named
``<module>.lora_A.default.weight`` and ``<module>.lora_B.default.weight``. The base stays in
``policy.dtype`` and frozen; the adapter is float32 (the trainer's masters).

What leaves the trainer is the adapter alone (:func:`adapter_tensors`): cuts, the weight
channel, exports. A cut records the adapter's :class:`AdapterIdentity` (the base's digest, the
rank, alpha and targets) so that a resume onto anything else is refused by name
(``policy_identity`` in :mod:`~spotrl_runtime.core.validation`). :func:`write_peft_folder`
writes the PEFT folder vLLM hot-loads and ``ckpt export`` hands to users.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrl_runtime.models.loading import PolicyError

if TYPE_CHECKING:
    import torch

ADAPTER_NAME = "default"
"""peft's adapter name inside the trainer's and the transformers workers' models."""

DIGEST_BLOCK = 64 << 10
DIGEST_STRIDE = 64 << 20
""":func:`base_digest` reads a 64 KiB block every 64 MiB of each weight file (and all of every
small file): every tensor of a fine-tune differs from its base's, so different bases differ
there, while an 8B base costs ~250 reads instead of 16 GB hashed at every start."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
IDENTITY_FILES = ("config.json",)


@dataclass(frozen=True)
class AdapterIdentity:
    """What an adapter only fits: the base it was trained on, and its shape."""

    base: str
    """:func:`base_digest` of the base model's folder."""
    rank: int
    alpha: float
    targets: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets)}


def linear_layer_names(model: Any) -> set[str]:
    """The last names of ``model``'s ``nn.Linear`` modules, its language-model head left out
    (an adapter there would be a second vocabulary-sized matrix, and vLLM serves none)."""
    import torch

    head = model.get_output_embeddings()
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name
    }


def target_modules(model: Any, wanted: list[str] | None) -> tuple[str, ...]:
    """``policy.lora.targetModules`` checked against ``model`` (unset: every linear layer but
    the head), sorted. Raises :class:`PolicyError` naming the field for a name the model lacks."""
    have = linear_layer_names(model)
    if not have:
        raise PolicyError(f"policy.lora: {type(model).__name__} has no linear layers to put an adapter on")
    if wanted is None:
        return tuple(sorted(have))
    unknown = sorted(set(wanted) - have)
    if unknown:
        raise PolicyError(
            f"policy.lora.targetModules: {', '.join(unknown)} is not a linear layer of {type(model).__name__}; "
            f"its linear layers are {', '.join(sorted(have))} (leave targetModules unset for all of them)"
        )
    return tuple(sorted(set(wanted)))


def add_adapter(model: Any, lora: Any, *, base: str, seed: int = 0, master: bool = True) -> AdapterIdentity:
    """Injects ``lora`` (the RLJob ``Lora``) into ``model`` in place: the base frozen as it is,
    the adapter float32 (``master``; a generation worker's stays in the base's dtype, as vLLM
    serves it), its A matrices drawn from ``seed`` (so two runs of one spec start from the same
    adapter; B starts at zero, so the policy starts as the base). Returns its identity."""
    import torch
    from peft import LoraConfig

    targets = target_modules(model, lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.scale_alpha,
        lora_dropout=lora.dropout,
        target_modules=list(targets),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config, adapter_name=ADAPTER_NAME)
    for p in model.parameters():
        if p.requires_grad and master:
            p.data = p.data.float()
        elif p.requires_grad:
            p.requires_grad_(False)
    return AdapterIdentity(base, lora.rank, float(lora.scale_alpha), targets)


def has_adapter(model: Any) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def is_adapter_tensor(name: str) -> bool:
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name


def adapter_tensors(model: Any, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's parameters by name (``keep_vars``: the parameters themselves, else detached)."""
    return {n: (p if keep_vars else p.detach()) for n, p in model.named_parameters() if is_adapter_tensor(n)}


def base_digest(model_dir: Path | str) -> str:
    """The identity of a base model's folder: sha256 over each weight and config file's relative
    path, size and sampled contents (see :data:`DIGEST_STRIDE`)."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in IDENTITY_FILES)
    )
    if not files:
        raise PolicyError(f"policy.model: {str(root)!r} holds no weight files to identify the base by")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            for offset in range(0, size, DIGEST_STRIDE):
                f.seek(offset)
                digest.update(f.read(DIGEST_BLOCK))
    return digest.hexdigest()


def modules_of(tensors: Mapping[str, Any]) -> tuple[str, ...]:
    """The target modules (last names) an adapter's tensors sit on, sorted."""
    return tuple(sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors if is_adapter_tensor(n)}))


def peft_key(name: str) -> str:
    """A trainer parameter's name as a PEFT adapter file keys it (peft's ``base_model.model.``
    prefix, no adapter name): what vLLM and ``PeftModel.from_pretrained`` read."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def peft_config(identity: AdapterIdentity, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA folder (dropout 0: it is for serving)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": identity.rank,
        "lora_alpha": identity.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(identity.targets),
        "bias": "none",
        "inference_mode": True,
    }


def write_peft_folder(
    tensors: Mapping[str, torch.Tensor], identity: AdapterIdentity, base_model: str, dest: Path, dtype: Any = None
) -> Path:
    """Writes ``tensors`` (trainer names) as a PEFT LoRA folder at ``dest``: adapter_config.json and
    adapter_model.safetensors, cast to ``dtype`` when given. Returns ``dest``."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    state = {peft_key(n): (t.to(dtype) if dtype is not None else t).contiguous().cpu() for n, t in tensors.items()}
    save_file(state, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps(peft_config(identity, base_model), indent=2) + "\n")
    return dest


@contextlib.contextmanager
def base_only(model: Any) -> Iterator[None]:
    """The base alone for the duration (the adapter switched off): the KL term's reference."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def trainer_load_dtype(policy: Any) -> str:
    """The dtype the trainer loads ``spec.policy`` in: float32 masters for full fine-tuning; the
    base in ``policy.dtype`` with LoRA (frozen, it needs no master copy)."""
    return "float32" if policy.lora is None else str(policy.dtype)


def load_trainable(
    policy: Any, device: Any, *, seed: int = 0, loaded: tuple[Any, Any] | None = None
) -> tuple[Any, Any, AdapterIdentity | None]:
    """(model, tokenizer, adapter identity) as the trainer holds ``spec.policy``: loaded here (or
    ``loaded``, from :func:`trainer_load_dtype`), with the adapter of ``policy.lora`` if set."""
    from spotrl_runtime.models.loading import load_policy, resolve_model_dir

    model, tokenizer = loaded or load_policy(policy, device, dtype=trainer_load_dtype(policy))
    if policy.lora is None:
        return model, tokenizer, None
    identity = add_adapter(model, policy.lora, base=base_digest(resolve_model_dir(policy.model)), seed=seed)
    return model, tokenizer, identity


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(path: Path) -> bool:
    """A PEFT LoRA folder (``ckpt export`` of a LoRA run): an adapter config and no model config."""
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_base(path: Path) -> str:
    """The base an adapter folder names (``base_model_name_or_path``: builtin:<name>, a folder, an s3:// URI)."""
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise PolicyError(f"policy.model: {str(path)!r} is an adapter whose {ADAPTER_CONFIG} names no base model")
    return base


def merged(adapter_dir: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer): the base ``adapter_dir`` names with the adapter merged into its weights,
    in ``dtype``: an ordinary model, for ``--merge`` exports and for scoring an adapter."""
    import torch
    from peft import PeftModel

    from spotrl_runtime.models.loading import load_policy

    base, tokenizer = load_policy(adapter_base(adapter_dir), "cpu", dtype="float32")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return model.to(getattr(torch, dtype)), tokenizer


def merged_dir(adapter_dir: Path) -> Path:
    """A cached folder of :func:`merged` (float32), keyed by the adapter's files and its base:
    what ``policy.model`` (``spotrl eval --model``) resolves an adapter folder to."""
    from spotrl_runtime.models.cache import build_once, model_cache_dir

    digest = hashlib.sha256(adapter_base(adapter_dir).encode())
    for path in sorted(p for p in adapter_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())

    def build(tmp: Path) -> None:
        model, tokenizer = merged(adapter_dir)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_once(model_cache_dir() / "merged" / digest.hexdigest()[:16], build)
