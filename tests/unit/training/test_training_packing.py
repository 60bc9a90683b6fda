"""Packed micro-batches (``training.packing``): several rollouts a row, each attending within
itself alone (position ids from 0, no mask: transformers takes the sequences apart by their
positions). The packed log-probs, loss and gradients are the padded ones (float32 to rounding,
bfloat16 within its resolution) on a model with rotary embeddings, with almost no padding."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from training_helpers import make_group, small_llama

from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training.rows import micro_batch_rows, pack, plan_micro_batches, step_rows


def pairs(n: int = 12, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Rows of mixed lengths (prompt 2-20 tokens, completion 1-30): most would be padding."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randint(4, 17) for _ in range(rng.randint(1, 19))]
        out.append((prompt, [rng.randint(4, 17) for _ in range(rng.randint(1, 30))]))
    return out


def test_packing_places_every_sequence_once_in_balanced_rows_longest_first() -> None:
    lengths = [5, 9, 3, 9, 1, 4, 7]
    rows = pack(lengths, 9)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert rows == [[1], [3], [6], [0, 4], [5, 2]]
    assert max(sum(lengths[i] for i in r) for r in rows) == 9
    assert pack(lengths, 9) == rows, "deterministic"
    # 2,752 positions in rows of 2,048 at most: two rows of about half each, not one full and one
    # mostly padding.
    mixed = [512, 480, 400, 380, 300, 260, 240, 180]
    fills = sorted(sum(mixed[i] for i in r) for r in pack(mixed, 2048))
    assert fills == [1360, 1392]


def test_evening_narrows_the_fullest_row_that_longest_first_leaves() -> None:
    """The 0.5B bench's 8 rollouts (bench_numerics.py): longest first leaves rows of 733, 916 and
    919 positions; moves and swaps even them to within 13 positions, every sequence still once."""
    lengths = [341, 253, 378, 509, 200, 213, 450, 224]
    first = pack(lengths, 1018, even=False)
    assert sorted(sum(lengths[i] for i in r) for r in first) == [733, 916, 919]
    rows = pack(lengths, 1018)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    fills = sorted(sum(lengths[i] for i in r) for r in rows)
    assert len(rows) == 3
    assert fills[-1] - fills[0] <= 13, fills
    assert pack(lengths, 1018) == rows, "deterministic"
    rng = random.Random(3)
    for _ in range(50):  # never wider than longest-first, whatever the lengths
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        width = max(lengths) * 2
        evened, plain = pack(lengths, width), pack(lengths, width, even=False)
        assert sorted(i for r in evened for i in r) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in r) for r in evened) <= max(sum(lengths[i] for i in r) for r in plain)


def test_a_packed_batch_trains_the_same_tokens_with_positions_from_zero_in_each_sequence() -> None:
    seqs = pairs()
    padded = lp.token_batch(seqs, 0, "cpu")
    packed = lp.token_batch(seqs, 0, "cpu", packed=True)
    assert torch.equal(packed.targets, padded.targets), "the same trained tokens, in the same order"
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    assert packed.position_ids is not None
    for row, pos in zip(packed.rows.tolist(), packed.positions.tolist(), strict=True):
        assert packed.position_ids[row, pos + 1] == packed.position_ids[row, pos] + 1
    starts = (packed.position_ids == 0).sum()
    assert starts >= len(seqs), "each sequence (and a row's trailing padding) starts at position 0"
    share = 1 - packed.real_tokens / packed.padded_tokens
    assert share < 0.5 * (1 - padded.real_tokens / padded.padded_tokens)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(dtype: str, tol: float) -> None:
    """On Llama (rotary embeddings): a sequence placed after another in a row must see positions
    from 0 and nothing of its neighbour, or its log-probs move far beyond rounding."""
    model = small_llama()
    seqs = pairs()
    weights = torch.randn(sum(len(c) for _, c in seqs), generator=torch.Generator().manual_seed(1))
    got = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logp, _ = lp.call(model, lp.token_batch(seqs, 0, "cpu", packed=packed), 1.0)
        (logp * weights).sum().backward()
        got[packed] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (a, grads_a), (b, grads_b) = got[False], got[True]
    assert float((a - b).abs().max()) <= tol
    for name, g in grads_a.items():
        scale = float(g.abs().max()) or 1.0
        assert float((grads_b[name] - g).abs().max()) <= tol * max(scale, 1.0), name


def long_groups(n: int = 6) -> list:
    """Groups of mixed lengths: prompts of 2-20 tokens, completions of 1-30."""
    out = []
    for i, (prompt, _) in enumerate(pairs(n, seed=7)):
        group = make_group(f"g{i}", [1.0, 0.0, 0.5, 0.0], seed=i, prompt_len=len(prompt))
        rng = random.Random(i)
        rollouts = []
        for r in group.rollouts:
            ids = tuple(rng.randint(4, 17) for _ in range(rng.randint(1, 30)))
            rollouts.append(replace(r, completion_token_ids=ids, logprobs=(-1.5,) * len(ids)))
        out.append(replace(group, rollouts=tuple(rollouts)))
    return out


def test_a_packed_step_trains_as_the_padded_one_with_almost_no_padding() -> None:
    groups = long_groups()
    steps = {}
    for packing in (False, True):
        config = TrainerConfig(micro_batch_size=24, micro_batch_tokens=None, packing="on" if packing else "off")
        steps[packing] = Trainer(copy.deepcopy(small_llama()), config).train_step(groups)
    padded, packed = steps[False], steps[True]
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5), key
    assert padded["padding_share"] > 0.3
    assert packed["padding_share"] < 0.1
    assert TrainerConfig(packing="on").layout == "packed"
    assert TrainerConfig(packing="on", mini_batches=2).layout == "miniBatches=2,epochs=1,packed"
    assert TrainerConfig(packing="auto").layout == "", "decided when the trainer is built"


def test_a_token_budget_counts_packed_rows() -> None:
    """The same budget holds more rollouts a micro-batch once they are packed."""
    rows = step_rows(long_groups()).rows
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    padded = plan_micro_batches(rows, 64, 4 * width)
    packed = plan_micro_batches(rows, 64, 4 * width, packed=True)
    assert len(packed) < len(padded)
    assert sorted(map(id, (r for b in packed for r in b))) == sorted(map(id, rows))


def test_auto_packs_a_transformers_decoder_and_on_refuses_a_model_that_cannot_by_name() -> None:
    model = small_llama()
    assert lp.packs_sequences(model)
    assert TrainerConfig(packing="auto").resolved(model).packing == "on"
    assert TrainerConfig(packing="off").resolved(model).packing == "off"

    class Own(torch.nn.Module):  # a decoder of its own, not a transformers model
        def get_decoder(self) -> torch.nn.Module:
            return self

    assert not lp.packs_sequences(Own())
    assert TrainerConfig(packing="auto").resolved(Own()).packing == "off"
    with pytest.raises(ValueError, match=r"training\.packing: on, but Own's attention"):
        TrainerConfig(packing="on").resolved(Own())


def test_use_packing_switches_a_trainer_and_its_layout() -> None:
    trainer = Trainer(small_llama(), TrainerConfig(packing="auto"))
    assert trainer.config.layout == "packed"
    trainer.use_packing(False)
    assert (trainer.config.packing, trainer.config.layout) == ("off", "")


def test_a_micro_batch_packs_only_where_that_computes_fewer_positions() -> None:
    """Rows of like length (as the plan puts them together) pad less than they pack: they stay one
    a row, with their attention mask; mixed lengths pack."""
    assert micro_batch_rows([80, 78, 77, 75], packed=True) == [[0], [1], [2], [3]]
    assert micro_batch_rows([512, 129, 140, 300], packed=True) != [[0], [1], [2], [3]]
    alike = [([1] * 40, [5] * 38), ([1] * 40, [5] * 37), ([1] * 40, [5] * 35)]
    batch = lp.token_batch(alike, 0, "cpu", packed=True)
    assert batch.position_ids is None
    assert batch.input_ids.shape[0] == 3
