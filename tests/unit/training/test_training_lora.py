"""The trainer with a LoRA adapter (policy.lora): only the adapter trains, in float32, on a base
frozen in its dtype; the KL reference is the base; what leaves the trainer is the adapter alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from training_helpers import small_llama

from spotrl_runtime.api.rljob import Lora
from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.models import lora
from spotrl_runtime.models.loading import PolicyError
from spotrl_runtime.training.trainer import Trainer, TrainerConfig

LINEAR = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def lora_trainer(
    spec: Lora | None = None, *, dtype: torch.dtype = torch.float32, **config: object
) -> tuple[Trainer, torch.nn.Module]:
    """A trainer of an adapter on small_llama in ``dtype``; also a pristine copy of the base."""
    model = small_llama().to(dtype)
    base = copy.deepcopy(model)
    identity = lora.add_adapter(model, spec or Lora(rank=4), base="b" * 64, seed=1)
    compute = "bfloat16" if dtype == torch.bfloat16 else "float32"
    settings = {"learning_rate": 1e-2, "compute_dtype": compute, **config}
    return Trainer(model, TrainerConfig(**settings), adapter=identity), base  # type: ignore[arg-type]


def frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not lora.is_adapter_tensor(n)}


def test_the_default_targets_are_every_linear_layer_but_the_head() -> None:
    trainer, _ = lora_trainer()
    assert trainer.adapter is not None
    assert trainer.adapter.targets == LINEAR
    names = set(trainer.trained_state())
    assert len(names) == 2 * len(LINEAR) * 2  # A and B, per layer kind, per block
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert not any("lm_head" in n or "embed_tokens" in n for n in names)


def test_a_module_the_model_lacks_is_refused_naming_the_field_and_the_ones_it_has() -> None:
    with pytest.raises(PolicyError, match=r"policy\.lora\.targetModules: c_attn is not a linear layer.*q_proj"):
        lora.add_adapter(small_llama(), Lora(target_modules=["q_proj", "c_attn"]), base="")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_adapter_trains_in_float32_and_the_base_stays_bit_for_bit(
    groups: list[FinishedGroup], dtype: torch.dtype
) -> None:
    trainer, _ = lora_trainer(dtype=dtype)
    before_base, before_adapter = frozen(trainer.model), copy.deepcopy(trainer.trained_state())
    assert {p.dtype for p in trainer.trained_state().values()} == {torch.float32}
    assert {p.dtype for p in before_base.values()} == {dtype}, "the base is held in policy.dtype"
    for _ in range(3):
        trainer.train_step(groups)
    for name, value in frozen(trainer.model).items():
        assert torch.equal(value, before_base[name]), f"{name} of the frozen base moved"
    moved = [n for n, v in trainer.trained_state().items() if not torch.equal(v, before_adapter[n])]
    assert any(".lora_B." in n for n in moved), "the adapter learned"
    opt_tensors = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim]
    assert opt_tensors
    assert {t.dtype for t in opt_tensors} == {torch.float32}
    assert sum(t.numel() for t in opt_tensors) == 2 * sum(v.numel() for v in before_adapter.values())


def test_the_policy_starts_as_the_base_and_the_kl_reference_is_the_base_without_a_copy(
    groups: list[FinishedGroup],
) -> None:
    trainer, base = lora_trainer(kl_coef=0.5)
    assert trainer.reference is None, "no second copy of the model"
    ids = torch.tensor([[1, 5, 7, 9, 4]])
    with torch.no_grad():
        assert torch.equal(trainer.model(ids).logits, base(ids).logits), "B starts at zero"
    first = trainer.train_step(groups)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    later = [trainer.train_step(groups) for _ in range(3)][-1]
    assert later["kl"] > 1e-4
    with torch.no_grad():
        assert not torch.equal(trainer.model(ids).logits, base(ids).logits)
        with lora.base_only(trainer.model):
            assert torch.equal(trainer.model(ids).logits, base(ids).logits), "the reference is the base itself"


def test_two_trainers_of_one_spec_start_from_the_same_adapter() -> None:
    one, _ = lora_trainer()
    two, _ = lora_trainer()
    for name, value in one.trained_state().items():
        assert torch.equal(value, two.trained_state()[name])


def test_the_state_holds_the_adapter_alone_and_resumes_exactly(groups: list[FinishedGroup]) -> None:
    trainer, _ = lora_trainer(kl_coef=0.1, micro_batch_size=3)
    trainer.train_step(groups)
    saved = copy.deepcopy(trainer.state_dict())
    assert set(saved["model"]) == set(trainer.trained_state())
    expected = trainer.train_step(groups)

    resumed, _ = lora_trainer(kl_coef=0.1, micro_batch_size=3)
    resumed.load_state_dict(saved)
    again = resumed.train_step(groups)
    assert again["loss"] == expected["loss"]
    for name, value in trainer.trained_state().items():
        assert torch.equal(value, resumed.trained_state()[name])


def test_a_state_of_another_rank_does_not_load(groups: list[FinishedGroup]) -> None:
    trainer, _ = lora_trainer(Lora(rank=4))
    other, _ = lora_trainer(Lora(rank=8))
    with pytest.raises(RuntimeError, match="size"):
        other.load_trained_state(trainer.trained_state())
    fewer, _ = lora_trainer(Lora(rank=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="does not fit: missing"):
        trainer.load_trained_state(fewer.trained_state())


def test_a_cut_of_the_trainer_holds_the_adapter_and_its_identity() -> None:
    trainer, _ = lora_trainer()
    trainer.cut_copy = "locked"  # a copy made there and then, which shows what a cut holds
    snap = trainer.snapshot({"model": "m"})
    assert set(snap.weights) == set(trainer.trained_state())
    assert snap.meta["adapter"] == {"base": "b" * 64, "rank": 4, "alpha": 8.0, "targets": list(LINEAR)}


def test_a_model_with_an_adapter_needs_its_identity_and_only_such_a_model() -> None:
    model = small_llama()
    with pytest.raises(ValueError, match="identity"):
        Trainer(small_llama(), TrainerConfig(), adapter=lora.AdapterIdentity("b", 4, 8.0, ("q_proj",)))
    lora.add_adapter(model, Lora(rank=4), base="")
    with pytest.raises(ValueError, match="identity"):
        Trainer(model, TrainerConfig())


def test_the_peft_folder_loads_into_peft_and_gives_the_trainers_logits(
    groups: list[FinishedGroup], tmp_path: Path
) -> None:
    from peft import PeftModel

    trainer, base = lora_trainer()
    for _ in range(2):
        trainer.train_step(groups)
    assert trainer.adapter is not None
    folder = lora.write_peft_folder(trainer.trained_state(), trainer.adapter, "base", tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, list(LINEAR))
    served = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.tensor([[1, 5, 7, 9, 4]])
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, trainer.model(ids).logits, atol=1e-6)


def test_the_base_digest_changes_with_any_weight_file_and_not_with_other_files(tmp_path: Path) -> None:
    folder = tmp_path / "base"
    folder.mkdir()
    weights = bytearray(range(256)) * ((lora.DIGEST_STRIDE + 4096) // 256)
    (folder / "model.safetensors").write_bytes(bytes(weights))
    (folder / "config.json").write_text('{"hidden_size": 32}')
    (folder / "README.md").write_text("a base")
    first = lora.base_digest(folder)
    (folder / "README.md").write_text("edited")
    assert lora.base_digest(folder) == first, "only weights and config identify the base"
    weights[lora.DIGEST_STRIDE + 10] ^= 1  # inside the second sampled block
    (folder / "model.safetensors").write_bytes(bytes(weights))
    assert lora.base_digest(folder) != first
    (folder / "model.safetensors").write_bytes(bytes(weights[:-1]))
    assert lora.base_digest(folder) != first, "the size is part of it"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match="no weight files"):
        lora.base_digest(tmp_path / "empty")


def test_the_lora_guides_example_is_a_valid_policy_whose_targets_are_the_qwen_default() -> None:
    """The LoRA guide's example (docs/guides/lora.md): its policy.lora parses into the RLJob
    model, and the targets it lists are the default's for a Qwen2 model (builtin:tiny-chat's shape)."""
    import yaml

    from spotrl_e2e.docs import blocks
    from spotrl_runtime.api.rljob import Policy
    from spotrl_runtime.models import load_policy

    page = Path("docs/guides/lora.md")
    text = (Path(__file__).resolve().parents[3] / page).read_text()
    docs = [yaml.safe_load(b.text) for b in blocks(text, page) if b.lang == "yaml"]
    policies = [d.get("spec", d)["policy"] for d in docs if "lora" in d.get("spec", d).get("policy", {})]
    assert policies, f"{page} lost its example of policy.lora"
    policy = Policy.model_validate(policies[0])
    assert policy.lora is not None
    assert (policy.lora.rank, policy.lora.scale_alpha) == (32, 64.0)
    model, _ = load_policy("builtin:tiny-chat")
    assert lora.target_modules(model, None) == tuple(sorted(policy.lora.target_modules or []))
