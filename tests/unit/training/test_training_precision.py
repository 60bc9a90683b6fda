"""The trainer at the users' numerics and memory: float32 masters computing in bfloat16, the
sliced and chunked log-probs, activation checkpointing, float16 refused."""

from __future__ import annotations

import copy

import pytest
import torch
from training_helpers import make_group, small_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training import logprobs as lp

QWEN_VOCAB = 151_936


def _qwen_wide_vocab() -> Qwen2ForCausalLM:
    """A one-layer Qwen2 with Qwen's whole vocabulary (tied head): the head is what is sliced."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def _batch(vocab: int, seed: int = 0) -> lp.TokenBatch:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for prompt_len, completion_len in [(3, 7), (6, 2), (2, 11), (5, 5)]:
        ids = torch.randint(3, vocab, (prompt_len + completion_len,), generator=g).tolist()
        pairs.append((ids[:prompt_len], ids[prompt_len:]))
    return lp.token_batch(pairs, 0, "cpu")


@pytest.mark.parametrize("build", [small_llama, _qwen_wide_vocab], ids=["llama-18", "qwen2-151936"])
def test_the_sliced_chunked_logprobs_equal_the_full_softmax_in_value_and_gradient(
    build, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    model = build()
    batch = _batch(model.config.vocab_size)
    weights = torch.randn(batch.targets.shape, generator=torch.Generator().manual_seed(1))
    full = lp.full_softmax_logprobs(model, batch, 0.8)
    (full * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # Three positions a chunk: several chunks, the last one short.
    monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", model.config.vocab_size * 3)
    sliced, _ = lp.call(model, batch, 0.8)
    (sliced * weights).sum().backward()
    assert sliced.dtype == torch.float32
    assert torch.allclose(sliced, full, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        # fp32 rounding: sums taken in another order (the tied embedding's over 151,936 rows)
        scale = float(expected[name].abs().max())
        assert float((param.grad - expected[name]).abs().max()) <= 2e-5 * scale, name


def test_activation_checkpointing_gives_the_gradients_of_running_without_it() -> None:
    groups = [make_group(f"g{i}", [1.0, 0.0, 0.5, 0.25]) for i in range(3)]
    grads = {}
    for setting in ("off", "on"):
        trainer = Trainer(small_llama(), TrainerConfig(activation_checkpointing=setting))
        trainer.compute_gradients(groups)
        grads[setting] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        assert trainer.activation_checkpointing == (setting == "on")
        assert trainer.model.is_gradient_checkpointing == (setting == "on")
    for name, grad in grads["off"].items():
        assert torch.allclose(grads["on"][name], grad, atol=1e-6, rtol=0), name


def test_activation_checkpointing_auto_is_on_for_a_chat_sized_policy_only() -> None:
    from spotrl_runtime.training.precision import wants_activation_checkpointing

    assert not wants_activation_checkpointing("auto", small_llama())
    assert wants_activation_checkpointing("auto", _big())
    assert wants_activation_checkpointing("on", small_llama())
    assert not wants_activation_checkpointing("off", _big())


def _big() -> torch.nn.Module:
    return torch.nn.Linear(10_000, 10_001, bias=False, device="meta")


def _moved(before: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[float, float]:
    """(how far the weights moved: the L2 norm of the change, the share of entries that changed)."""
    delta = torch.cat([(p.detach() - before[n]).reshape(-1) for n, p in model.named_parameters()])
    return float(delta.norm()), float((delta != 0).float().mean())


def test_a_bf16_run_moves_its_weights_as_far_as_an_fp32_run_at_a_small_learning_rate() -> None:
    """lr 1e-6, as the GPU examples: AdamW on bf16 weights rounded most updates away (the weights
    a bf16 policy holds have 8 bits of mantissa); float32 masters keep every one. The bf16 run
    computes in bf16 (every linear layer's output), not in float32 under another name."""
    groups = [make_group(f"g{i}", [1.0, 0.0, 0.5, 0.25], seed=i) for i in range(4)]
    start = small_llama()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(copy.deepcopy(start), TrainerConfig(learning_rate=1e-6, compute_dtype=dtype, seed=1))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        computed: set[torch.dtype] = set()  # what every linear layer's matrix product came out in
        for m in trainer.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda _m, _i, out, seen=computed: seen.add(out.dtype))
        losses = [trainer.train_step(groups)["loss"] for _ in range(6)]
        assert computed == {getattr(torch, dtype)}, f"the {dtype} run's forward computed in {computed}"
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values() for s in st.values() if s.dim())
        runs[dtype] = (_moved(before, trainer.model), losses, trainer.policy_state_dict())
    (fp32_norm, fp32_share), fp32_losses, fp32_sent = runs["float32"]
    (bf16_norm, bf16_share), bf16_losses, bf16_sent = runs["bfloat16"]
    assert bf16_norm >= 0.7 * fp32_norm
    assert bf16_share > 0.95
    assert fp32_share > 0.95
    # The per-step loss follows fp32's within bf16's resolution of the logits (4e-5 measured),
    # and is not fp32's: the same forward in fp32 gives the same losses bit for bit.
    assert bf16_losses == pytest.approx(fp32_losses, abs=2e-4)
    assert bf16_losses != fp32_losses
    # The generation workers get the compute dtype, the fp32 run's at full width.
    assert {v.dtype for v in bf16_sent.values()} == {torch.bfloat16}
    assert {v.dtype for v in fp32_sent.values()} == {torch.float32}


