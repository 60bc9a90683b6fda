"""The controller's Prometheus metrics, read from its state at scrape time.

One collector, no counters kept twice: every value comes from the controller and the
recovery core when Prometheus asks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ControllerCollector(Collector):
    """spotrl_* metrics of one controller."""

    def __init__(self, controller: Any):
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        c = self.controller
        owners = getattr(c, "owners", None)
        if owners is None:
            return
        job = c.job.name
        yield _gauge(job, "spotrl_step", "Optimizer steps trained.", owners.trainer_step)
        yield _gauge(job, "spotrl_target_steps", "Steps this run trains.", c.target_steps)
        yield _gauge(job, "spotrl_attempt", "Controller incarnation.", owners.attempt)
        yield _gauge(job, "spotrl_dispatch_index", "The sampler cursor: the last step stamped.", owners.dispatch_index)
        yield from _training(job, c.history)
        g = GaugeMetricFamily("spotrl_groups", "Groups (prompts) per owner.", labels=["job", "owner"])
        for owner, n in owners.census().items():
            g.add_metric([job, owner], n)
        yield g
        yield from _counters(job, c.stats, owners.counters)
        yield from _cuts(job, c.cuts)


def _gauge(job: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["job"])
    g.add_metric([job], value)
    return g


def _counter(job: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=["job"])
    m.add_metric([job], value)
    return m


STEP_GAUGES = {
    "reward_std": "Standard deviation of the rollouts' rewards",
    "accuracy": "Fraction of rollouts a verifiable reward scored 1.0",
    "response_length_mean": "Mean completion length in tokens",
    "response_length_max": "Longest completion in tokens",
    "response_clip_ratio": "Fraction of completions cut off at maxNewTokens",
    "frac_reward_zero_std": "Fraction of groups whose rewards were all equal (no learning signal)",
    "turns_mean": "Mean turns per episode (spec.environment; 1 for single-turn completions)",
    "observation_tokens_mean": "Mean tokens per episode that its environment wrote (tool answers), never trained",
    "steps_without_signal": "Steps in a row in which every group's rewards were equal",
    "reward_errors": "Completions the reward failed on, scored reward.errorScore",
    "version_mismatches": "Groups generated with other weights than they were admitted with (a lost worker's)",
    "kl": "KL divergence to the reference policy per token",
    "entropy": "Policy entropy per trained token, in nats",
    "clip_fraction": "Fraction of trained tokens whose ratio PPO's clip bounded",
    "is_weight_mean": "Mean importance weight min(p_trainer / p_generator, cap) per trained token",
    "is_weight_max": "Largest importance weight of a trained token",
    "is_capped_fraction": "Fraction of trained tokens whose importance weight hit the cap",
    "outside_nucleus_fraction": "Fraction of trained tokens outside the trainer's top-p nucleus, left out of the loss",
    "padding_share": "Fraction of the positions the trainer computed that were padding",
    "overlong_filtered": "Completions cut off at maxNewTokens and left out of the loss (training.overlong.filter)",
    "overlong_penalty_mean": "Mean of DAPO's overlong penalty over the step's rollouts (training.overlong.softPenalty)",
    "reward_kl_penalty_mean": "Mean KL penalty taken from the step's rewards (training.kl.inReward)",
    "dynamic_filtered": "Groups without signal that dynamic sampling filtered (training.sampling.dynamic)",
    "dynamic_filtered_share": "Share of the step's finished groups that dynamic sampling filtered",
    "refill_rounds": "Refill rounds dynamic sampling took to fill the step",
    "grad_norm": "Gradient norm before clipping",
    "learning_rate": "Learning rate",
    "generation_tokens_per_second": "Tokens generated per second since the step before",
    "weight_sync_seconds": "Seconds the sync of the weights this step started from took (trainer to workers)",
    "weight_sync_bytes": "Bytes the trainer sent the workers in that sync (0: no worker needed them)",
    "cut_wait_seconds": (
        "Seconds the step's commit waited for the cut of the step before it (with delta cuts on: the cut writer"
        " was slower than a step)"
    ),
    "generation_idle_share": (
        "Share of the step's wall time the generation workers were not generating, mean over the workers"
        " (waiting for work, for a weight load, or restarting)"
    ),
    "generation_idle_share_max": "Share of the step's wall time the idlest generation worker was not generating",
}


def _training(job: str, history: list[dict[str, Any]]) -> Iterator[Metric]:
    last = history[-1] if history else None
    if last is not None:
        yield _gauge(job, "spotrl_reward_mean", "Mean reward of the last trained step.", last["reward"])
        yield _gauge(job, "spotrl_step_seconds", "Wall time of the last optimizer step.", last["seconds"])
    if last is not None:
        for name, doc in STEP_GAUGES.items():
            if name in last:
                yield _gauge(job, f"spotrl_{name}", f"{doc} (the last trained step).", last[name])
    validated = next((h for h in reversed(history) if "val_accuracy" in h), None)
    if validated is not None:
        what = "on the held-out split (spec.validation), the newest pass"
        accuracy, reward, step = validated["val_accuracy"], validated["val_reward"], validated["val_step"]
        yield _gauge(job, "spotrl_val_accuracy", f"Fraction of completions scored 1.0 {what}.", accuracy)
        yield _gauge(job, "spotrl_val_reward", f"Mean reward {what}.", reward)
        yield _gauge(job, "spotrl_val_step", "The step whose weights the newest validation pass scored.", step)
    measured = next((h for h in reversed(history) if "rollout_probs_diff_max" in h), None)
    if measured is not None:
        what = "of a trained token's probability, generator against trainer, same weights (last step measured)"
        yield _gauge(
            job, "spotrl_rollout_probs_diff_mean", f"Mean |difference| {what}.", measured["rollout_probs_diff_mean"]
        )
        yield _gauge(
            job, "spotrl_rollout_probs_diff_max", f"Largest |difference| {what}.", measured["rollout_probs_diff_max"]
        )
    window = history[-10:]
    secs = sum(h["seconds"] for h in window)
    if secs > 0:
        tokens = sum(h["tokens"] for h in window) / secs
        yield _gauge(job, "spotrl_train_tokens_per_second", "Trained tokens per second (last 10 steps).", tokens)


STAT_COUNTERS = {
    "tokens_generated": ("spotrl_generated_tokens", "Completion tokens generated."),
    "groups_generated": ("spotrl_groups_generated", "Groups whose rollouts all finished."),
    "groups_retried": ("spotrl_groups_retried", "Group generations retried after a failure."),
    "groups_lost_redispatched": ("spotrl_groups_lost_redispatched", "Groups redispatched after their worker died."),
    "tool_calls": ("spotrl_tool_calls", "Tool calls episodes' environments answered."),
    "tool_errors": ("spotrl_tool_errors", "Tool calls answered with an error."),
    "environment_seconds": (
        "spotrl_environment_seconds",
        "Seconds episodes waited on their environments (overlapping generation).",
    ),
    "turns_kept": ("spotrl_turns_kept", "Finished turns of unfinished episodes the ledger took."),
    "turns_resumed": ("spotrl_turns_resumed", "Finished turns resumed episodes went on from."),
    "episodes_restarted": (
        "spotrl_episodes_restarted",
        "Episodes with finished turns started again from turn 0 (their environment did not replay).",
    ),
}
"""The controller's counters (:data:`~spotrl_runtime.controller.loop.STATS`) on /metrics: name, help."""
RESTORE_COUNTERS = {
    "groups_found": ("spotrl_restore_groups_found", "Ledger groups found in the cut restored from."),
    "groups_relaunched": ("spotrl_restore_groups_relaunched", "Restored groups dispatched again."),
    "groups_discarded": ("spotrl_restore_groups_discarded", "Restored groups discarded (must stay 0)."),
    "prompts_dropped": ("spotrl_prompts_dropped", "Prompts given up on (onDroppedPrompt)."),
}
"""This attempt's recovery counters on /metrics: name, help."""


def _counters(job: str, stats: dict[str, float], rc: Any) -> Iterator[Metric]:
    for key, (name, doc) in STAT_COUNTERS.items():
        yield _counter(job, name, doc, stats[key])
    for key, (name, doc) in RESTORE_COUNTERS.items():
        yield _counter(job, name, doc, getattr(rc, key))


def _cuts(job: str, all_cuts: list[Any]) -> Iterator[Metric]:
    cuts = GaugeMetricFamily(
        "spotrl_last_cut_seconds", "Duration of the last cut of each kind.", labels=["job", "kind"]
    )
    count = CounterMetricFamily("spotrl_cuts", "Committed cuts.", labels=["job", "kind"])
    for kind in ("periodic", "barrier"):
        mine = [x for x in all_cuts if x.kind == kind]
        count.add_metric([job, kind], len(mine))
        if mine:
            cuts.add_metric([job, kind], mine[-1].seconds)
    yield cuts
    yield count


def registry_for(controller: Any) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller))
    return registry
