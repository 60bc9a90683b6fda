"""Whether the job trains anything, said on the RLJob. Pure: part of
:func:`~spotrl_operator.reconcile.reconcile`.

The controller publishes, after each step, how many steps in a row had no group whose rewards
differ (``status.learningSignal``; :class:`~spotrl_runtime.core.step_stats.LearningSignal`).
Such a step trains nothing: every advantage is 0. Once that lasts ``threshold`` steps, condition
``NoLearningSignal`` is True with a Warning Event of the same name; a step with signal turns it
False again (Event ``LearningSignal``).
"""

from __future__ import annotations

from spotrl_operator.world import Builder

CONDITION = "NoLearningSignal"


def tend_learning_signal(b: Builder) -> None:
    """Sets ``NoLearningSignal`` from ``status.learningSignal``; an Event on each change."""
    signal = b.st.learning_signal
    if signal is None or b.st.phase in ("Succeeded", "Failed"):
        return
    was = b.has_condition(CONDITION)
    if signal.steps_without_signal >= signal.threshold:
        message = (
            f"steps {signal.step - signal.steps_without_signal + 1}..{signal.step}: every group's rollouts had equal "
            f"rewards (mean {signal.reward_mean:.3f}), so nothing was trained; check the reward, the dataset's "
            "answerField, and that the policy can solve some of the prompts"
        )
        if not was:
            b.event("Warning", CONDITION, message)
        b.condition(CONDITION, True, "ZeroRewardVariance", message)
    elif was:
        message = f"step {signal.step} had groups whose rewards differ"
        b.event("Normal", "LearningSignal", message)
        b.condition(CONDITION, False, "RewardVariance", message)