def test_a_bf16_model_handed_to_the_trainer_becomes_float32_masters() -> None:
    trainer = Trainer(small_llama().to(torch.bfloat16), TrainerConfig(compute_dtype="bfloat16"))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {v.dtype for v in trainer.state_dict()["model"].values()} == {torch.float32}


def test_float16_is_refused_by_the_trainer_and_by_the_spec() -> None:
    from spotrl_runtime.api.rljob import SpecError, parse_rljob

    with pytest.raises(ValueError, match=r"float16 is not trained.*loss scaler.*bfloat16"):
        Trainer(small_llama(), TrainerConfig(compute_dtype="float16"))
    doc = {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "half"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith", "dtype": "float16"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 2},
        },
    }
    with pytest.raises(SpecError, match=r"policy\.dtype.*float16 is not trained"):
        parse_rljob(doc)


def test_a_cut_of_a_bf16_trainer_without_masters_resumes_exactly_into_float32_masters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a bf16 job cut before the trainer kept masters: bf16 weights and AdamW state over
    them. Every bf16 value is a float32 value, so they load exactly, with a warning that says so;
    the run goes on with float32 masters."""
    import logging

    from spotrl_runtime.checkpoint.resume import load_trainer
    from spotrl_runtime.checkpoint.trainer_state import snapshot_trainer

    old = small_llama().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(old.parameters(), lr=1e-3)
    old(torch.tensor([[1, 4, 5, 6]])).logits.float().sum().backward()
    optimizer.step()
    snap = snapshot_trainer(old.state_dict(), optimizer.state_dict(), step=3)
    trainer = Trainer(small_llama(seed=1), TrainerConfig(compute_dtype="bfloat16"))
    with caplog.at_level(logging.WARNING, logger="spotrl.resume"):
        load_trainer(trainer, snap, "0000000003", "file:///x")
    assert "holds bfloat16 weights" in caplog.text
    assert trainer.step == 3
    for name, param in trainer.model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param.detach(), old.state_dict()[name].float()), name
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments
    assert {m.dtype for m in moments} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step([make_group("g", [1.0, 0.0, 0.5])])
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize(("field", "value"), [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625)])
def test_a_model_that_transforms_its_logits_is_refused_by_name(field: str, value: float) -> None:
    """Gemma 2 soft-caps its logits and Cohere scales them: the sliced head would get their
    log-probs wrong, so the trainer refuses them, naming the field."""
    model = small_llama()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=rf"{field}={value}.*plain language-model head"):
        Trainer(model, TrainerConfig())
    setattr(model.config, field, None)
    Trainer(model, TrainerConfig())  # a plain head is taken


def test_a_float32_head_multiplies_in_float32_where_the_default_multiplies_in_bf16() -> None:
    """Under bf16 autocast the default head's product is bf16 (its logits off a float32 product
    of the same hidden states by bf16's resolution); ``training.precision.lmHead: float32`` is the
    float32 product, to float32's, in value and gradient."""
    model = _qwen_wide_vocab()
    batch = _batch(QWEN_VOCAB)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention).last_hidden_state
        picked = hidden[batch.rows, batch.positions].detach()
        default, _ = lp._head_logprobs(model.lm_head, picked, batch.targets, 1.0, 1.0)
        default = default.detach()
        head32 = picked.float().requires_grad_()
        fp32, _ = lp._head_logprobs(model.lm_head, head32, batch.targets, 1.0, 1.0, True)
    exact = torch.log_softmax(head32.detach().double() @ model.lm_head.weight.detach().double().T, -1)
    exact = exact.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    assert float((fp32.detach().double() - exact).abs().max()) < 1e-5
    assert float((default.double() - exact).abs().max()) > 1e-4, "the default head's product is bf16"
    fp32.sum().backward()
    assert head32.grad is not None
    assert head32.grad.dtype == torch.float32


def test_the_trainer_takes_the_head_dtype_from_its_config() -> None:
    """Through the trainer's own passes: a bf16 step with a float32 head trains, and its entropy
    differs from the default head's by the head's rounding (the rest of the pass is the same),
    not by more."""
    group = make_group("g", [1.0, 0.0, 0.0, 1.0])
    steps = {}
    for lm_head in ("policy", "float32"):
        config = TrainerConfig(compute_dtype="bfloat16", lm_head=lm_head, micro_batch_size=4)
        assert config.sampling[2] is (lm_head == "float32")
        steps[lm_head] = Trainer(small_llama(), config).train_step([group])
    default, fp32 = steps["policy"], steps["float32"]
    assert fp32["tokens"] == default["tokens"] > 0
    assert fp32["entropy"] != default["entropy"], "the head computed in another dtype"
    assert fp32["entropy"] == pytest.approx(default["entropy"], rel=2e-2)
