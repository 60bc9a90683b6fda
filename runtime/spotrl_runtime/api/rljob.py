"""The RLJob API: one Python model of the resource, used by the operator and the runtime.

The CustomResourceDefinition in ``crds/`` is generated from these classes
(:mod:`spotrl_runtime.api.crd`), so the API server and :func:`parse_rljob` accept and
reject the same documents. Field names are camelCase on the wire and snake_case in Python.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from spotrl_runtime.api.lenient import ignoring_unknown, read_leniently
from spotrl_runtime.api.rules import ApiObject, Rule, exactly_one

GROUP = "spotrl.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)

# A Kubernetes resource quantity such as "500m", "2", "4Gi" or "1.5G".
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
# s3://bucket[/prefix], a file:// URI, or a plain path (absolute or relative).
STORAGE_URI = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|file://.+|[^:]+)$"
BUILTIN_REWARDS = ("arithmetic_exact", "format_only")
# metadata.name, as Kubernetes requires of an object name (a DNS-1123 subdomain); `spotrl run`
# also makes it a folder name (./spotrl-runs/<name>), so no "/" or ".." gets through.
NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
NAME_MAX = 253
_QUANTITY_SCALE = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_QUANTITY_SCALE.update({"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50})


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity that matches ``QUANTITY`` as a number: '500m' -> 0.5, '1Gi' -> 2**30."""
    for suffix in sorted(_QUANTITY_SCALE, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * _QUANTITY_SCALE[suffix]
    return float(quantity)


class Resources(ApiObject):
    """What one pod asks for. GPUs are an extended resource (``nvidia.com/gpu``)."""

    cpu: str | None = Field(default=None, pattern=QUANTITY, description="CPU request, e.g. '2' or '500m'.")
    memory: str | None = Field(default=None, pattern=QUANTITY, description="Memory request, e.g. '8Gi'.")
    gpu: int = Field(default=0, ge=0, le=64, description="GPUs (nvidia.com/gpu) per pod.")


MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Lora(ApiObject):
    """A LoRA adapter trained on the frozen base (``policy.lora``): only the adapter trains, syncs
    to the generation workers and is cut, so a full cut is megabytes at any model size."""

    rank: int = Field(
        default=16, ge=1, le=256, description="The adapter's rank r; 16-32 is the usual choice for 1.5B-8B bases."
    )
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="The scale numerator: updates are scaled by alpha / rank. Unset: 2 x rank.",
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapter's input while training. 0 keeps the trainer's log-probs those of the "
            "weights the workers sample from."
        ),
    )
    target_modules: list[Annotated[str, Field(pattern=MODULE_NAME, max_length=63)]] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description=(
            "The linear layers that get an adapter, by their last name (q_proj, down_proj ...). Unset: every "
            "linear layer but the language-model head. A name the model lacks is refused at start."
        ),
    )

    @property
    def scale_alpha(self) -> float:
        """``alpha``, or 2 x ``rank`` when unset."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class Policy(ApiObject):
    """The policy model being trained."""

    model: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "A local path, an s3:// URI, a model id for users who have a hub, or "
            "'builtin:<name>' for a model SpotRL builds from code (the CPU demo)."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description=(
            "The compute dtype: the trainer's passes, generation, exports. The trainer's parameters and optimizer "
            "state stay float32 (master weights); float16 is refused for training (it needs a loss scaler)."
        ),
    )
    lora: Lora | None = Field(
        default=None,
        description=(
            "Train a LoRA adapter on the base instead of every weight: the base stays frozen in dtype, the "
            "adapter and its optimizer state are float32. Unset: full fine-tuning."
        ),
    )

    rules = (
        Rule(
            cel="!has(self.dtype) || self.dtype != 'float16'",
            check=lambda p: p.dtype != "float16",
            message=(
                "float16 is not trained by SpotRL (it needs a loss scaler, which the trainer does not have); "
                "use bfloat16, which has float32's range"
            ),
            field="dtype",
        ),
    )


class Dataset(ApiObject):
    """Where the prompts come from: a map-style dataset whose rows have a stable index."""

    uri: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "A JSONL or Parquet (*.parquet) file, or a folder written by Hugging Face datasets' save_to_disk "
            "(an s3:// one ends with '/'), by path or s3:// URI, or 'builtin:<name>' for a generated task."
        ),
    )
    split: str = Field(
        default="train",
        min_length=1,
        max_length=63,
        description="The split to read: builtin:arithmetic's train or test, or a save_to_disk DatasetDict's.",
    )
    task_field: str = Field(default="task_name", min_length=1, max_length=63, description="Row field naming the task.")
    prompt_field: str = Field(
        default="prompt", min_length=1, max_length=63, description="Row field holding the prompt."
    )
    answer_field: str = Field(
        default="answer", min_length=1, max_length=63, description="Row field the reward checks against."
    )
    shuffle: bool = Field(default=True, description="Visit rows in a seeded random order, reshuffled each epoch.")
    seed: int = Field(default=0, ge=0, description="Shuffle seed.")
    prompt_format: Literal["raw", "chat"] = Field(
        default="raw",
        description=(
            "'raw': the prompt field's text as it is (base models); 'chat': through the tokenizer's chat template, "
            "with the generation prompt added: the field is the user's message, or a list of chat turns "
            "({role, content}, the HF messages convention)."
        ),
    )
    system_prompt: str | None = Field(
        default=None,
        max_length=8192,
        description="With promptFormat chat: a system turn put first (unless the row's turns begin with one).",
    )

    rules = (
        Rule(
            cel="!has(self.systemPrompt) || self.promptFormat == 'chat'",
            check=lambda d: d.system_prompt is None or d.prompt_format == "chat",
            message="systemPrompt needs promptFormat: chat (a raw prompt has no turns to put it in)",
            field="systemPrompt",
        ),
    )


class Generation(ApiObject):
    """How rollouts are generated: G samples per prompt, up to `lookahead` steps ahead."""

    backend: Literal["vllm", "transformers"] = Field(
        default="transformers",
        description=(
            "'vllm' (production): its CUDA build where the workers have GPUs, its CPU build (x86-64) where "
            "they have none; or 'transformers', our own sampling loop (CPU or GPU)."
        ),
    )
    group_size: int = Field(default=4, ge=2, le=1024, description="Rollouts per prompt (G); GRPO needs at least 2.")
    prompts_per_step: int = Field(default=8, ge=1, le=65536, description="Prompts (groups) per optimizer step (B).")
    lookahead: int = Field(
        default=1, ge=0, le=64, description="How many steps generation may run ahead of the trainer (L)."
    )
    max_new_tokens: int = Field(default=16, ge=1, le=131072, description="Tokens generated per rollout at most.")
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_retries: int = Field(default=2, ge=0, le=100, description="Generation attempts per group before it is dropped.")
    workers: int = Field(default=1, ge=1, le=1024, description="Generation workers (Ray actors).")
    worker_pods: bool = Field(
        default=False,
        strict=True,
        description=(
            "true: each worker runs in a pod of its own (generation.resources), joining the controller's "
            "Ray cluster, and a lost worker pod is replaced without a restore; false: the workers run as "
            "Ray actors in the controller pod."
        ),
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "vLLM on GPUs: the GPUs each worker's engine shards the model over (its resources.gpu must equal "
            "it). Each tensor-parallel rank receives the weights over the channel and loads its shard."
        ),
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1048576,
        description=(
            "vLLM: the longest prompt plus completion an engine serves (unset: the model's own context). "
            "A smaller one leaves more of the KV cache for concurrent sequences. Any backend: a prompt longer "
            "than it leaves for maxNewTokens is filtered at admission (unset: the model's "
            "max_position_embeddings, where its config has one), its place filled as "
            "preemption.onDroppedPrompt says."
        ),
    )
    max_in_flight_groups: int = Field(
        default=0,
        ge=0,
        le=65536,
        description=(
            "Groups each worker generates at once at most. 0: vLLM workers are fed groups whose sequences "
            "need up to twice their KV cache (the engine admits what fits and refills as sequences finish); "
            "transformers workers hold 16."
        ),
    )
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="vLLM: fraction of GPU memory the engine may take."
    )
    kv_cache_memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description=(
            "vLLM: memory for each worker's KV cache, e.g. '1Gi'. On the CPU build it is what the engine "
            "allocates (default 512Mi); on GPUs, unset leaves it to gpuMemoryUtilization."
        ),
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=1024,
        description=(
            "CPU generation: threads of each worker (torch's and vLLM's CPU kernels). 0: resources.cpu "
            "(rounded down, at least 1) with workerPods, else 1 (the controller pod's trainer needs the rest)."
        ),
    )
    resources: Resources = Field(
        default_factory=Resources,
        description=(
            "Per generation worker. gpu: its GPUs of its own, wherever it runs (in the controller pod the operator "
            "adds workers times gpu to the pod's nvidia.com/gpu); cpu and memory: its pod's requests with workerPods."
        ),
    )
    weight_bucket_mi_b: int = Field(
        default=512,
        ge=1,
        le=1024,
        alias="weightBucketMiB",
        description=(
            "Weight sync: the trainer sends the policy to the workers directly in buckets of at most this many "
            "MiB, in policy.dtype, packing the next while one is on the wire (two buffers of this size on the "
            "sender, one on each worker)."
        ),
    )
    weight_sync_timeout_seconds: float = Field(
        default=120.0,
        ge=1,
        le=3600,
        description=(
            "Weight sync: the bound on each step of a sync: a worker announcing it is ready once its groups of the "
            "older version finished (its drain has no bound of its own), the channel forming, each bucket. A worker "
            "that misses it, or is lost, ends the sync at once: it is replaced and its groups redispatched, the "
            "others get the weights in a new epoch; the run goes on."
        ),
    )

    rules = (
        Rule(
            cel="self.backend != 'vllm' || self.resources.gpu == 0 || self.resources.gpu == self.tensorParallelSize",
            check=lambda g: g.backend != "vllm" or g.resources.gpu in (0, g.tensor_parallel_size),
            message=(
                "a vLLM worker runs on exactly tensorParallelSize GPUs: set resources.gpu to tensorParallelSize "
                "(or 0 to generate on CPUs)"
            ),
            field="resources.gpu",
        ),
        Rule(
            cel="!has(self.maxModelLen) || self.maxModelLen > self.maxNewTokens",
            check=lambda g: g.max_model_len is None or g.max_model_len > g.max_new_tokens,
            message=(
                "maxModelLen must be larger than maxNewTokens: a prompt and its completion share it, and every "
                "prompt would be filtered as too long"
            ),
            field="maxModelLen",
        ),
        Rule(
            cel="self.tensorParallelSize == 1 || self.backend == 'vllm'",
            check=lambda g: g.tensor_parallel_size == 1 or g.backend == "vllm",
            message="tensorParallelSize above 1 needs backend 'vllm'",
            field="tensorParallelSize",
        ),
    )

    def worker_threads(self) -> int:
        """The threads a CPU generation worker uses (``threads``, or what its description says)."""
        if self.threads:
            return self.threads
        if self.worker_pods and self.resources.cpu:
            return max(1, int(quantity_value(self.resources.cpu)))
        return 1


class Parallelism(ApiObject):
    """How many processes train the policy: one, or a group of FSDP2 ranks (Ray actors)."""

    strategy: Literal["single", "fsdp"] = Field(
        default="single",
        description=(
            "'single': the controller trains the policy in its own process (it must fit, with AdamW, on one "
            "device); 'fsdp': `ranks` trainer processes shard parameters, gradients and optimizer state with "
            "FSDP2 (torch.distributed), and each cut is written by every rank through "
            "torch.distributed.checkpoint (a sharded cut that resumes on any number of ranks)."
        ),
    )
    ranks: int = Field(default=1, ge=1, le=1024, description="Trainer ranks (one process each).")
    gpus_per_rank: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: the ranks train on CPU (gloo, for tests and demos); 1: one GPU per rank (NCCL).",
    )
    cpus_per_rank: float = Field(
        default=1.0,
        gt=0,
        le=1024,
        description=(
            "CPUs each rank reserves in the Ray cluster (its actor's num_cpus); the rank runs torch with as many "
            "threads (at least one)."
        ),
    )
    trainer_pods: bool = Field(
        default=False,
        strict=True,
        description=(
            "true: each rank runs in a pod of its own (`resources`), joining the controller's Ray cluster, "
            "and the operator keeps one pod per rank; false: the ranks run as Ray actors in the controller pod."
        ),
    )
    resources: Resources = Field(default_factory=Resources, description="Per trainer pod (trainerPods): its requests.")

    rules = (
        Rule(
            cel="self.strategy == 'fsdp' || (self.ranks == 1 && !self.trainerPods)",
            check=lambda p: p.strategy == "fsdp" or (p.ranks == 1 and not p.trainer_pods),
            message="strategy 'single' trains in the controller's process: set ranks 1 and trainerPods false, "
            "or strategy 'fsdp'",
            field="strategy",
        ),
        Rule(
            cel="!self.trainerPods || self.resources.gpu >= self.gpusPerRank",
            check=lambda p: not p.trainer_pods or p.resources.gpu >= p.gpus_per_rank,
            message="a trainer pod must offer its rank's GPUs: set resources.gpu >= gpusPerRank",
            field="resources.gpu",
        ),
    )


class Advantage(ApiObject):
    """How each rollout's advantage comes from its group's rewards (veRL's ``algorithm.adv_estimator``)."""

    estimator: Literal["grpo", "rloo", "reinforce++-baseline"] = Field(
        default="grpo",
        description=(
            "'grpo': the reward minus its group's mean, over the group's standard deviation (see normalizeByStd); "
            "'rloo': the reward minus the mean of the group's other rewards; 'reinforce++-baseline': the reward "
            "minus its group's mean, then whitened over the step's trained tokens. A group whose rewards are all "
            "equal is left out of the step under each. See docs/guides/numerics.md."
        ),
    )
    normalize_by_std: bool | None = Field(
        default=None,
        strict=True,
        description=(
            "'grpo' only: divide by the group's standard deviation (unset: true). false is Dr. GRPO's advantage "
            "(veRL's norm_adv_by_std_in_grpo: false, TRL's scale_rewards: none)."
        ),
    )

    rules = (
        Rule(
            cel="!has(self.normalizeByStd) || self.estimator == 'grpo'",
            check=lambda a: a.normalize_by_std is None or a.estimator == "grpo",
            message=(
                "normalizeByStd applies to estimator 'grpo' only ('rloo' never divides by a standard deviation, "
                "'reinforce++-baseline' always whitens over the step): remove it, or set estimator: grpo"
            ),
            field="normalizeByStd",
        ),
    )


class SoftPenalty(ApiObject):
    """DAPO's overlong reward shaping: a linear penalty over the last ``buffer`` tokens before maxNewTokens."""

    buffer: int = Field(
        ge=1,
        le=131072,
        description=(
            "Completions longer than generation.maxNewTokens - buffer lose reward linearly, up to factor at "
            "maxNewTokens (DAPO's L_cache; veRL's overlong_buffer.len). Must be below generation.maxNewTokens."
        ),
    )
    factor: float = Field(
        default=1.0, gt=0, le=100, description="The penalty at maxNewTokens (veRL's overlong_buffer.penalty_factor)."
    )


class Overlong(ApiObject):
    """What a step does with completions that ran into generation.maxNewTokens."""

    filter: bool = Field(
        default=False,
        strict=True,
        description=(
            "true: a completion cut off at generation.maxNewTokens is left out of the loss (its reward still counts "
            "in its group's advantages), as DAPO's overlong filtering does."
        ),
    )
    soft_penalty: SoftPenalty | None = Field(
        default=None, description="DAPO's overlong reward shaping, added to the reward before the advantages."
    )


class ImportanceSampling(ApiObject):
    """How the off-policy correction weighs a token: its own ratio or its rollout's, truncated or masked."""

    level: Literal["token", "sequence"] = Field(
        default="token",
        description=(
            "'token': each token's ratio p_trainer / p_generator (veRL's rollout_is: token, TIS); 'sequence': "
            "its rollout's, the product over the rollout's tokens, one weight for all of them (rollout_is: "
            "sequence)."
        ),
    )
    mode: Literal["truncate", "mask"] = Field(
        default="truncate",
        description=(
            "'truncate': a ratio above importanceSamplingCap weighs the cap (truncated IS); 'mask': it weighs 0, "
            "left out of the loss (masked IS, veRL's rollout_rs). The step reports is_capped_fraction either way."
        ),
    )


class Kl(ApiObject):
    """The KL penalty to the initial policy (its weight is klCoef)."""

    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3",
        description=(
            "Schulman's per-token estimator of KL(policy || reference), d = log p - log p_ref: 'k1' is d, 'k2' "
            "d^2 / 2, 'k3' e^-d + d - 1, clamped as veRL's low_var_kl is (veRL's kl_loss_type: kl, mse, "
            "low_var_kl; TRL's k3)."
        ),
    )
    in_reward: bool = Field(
        default=False,
        description=(
            "false: the KL penalty is a term of the loss (veRL's use_kl_loss, TRL's beta). true: it is taken "
            "from each rollout's reward instead, reward - klCoef * (the estimator summed over its completion), "
            "before the advantages (veRL's use_kl_in_reward, as PPO's RLHF does): the policy and the reference "
            "score the step's rollouts in one pass without gradients first. Needs klCoef above 0."
        ),
    )


class TrainingPrecision(ApiObject):
    """Where the trainer computes in more than policy.dtype."""

    lm_head: Literal["policy", "float32"] = Field(
        default="policy",
        description=(
            "'policy': the language-model head's matrix product in policy.dtype, as every other (the log-softmax "
            "is float32 either way); 'float32': in float32, from float32 weights, which narrows the trainer's gap "
            "to the generator's probabilities (rollout_probs_diff) at the cost of a head product in float32 (with "
            "FSDP, the root unit, embeddings included, is gathered in float32). See docs/guides/numerics.md."
        ),
    )


class DynamicSampling(ApiObject):
    """DAPO's dynamic sampling: a step's groups without learning signal are replaced by new prompts."""

    filter: Literal["zero-std"] = Field(
        default="zero-std",
        description=(
            "Which groups carry no signal: 'zero-std', those whose rollouts all scored the same reward (their "
            "advantages are all 0). Each is filtered, with its reason, in the step's audit record and in "
            "status.accounting.promptsFiltered."
        ),
    )
    max_rounds: int = Field(
        default=3,
        ge=1,
        le=100,
        description=(
            "Refill rounds a step may take after its own batch (veRL's max_num_gen_batches - 1). Each round "
            "generates one new prompt per place held by a group without signal, once every group of the step has "
            "finished; a group of the last round trains as it is."
        ),
    )


class Sampling(ApiObject):
    """Which finished groups a step trains on."""

    dynamic: DynamicSampling | None = Field(
        default=None,
        description=(
            "Dynamic sampling (DAPO): groups without signal are filtered and their places refilled from the "
            "dataset until the step holds generation.promptsPerStep groups with signal, or maxRounds run out. "
            "Unset: off, every finished group trains."
        ),
    )


class Training(ApiObject):
    """The trainer: GRPO in plain torch, in one process or as a group of FSDP2 ranks."""

    algorithm: Literal["grpo"] = Field(default="grpo", description="The RL algorithm.")
    total_steps: int = Field(ge=1, le=10_000_000, description="Optimizer steps to train.")
    learning_rate: float = Field(default=1e-5, gt=0, le=1, description="AdamW learning rate.")
    micro_batch_size: int = Field(default=8, ge=1, le=65536, description="Rollouts per forward/backward pass at most.")
    micro_batch_tokens: int | None = Field(
        default=16384,
        ge=1,
        le=16_777_216,
        description=(
            "Padded tokens per forward/backward pass at most (rows times the longest row; rows are sorted by length "
            "first, so rows of like length share a pass). A row longer than this goes alone. Unset: microBatchSize "
            "alone decides."
        ),
    )
    packing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "'on': a micro-batch's rollouts are packed several to a row (each attends within itself alone: "
            "position ids from 0, no mask; flash-attention's varlen kernel on GPUs) instead of one a row padded "
            "to the longest; 'auto' (the default): on where the policy's attention takes packed sequences apart "
            "(transformers' decoder models), else off; 'off'. The step reports padding_share. See "
            "docs/guides/numerics.md."
        ),
    )
    mini_batches: int = Field(
        default=1,
        ge=1,
        le=4096,
        description=(
            "Optimizer updates per pass over the step's groups (veRL's train_batch_size / ppo_mini_batch_size): "
            "the groups in this many runs of whole groups, each an update of its own. Above 1 (or with epochs "
            "above 1) the proximal log-probs are taken before the first update, so the ratio and its clips act "
            "from the second update on. At most generation.promptsPerStep."
        ),
    )
    epochs: int = Field(
        default=1,
        ge=1,
        le=100,
        description="Passes over the step's mini-batches (veRL's ppo_epochs, TRL's num_iterations).",
    )
    clip_epsilon: float = Field(default=0.2, gt=0, le=1, description="PPO-style clip of the importance ratio.")
    clip_epsilon_high: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="Clip-higher (DAPO): the ratio's upper clip is 1 + clipEpsilonHigh (unset: clipEpsilon).",
    )
    dual_clip: float | None = Field(
        default=3.0,
        gt=1,
        le=100,
        description="Dual-clip: a token with a negative advantage loses at most dualClip times |advantage|.",
    )
    kl_coef: float = Field(default=0.0, ge=0, le=100, description="Weight of the KL penalty to the initial policy.")
    kl: Kl = Field(default_factory=Kl, description="How the KL penalty is estimated per token (with klCoef above 0).")
    advantage: Advantage = Field(
        default_factory=Advantage,
        description="The advantage estimator: grpo (the default), rloo, reinforce++-baseline.",
    )
    overlong: Overlong = Field(
        default_factory=Overlong,
        description="Completions cut off at generation.maxNewTokens: left out of the loss (filter), or penalised.",
    )
    sampling: Sampling = Field(
        default_factory=Sampling,
        description="Which finished groups a step trains on: dynamic sampling (DAPO) refills those without signal.",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        default="token-mean",
        description=(
            "How the step's per-token losses make one loss (veRL's loss_agg_mode). 'token-mean': every trained "
            "token of the step alike; 'seq-mean-token-mean': each rollout's token mean, averaged over the step's "
            "rollouts (GRPO's paper); 'seq-mean-token-sum-norm': each rollout's token sum over "
            "generation.maxNewTokens, averaged over the step's rollouts (Dr. GRPO: no length bias)."
        ),
    )
    importance_sampling_cap: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description=(
            "The off-policy correction, always on: each trained token is weighted by min(p_trainer / p_generator, "
            "cap), detached, whether its rollout came from the current weights or one version behind "
            "(generation.lookahead), and whatever the generator's numerics. See docs/guides/numerics.md."
        ),
    )
    precision: TrainingPrecision = Field(
        default_factory=TrainingPrecision, description="Where the trainer computes in more than policy.dtype."
    )
    importance_sampling: ImportanceSampling = Field(
        default_factory=ImportanceSampling,
        description=(
            "How the off-policy correction applies its cap (importanceSamplingCap): per token or per sequence, "
            "truncating or masking. The default is truncated per-token IS."
        ),
    )
    warmup_steps: int = Field(
        default=0, ge=0, le=10_000_000, description="Linear learning-rate warmup over this many steps."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant",
        description="After the warmup: 'constant', or 'cosine' down to 0 at totalSteps.",
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "Recompute each transformer block's activations in the backward pass instead of keeping them. 'auto': "
            "on for policies of 100M parameters or more."
        ),
    )
    weight_decay: float = Field(default=0.0, ge=0, le=1, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6, description="Gradient clipping norm.")
    seed: int = Field(default=0, ge=0, description="Seed of sampling and initialisation.")
    resources: Resources = Field(default_factory=Resources, description="For the controller pod (the trainer).")
    parallelism: Parallelism = Field(
        default_factory=Parallelism, description="One trainer process, or a group of FSDP2 ranks."
    )


class Reward(ApiObject):
    """How a rollout is scored: a built-in verifiable task or your own function."""

    name: Literal["arithmetic_exact", "format_only", "gsm8k", "gsm8k_flexible", "math_verify"] | None = Field(
        default=None,
        description=(
            "A built-in reward: arithmetic_exact (the completion is the answer), format_only, gsm8k "
            "(the last '#### <number>' equals the answer as a number), gsm8k_flexible (the last number does), "
            "math_verify (math-verify's parse and verify: \\boxed{}, LaTeX and plain numbers)."
        ),
    )
    import_path: str | None = Field(
        default=None,
        pattern=IMPORT_PATH,
        max_length=512,
        description=(
            "'package.module:function', called as fn(prompt, completion) -> float in a process of its own. On a "
            "cluster the module must be under the admin's prefixes (chart value rewards.allowedImportPrefixes)."
        ),
    )
    batched: bool = Field(
        default=False,
        description=(
            "importPath only: called once per group as fn(prompts, completions) -> one float per completion "
            "(for rewards that call a model)."
        ),
    )
    timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "Each call's limit (a batched reward's: each group's). A call that outlasts it, raises or returns no "
            "number has failed: see onError."
        ),
    )
    on_error: Literal["score", "drop"] = Field(
        default="score",
        description=(
            "A completion the reward failed on: 'score' gives it errorScore and trains the rest of its group "
            "(reward_errors counts them every step); 'drop' drops the whole group, with the reason in the audit "
            "(which biases training against the prompts a reward finds hard)."
        ),
    )
    error_score: float = Field(
        default=0.0, ge=-1e6, le=1e6, description="With onError score: the score of a completion the reward failed on."
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description=(
            "Processes that score a group's completions in parallel, each holding the reward (its memory counted "
            "once per process); scores come back in the group's order, the same as one process gives. Unset: one "
            "per CPU of the controller's pod (its CPU limit), at most 8. 1 scores one completion at a time. A "
            "batched reward uses one."
        ),
    )

    rules = (
        exactly_one(
            "name", "import_path", "set exactly one of name (a built-in reward) or importPath (module:function)"
        ),
        Rule(
            cel="!has(self.batched) || !self.batched || has(self.importPath)",
            check=lambda r: not r.batched or r.import_path is not None,
            message="batched applies to importPath rewards; the built-in rewards score one completion",
            field="batched",
        ),
        Rule(
            cel="!has(self.batched) || !self.batched || !has(self.workers) || self.workers == 1",
            check=lambda r: not r.batched or r.workers in (None, 1),
            message="workers: a batched reward scores a whole group in one call, in one process; leave workers unset",
            field="workers",
        ),
    )


class Checkpoint(ApiObject):
    """Where cuts go and when they are taken."""

    storage: str | None = Field(
        default=None,
        pattern=STORAGE_URI,
        max_length=1024,
        description=(
            "s3://bucket/prefix or a path. Unset: the operator's default storage, or a local folder for `spotrl run`."
        ),
    )
    s3_endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://.+",
        max_length=1024,
        description="S3-compatible endpoint (MinIO, Ceph, R2, versitygw ...); unset for AWS.",
    )
    s3_region: str | None = Field(default=None, max_length=63, description="S3 region.")
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the storage.",
    )
    every_steps: int = Field(default=5, ge=0, le=1_000_000, description="Periodic cut every N steps; 0: off.")
    every_seconds: int = Field(default=0, ge=0, le=86400, description="Periodic cut every T seconds; 0: off.")
    delta_every_steps: int = Field(
        default=1,
        ge=0,
        le=1_000_000,
        description=(
            "Between full cuts, a delta cut every N steps: the owners and the rows of the steps trained since the "
            "newest full cut, no weights (megabytes at any model size). A loss without notice then costs at most N "
            "steps; the resume trains the delta's steps again from their rows, without generating. 0: off."
        ),
    )
    delta_every_seconds: int = Field(
        default=0,
        ge=0,
        le=86400,
        description="Also a delta cut every T seconds while a step's groups are generated (long steps); 0: off.",
    )
    keep: int = Field(default=3, ge=1, le=1000, description="Committed cuts kept; older ones are deleted.")
    barrier_deadline_seconds: int = Field(
        default=100,
        ge=5,
        le=3600,
        description="A barrier cut must commit within this; the default fits AWS's 120 s notice.",
    )
    retention_policy: Literal["Retain", "Delete"] = Field(
        default="Retain", description="What happens to the job's cuts when the RLJob is deleted."
    )
    barrier: Literal["auto", "full", "delta"] = Field(
        default="auto",
        description=(
            "What a barrier cut holds. full: the weights and the optimizer (grows with the model). delta: the "
            "owners and the rows trained since the newest full cut, no weights (megabytes at any size; the resume "
            "trains those steps again, without generating). auto: full when the estimate fits the deadline with "
            "margin, else delta."
        ),
    )

    rules = (
        Rule(
            cel="self.everySteps > 0 || self.everySeconds > 0",
            check=lambda c: c.every_steps > 0 or c.every_seconds > 0,
            message="set everySteps or everySeconds above 0: periodic cuts bound what an abrupt loss costs",
            field="everySteps",
        ),
        Rule(
            cel="!has(self.s3Endpoint) || (has(self.storage) && self.storage.startsWith('s3://'))",
            check=lambda c: c.s3_endpoint is None or (c.storage or "").startswith("s3://"),
            message="s3Endpoint applies only to an s3:// storage URI",
            field="s3Endpoint",
        ),
    )


class Preemption(ApiObject):
    """What counts as a preemption notice and what happens to prompts that fail."""

    extra_taint_keys: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Taint keys (besides the well-known spot handlers') that announce a node's end.",
    )
    on_dropped_prompt: Literal["shrink", "replace"] = Field(
        default="shrink",
        description="'shrink' trains the step on fewer groups; 'replace' takes a prompt from the spare pool.",
    )
    min_step_fraction: float = Field(
        default=0.5, gt=0, le=1, description="Fail the run if a step would train on fewer than this fraction."
    )
    spare_pool_batches: int = Field(
        default=0, ge=0, le=64, description="Whole batches set aside to replace dropped prompts."
    )

    rules = (
        Rule(
            cel="self.onDroppedPrompt != 'replace' || self.sparePoolBatches >= 1",
            check=lambda p: p.on_dropped_prompt != "replace" or p.spare_pool_batches >= 1,
            message="onDroppedPrompt 'replace' needs sparePoolBatches >= 1",
            field="sparePoolBatches",
        ),
    )


class Toleration(ApiObject):
    """A pod toleration, as in the Pod API."""

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


# ------------------------------------------------------------------ placement (Pod API mirrors)
# The Pod API's own shapes, field for field, so the CRD checks them as the API server checks a
# pod; the operator hands them to every pod of the job unchanged, except that it ANDs its
# list of unusable nodes into a required node affinity (spotrl_operator.placement).

LABEL_KEY_MAX = 316  # a prefix of up to 253 characters, "/", a name of up to 63
TERMS_MAX = 32
REQUIREMENTS_MAX = 64
VALUES_MAX = 256


def _values_fit(operator: str, values: list[str]) -> bool:
    if operator in ("Exists", "DoesNotExist"):
        return not values
    if operator in ("Gt", "Lt"):
        return len(values) == 1
    return len(values) >= 1


_VALUES_RULE = Rule(
    cel="self.operator in ['Exists', 'DoesNotExist'] ? (!has(self.values) || size(self.values) == 0) : "
    "(has(self.values) && (self.operator in ['Gt', 'Lt'] ? size(self.values) == 1 : size(self.values) >= 1))",
    check=lambda r: _values_fit(r.operator, r.values),
    message="Exists and DoesNotExist take no values, In and NotIn at least one, Gt and Lt exactly one",
    field="values",
)


class LabelSelectorRequirement(ApiObject):
    """A label selector requirement (core/v1)."""

    key: str = Field(min_length=1, max_length=LABEL_KEY_MAX)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=VALUES_MAX)

    rules = (_VALUES_RULE,)


class LabelSelector(ApiObject):
    """A label selector (meta/v1 LabelSelector)."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)


class NodeSelectorRequirement(ApiObject):
    """A node selector requirement (core/v1): a label (``matchExpressions``) or a field
    (``matchFields``: ``metadata.name`` only) against values."""

    key: str = Field(min_length=1, max_length=LABEL_KEY_MAX)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = Field(default_factory=list, max_length=VALUES_MAX)

    rules = (_VALUES_RULE,)


class NodeSelectorTerm(ApiObject):
    """Requirements that all hold (core/v1 NodeSelectorTerm)."""

    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)


class NodeSelector(ApiObject):
    """Terms of which one must hold (core/v1 NodeSelector)."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=TERMS_MAX)


class PreferredSchedulingTerm(ApiObject):
    """A weighted node preference (core/v1)."""

    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiObject):
    """Node affinity (core/v1 NodeAffinity)."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=TERMS_MAX
    )


class PodAffinityTerm(ApiObject):
    """Pods, by labels, in a topology domain (core/v1 PodAffinityTerm)."""

    label_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    namespaces: list[str] = Field(default_factory=list, max_length=VALUES_MAX)
    topology_key: str = Field(min_length=1, max_length=LABEL_KEY_MAX)
    match_label_keys: list[str] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)
    mismatch_label_keys: list[str] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)


class WeightedPodAffinityTerm(ApiObject):
    """A weighted pod (anti-)affinity preference (core/v1)."""

    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiObject):
    """Pod affinity or anti-affinity (core/v1 PodAffinity, PodAntiAffinity)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=TERMS_MAX
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=TERMS_MAX
    )


class Affinity(ApiObject):
    """Affinity of the job's pods (core/v1 Affinity)."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(ApiObject):
    """How the job's pods spread over a topology (core/v1 TopologySpreadConstraint)."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=LABEL_KEY_MAX)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(default=None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[str] = Field(default_factory=list, max_length=REQUIREMENTS_MAX)


RESERVED_ENV_PREFIX = "SPOTRL_"
ENV_REFERENCE = "(^|[^$])([$][$])*[$][(]"
"""An unescaped ``$(``: the kubelet would expand ``$(NAME)`` from the container's environment, where
the operator's storage keys are (``envFrom``), so a value could copy them into a name the reward's
process is given. ``$$(`` is the literal, as Kubernetes has it. No backslashes: CEL and Python
read the same pattern."""
"""The operator's own variables (who the pod is, where the cuts go): a job may not set them."""


class KeyRef(ApiObject):
    """A key of a Secret or ConfigMap in the job's namespace, as in the Pod API (core/v1 SecretKeySelector)."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class EnvVarSource(ApiObject):
    """Where an environment variable's value comes from: a Secret's key or a ConfigMap's."""

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None

    rules = (exactly_one("secret_key_ref", "config_map_key_ref"),)


class EnvVar(ApiObject):
    """An environment variable of the job's runtime containers: a value, or a Secret's or ConfigMap's key."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str | None = Field(default=None, max_length=32768)
    value_from: EnvVarSource | None = None

    rules = (
        exactly_one("value", "value_from"),
        Rule(
            cel=f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
            check=lambda e: not e.name.startswith(RESERVED_ENV_PREFIX),
            message=f"names starting with {RESERVED_ENV_PREFIX} are the operator's own; choose another name",
            field="name",
        ),
        Rule(
            cel=f"!has(self.value) || !self.value.matches('{ENV_REFERENCE}')",
            check=lambda e: e.value is None or re.search(ENV_REFERENCE, e.value) is None,
            message="$(NAME) is not expanded here: the kubelet would fill it from the pod's environment, which "
            "holds the operator's variables; write the value itself (or $$( for a literal $()",
            field="value",
        ),
    )


class Scheduling(ApiObject):
    """Where the job's pods may run."""

    image: str | None = Field(default=None, max_length=1024, description="Runtime image; default: the operator's.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Pod tolerations.")
    affinity: Affinity | None = Field(
        default=None,
        description="Pod affinity, as in the Pod API (core/v1 Affinity). The operator ANDs its list of nodes "
        "to avoid (notice, cordon, NotReady) into each required node affinity term.",
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        max_length=16,
        description="How the pods spread over zones or nodes, as in the Pod API (core/v1 TopologySpreadConstraint).",
    )
    scheduler_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The scheduler that places the pods (e.g. a Kueue, Volcano or KAI scheduler); default: the "
        "cluster's.",
    )
    priority_class_name: str | None = Field(default=None, max_length=253, description="Pod priority class.")
    termination_grace_period_seconds: int = Field(
        default=60, ge=1, le=3600, description="Grace period in which the controller cuts on SIGTERM."
    )


class FailureBudget(ApiObject):
    """Crashes a job may have before it fails. Preemptions never count."""

    max_crashes: int = Field(default=3, ge=0, le=1000, description="Controller crashes (non-zero exits) allowed.")
    backoff_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description="Wait before the first retry (a crashed controller; a worker pod that ended); doubles.",
    )
    max_backoff_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Upper bound of the retry wait. A worker pod's wait starts over from backoffSeconds "
        "once the workers ran twice this long after the last wait.",
    )


class Validation(ApiObject):
    """A held-out split scored while the job trains, by the generation workers, between steps."""

    dataset: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "The held-out rows: a URI as dataset.uri takes, read with the job's dataset fields, prompt format and "
            "reward ('builtin:arithmetic' reads its test split)."
        ),
    )
    split: str = Field(
        default="test",
        min_length=1,
        max_length=63,
        description="The split to read (builtin:arithmetic, or a save_to_disk DatasetDict); a single file has one.",
    )
    every_steps: int = Field(default=10, ge=1, le=1_000_000, description="Score the weights of every Nth step.")
    samples: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Completions per prompt: 1 decodes greedily (accuracy); more sample at the job's temperature.",
    )
    limit: int = Field(default=64, ge=1, le=100_000, description="Rows scored per pass (the first, in file order).")


class Environment(ApiObject):
    """Multi-turn episodes: each sample runs as turns against an environment's tools."""

    name: Literal["builtin:calculator", "openenv"] = Field(
        description=(
            "The environment each episode runs against. 'builtin:calculator': one tool, calculator(expression), "
            "exact arithmetic. 'openenv': an OpenEnv environment server at url, one session per episode, the "
            "policy's tool calls sent as its CallToolAction. See docs/guides/agents.md."
        ),
    )
    url: str | None = Field(
        default=None,
        pattern=r"^(https?|wss?)://[^/\s]+(/\S*)?$",
        description=(
            "The OpenEnv server's address (name: openenv), e.g. http://calculator.my-namespace:8000; its WebSocket "
            "session endpoint /ws is used. The job's workers must be able to reach it."
        ),
    )
    max_turns: int = Field(
        default=8,
        ge=1,
        le=256,
        description="Turns an episode generates at most; one that asks for a tool after its last turn ends truncated.",
    )
    max_episode_tokens: int = Field(
        default=2048,
        ge=1,
        description=(
            "An episode's completion at most, generated and observation tokens together; each turn also keeps to "
            "generation.maxNewTokens and, when set, the prompt and the episode to generation.maxModelLen."
        ),
    )
    max_episode_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Wall-clock seconds an episode may run, checked at each turn's end (unset: no limit).",
    )
    tool_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A tool call that has not answered by then gets an error observation, and the episode goes on.",
    )
    tool_parser: Literal["hermes"] = Field(
        default="hermes",
        description=(
            "vLLM's tool-call parser for the policy's chat template: 'hermes' reads Qwen2.5's and Hermes' "
            "<tool_call> JSON blocks."
        ),
    )

    rules = (
        Rule(
            cel="(self.name == 'openenv') == has(self.url)",
            check=lambda e: (e.name == "openenv") == (e.url is not None),
            message="environment.url is the openenv server's address: set it with name openenv, and only then",
            field="url",
        ),
    )


class RLJobSpec(ApiObject):
    """What the user asks for."""

    def validation_dataset(self) -> Dataset:
        """The held-out split as a dataset spec: the job's fields and format, validation's rows."""
        if self.validation is None:
            raise ValueError("spec.validation is not set")
        return self.dataset.model_copy(update={"uri": self.validation.dataset, "split": self.validation.split})

    policy: Policy = Field(description="The model being trained.")
    dataset: Dataset = Field(description="The prompts.")
    reward: Reward = Field(description="How rollouts are scored.")
    training: Training = Field(description="Optimizer steps and hyperparameters.")
    generation: Generation = Field(default_factory=Generation, description="Rollout generation.")
    validation: Validation | None = Field(
        default=None, description="Validation during training: a held-out split scored every N steps (unset: none)."
    )
    environment: Environment | None = Field(
        default=None,
        description=(
            "Multi-turn, tool-using episodes (agents): each sample's turns call the environment's tools and read "
            "their answers until it answers without a call. Unset: one turn a sample."
        ),
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Cuts: where and when.")
    preemption: Preemption = Field(default_factory=Preemption, description="Notices and dropped prompts.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Placement of the pods.")
    failure_budget: FailureBudget = Field(default_factory=FailureBudget, description="Crash retries.")
    runtime_env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Environment variables of every container of the job (controller, trainer and worker pods, and the pod "
            "that deletes its cuts), "
            "each a value or a Secret's or ConfigMap's key in the job's namespace, e.g. HF_TOKEN from a Secret. "
            "Each replaces the operator's variable of the same name (AWS_ENDPOINT_URL ...) and the chart's runtimeEnv; "
            "a name the admin locked (chart value runtimeEnvLocked) is refused."
        ),
    )
    suspend: bool = Field(default=False, description="true: take a barrier cut and stop the pods; false resumes.")
    standby: bool = Field(
        default=False,
        description=(
            "true: keep the next attempt's controller pod warm on another node (imports, Ray, generation "
            "workers and the policy loaded), idle until a preemption or crash makes it the controller. Costs "
            "a second controller pod's resources while idle."
        ),
    )

    rules = (
        Rule(
            cel=(
                "self.generation.backend != 'vllm' || self.generation.workerPods || self.training.resources.gpu == 0 "
                "|| self.generation.resources.gpu > 0"
            ),
            check=lambda s: (
                s.generation.backend != "vllm"
                or s.generation.worker_pods
                or s.training.resources.gpu == 0
                or s.generation.resources.gpu > 0
            ),
            message=(
                "vLLM workers in the controller pod of a GPU job need GPUs of their own beside the trainer's "
                "training.resources.gpu: set generation.resources.gpu to generation.tensorParallelSize (the operator "
                "adds generation.workers times it to the pod's nvidia.com/gpu), or generation.workerPods true"
            ),
            field="generation.resources.gpu",
        ),
        Rule(
            cel=(
                "self.training.parallelism.strategy != 'fsdp' || self.training.parallelism.trainerPods "
                "|| self.training.parallelism.gpusPerRank == 0 "
                "|| self.training.resources.gpu >= self.training.parallelism.ranks"
            ),
            check=lambda s: (
                s.training.parallelism.strategy != "fsdp"
                or s.training.parallelism.trainer_pods
                or s.training.parallelism.gpus_per_rank == 0
                or s.training.resources.gpu >= s.training.parallelism.ranks
            ),
            message=(
                "FSDP ranks in the controller pod train on its GPUs: set training.resources.gpu to at least "
                "training.parallelism.ranks, or trainerPods true"
            ),
            field="training.resources.gpu",
        ),
        Rule(
            cel="!has(self.runtimeEnv) || self.runtimeEnv.all(e, self.runtimeEnv.exists_one(f, f.name == e.name))",
            check=lambda s: len({e.name for e in s.runtime_env}) == len(s.runtime_env),
            message="runtimeEnv names must be unique",
            field="runtimeEnv",
        ),
        Rule(
            # The adapter is received once per worker, but a tensor-parallel engine is one weight
            # channel member per rank: the channel would wait for ranks that never join.
            cel="!has(self.policy.lora) || self.generation.tensorParallelSize == 1",
            check=lambda s: s.policy.lora is None or s.generation.tensor_parallel_size == 1,
            message=(
                "policy.lora needs generation.tensorParallelSize 1 (an adapter is not synced to a worker whose "
                "engine is sharded over several GPUs): set generation.tensorParallelSize to 1 with a base that "
                "fits one GPU per worker, or unset policy.lora to train every weight"
            ),
            field="generation.tensorParallelSize",
        ),
        Rule(
            cel="self.training.microBatchSize <= self.generation.promptsPerStep * self.generation.groupSize",
            check=lambda s: s.training.micro_batch_size <= s.generation.prompts_per_step * s.generation.group_size,
            message=(
                "training.microBatchSize must not exceed generation.promptsPerStep * generation.groupSize "
                "(the rollouts of one step)"
            ),
            field="training.microBatchSize",
        ),
        Rule(
            cel="!has(self.training.miniBatches) || self.training.miniBatches <= self.generation.promptsPerStep",
            check=lambda s: s.training.mini_batches <= s.generation.prompts_per_step,
            message=(
                "training.miniBatches must not exceed generation.promptsPerStep (each mini-batch holds whole "
                "groups, at least one): lower miniBatches or raise promptsPerStep"
            ),
            field="training.miniBatches",
        ),
        Rule(
            cel=(
                "!has(self.training.overlong) || !has(self.training.overlong.softPenalty) || "
                "self.training.overlong.softPenalty.buffer < self.generation.maxNewTokens"
            ),
            check=lambda s: (
                s.training.overlong.soft_penalty is None
                or s.training.overlong.soft_penalty.buffer < s.generation.max_new_tokens
            ),
            message=(
                "training.overlong.softPenalty.buffer must be below generation.maxNewTokens (the penalty starts "
                "buffer tokens before the limit): lower the buffer or raise maxNewTokens"
            ),
            field="training.overlong.softPenalty.buffer",
        ),
        Rule(
            cel="!has(self.training.kl) || !has(self.training.kl.inReward) || !self.training.kl.inReward || "
            "(has(self.training.klCoef) && self.training.klCoef > 0)",
            check=lambda s: not s.training.kl.in_reward or s.training.kl_coef > 0,
            message=(
                "training.kl.inReward needs training.klCoef above 0 (the penalty's weight in the reward): set "
                "klCoef, or unset inReward"
            ),
            field="training.kl.inReward",
        ),
        Rule(
            cel="!has(self.environment) || (has(self.dataset.promptFormat) && self.dataset.promptFormat == 'chat')",
            check=lambda s: s.environment is None or s.dataset.prompt_format == "chat",
            message=(
                "spec.environment needs dataset.promptFormat: chat (observations are written with the policy's chat "
                "template between its turns)"
            ),
            field="environment",
        ),
    )


# ----------------------------------------------------------------------------- status


class Condition(ApiObject):
    """A condition in Kubernetes API conventions."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = Field(default=None, description="RFC 3339 time of the last change.")
    observed_generation: int | None = Field(default=None, ge=0)


class CutRef(ApiObject):
    """A committed cut."""

    id: str = Field(min_length=1)
    step: int = Field(ge=0, description="Steps trained when the cut was taken.")
    uri: str = Field(min_length=1)
    time: str | None = Field(default=None, description="RFC 3339 commit time.")
    kind: Literal["periodic", "barrier"] = "periodic"


class SkippedCut(ApiObject):
    """A committed cut a resume passed over because a byte-level check refused it."""

    id: str = Field(min_length=1)
    check: str = Field(min_length=1, description="The validation check that refused it (file_digest ...).")
    message: str = Field(default="", max_length=2048)


class ResumeStatus(ApiObject):
    """How the current controller started (set by the controller)."""

    attempt: int = Field(ge=0, description="The controller attempt this describes.")
    cut_id: str | None = Field(default=None, description="The cut it resumed from; unset: a new run.")
    skipped: list[SkippedCut] = Field(
        default_factory=list, max_length=64, description="Newer cuts it skipped as damaged (missing or corrupt files)."
    )


class RayHead(ApiObject):
    """Where a controller's Ray cluster accepts nodes of their own: generation worker pods
    (``generation.workerPods``) and trainer pods (``training.parallelism.trainerPods``)."""

    address: str = Field(min_length=1, max_length=253, description="host:port of the Ray head's GCS.")
    attempt: int = Field(ge=1, description="The controller attempt that runs this head.")
    workers: int = Field(
        default=0, ge=0, le=1024, description="Generation worker pods this controller waits for (0: none)."
    )
    trainers: int = Field(
        default=0, ge=0, le=1024, description="Trainer pods this controller waits for, one per rank (0: none)."
    )


EXIT_REFUSED = 3
"""The controller's exit code when the run cannot start from its storage: the store belongs to
another job, a cut fails the validation chain, or ``--resume`` asks for what is not there. The
operator reads it as a configuration error (condition ``StorageRefused``): no crash is counted
and no new controller starts until the spec changes."""

EXIT_RANK_LOST = 5
"""The controller's exit code when a trainer rank (its process, pod or node) was lost without
notice: the operator reads it as a preemption of the trainer group (a new attempt restores
from the newest committed cut), not as a crash."""


class BarrierStatus(ApiObject):
    """The barrier the operator asked for (request) and what the controller did (answer)."""

    request_id: str = Field(min_length=1, description="Names one request; the controller answers for this id only.")
    reason: str = Field(default="", description="Why: the signal that caused it.")
    node: str | None = Field(default=None, description="The node that is going away.")
    requested_at: str | None = None
    deadline: str | None = Field(default=None, description="RFC 3339 time by which the cut must commit.")
    attempt: int | None = Field(
        default=None, ge=1, description="The controller attempt the request is for; any other attempt ignores it."
    )
    state: Literal["Requested", "Committed", "Missed", "Failed"] = "Requested"
    cut_id: str | None = None
    committed_at: str | None = None
    message: str | None = Field(default=None, description="Why the barrier failed (set by the controller).")
    handled: bool | None = Field(
        default=None, description="true once the operator has acted on the answer (set by the operator)."
    )


class RecoveryMarks(ApiObject):
    """The operator's marks of the recovery in progress (kept here because ``status.barrier``
    is cleared when the next attempt starts); composed into ``lastRecovery`` at that attempt's
    first trained step."""

    attempt: int = Field(ge=0, description="The attempt that was interrupted.")
    notice_at: str | None = Field(default=None, description="When the notice began (its own time, else first seen).")
    requested_at: str | None = Field(default=None, description="When the barrier was requested.")
    committed_at: str | None = Field(default=None, description="When the barrier cut committed.")
    interrupted_at: str | None = Field(default=None, description="When the operator saw the attempt's work stop.")
    pod_deleted_at: str | None = Field(
        default=None,
        description="When the old controller pod was seen deleted: being deleted, after a committed barrier (the fresh "
        "controller does not wait for it to exit); else gone.",
    )
    standby: bool = Field(
        default=False, description="The next attempt is the warm standby (spec.standby): no pod is scheduled for it."
    )


class AttemptTimes(ApiObject):
    """When the current controller reached each point of its start (set by the controller)."""

    attempt: int = Field(ge=0, description="The controller attempt these times are of.")
    started_at: str | None = Field(default=None, description="When its process started.")
    restored_at: str | None = Field(default=None, description="When the run was restored (or started from scratch).")
    ready_at: str | None = Field(default=None, description="When generation was up, weights loaded: ready to train.")
    first_step_at: str | None = Field(default=None, description="When it trained its first step.")
    cut_form: Literal["full", "delta"] | None = Field(
        default=None, description="What the cut it resumed from held; unset: a new run."
    )
    steps_redone: int = Field(
        default=0, ge=0, description="Steps of a delta cut trained again from their rows while restoring."
    )


class RecoveryPhases(ApiObject):
    """Seconds spent in each phase of one recovery, in order; unset: not measured (no barrier
    after an abrupt loss, or a time missing)."""

    notice_to_requested: float | None = Field(default=None, description="1. notice -> barrier requested.")
    requested_to_committed: float | None = Field(default=None, description="2. barrier requested -> cut committed.")
    committed_to_deleted: float | None = Field(
        default=None,
        description="3. committed (abrupt loss: interruption seen) -> old controller pod deleted (being deleted, "
        "after a committed barrier; else gone).",
    )
    deleted_to_scheduled: float | None = Field(
        default=None, description="Between 3 and 4: the fresh pod created and scheduled."
    )
    scheduled_to_started: float | None = Field(
        default=None, description="4. fresh pod scheduled -> controller process started."
    )
    started_to_restored: float | None = Field(default=None, description="5. process started -> cut restored.")
    restored_to_ready: float | None = Field(default=None, description="6. cut restored -> generation ready.")
    ready_to_first_step: float | None = Field(default=None, description="7. generation ready -> first trained step.")


class LastRecovery(ApiObject):
    """The newest recovery from a preemption, phase by phase (set by the operator once the new
    attempt has trained its first step)."""

    attempt: int = Field(ge=1, description="The attempt that recovered.")
    kind: Literal["barrier", "abrupt"] = Field(
        default="barrier", description="barrier: a barrier cut committed; abrupt: resumed from an older cut."
    )
    notice_at: str | None = None
    requested_at: str | None = None
    committed_at: str | None = None
    interrupted_at: str | None = None
    pod_deleted_at: str | None = None
    scheduled_at: str | None = None
    started_at: str | None = None
    restored_at: str | None = None
    ready_at: str | None = None
    first_step_at: str | None = None
    phases: RecoveryPhases = Field(default_factory=RecoveryPhases, description="Seconds per phase.")
    total_seconds: float | None = Field(
        default=None, ge=0, description="From the notice (or the interruption) to the first trained step."
    )
    seconds_lost: float | None = Field(
        default=None, ge=0, description="What this preemption added to secondsLost (retraining included)."
    )
    standby: bool = Field(
        default=False,
        description="true: the warm standby controller (spec.standby) took over; its pod was scheduled before the "
        "recovery began, so scheduledAt and the scheduling phases are left out, and startedAt is when it saw its "
        "attempt.",
    )
    cut_form: Literal["full", "delta"] | None = Field(
        default=None,
        description="full: the cut it resumed from held the weights; delta: the rows trained since a full cut, "
        "redone while restoring (stepsRedone).",
    )
    steps_redone: int = Field(default=0, ge=0, description="Steps of a delta cut trained again while restoring.")


class Accounting(ApiObject):
    """Exactly-once, over the whole run, computed from the audit and the restore records in
    storage (set by the controller; ``spotrl audit --summary`` prints the same numbers)."""

    prompts_trained: int = Field(default=0, ge=0, description="Prompts in the effective stream.")
    prompts_dropped: int = Field(default=0, ge=0, description="Prompts given up on (generation failed), by policy.")
    prompts_filtered: int = Field(
        default=0,
        ge=0,
        description="Prompts set aside on purpose, never trained: longer than generation.maxModelLen leaves for "
        "maxNewTokens (filtered at admission), or a group without signal under training.sampling.dynamic; the "
        "audit keeps each one's reason.",
    )
    prompts_lost: int = Field(
        default=0, ge=0, description="Prompts trained by an attempt whose step was superseded and never trained again."
    )
    prompts_trained_twice: int = Field(
        default=0, ge=0, description="Prompts (group ids) in more than one step of the effective stream."
    )
    steps_missing: int = Field(default=0, ge=0, description="Steps below the newest one with no audit record.")
    steps_retrained: int = Field(default=0, ge=0, description="Steps trained again after an abrupt loss.")
    groups_redispatched: int = Field(
        default=0, ge=0, description="Unfinished groups restored from cuts and dispatched again, all restores."
    )
    siblings_reused: int = Field(
        default=0, ge=0, description="Finished sibling rollouts of restored groups kept, not generated again."
    )
    turns_restored: int = Field(
        default=0,
        ge=0,
        description="Finished turns of unfinished episodes (spec.environment) found in cuts: each resumes from "
        "its last finished turn, not generated again, unless its environment does not replay "
        "(spotrl_episodes_restarted_total).",
    )
    restores: int = Field(default=0, ge=0, description="Attempts that resumed from a cut.")
    steps_redone: int = Field(
        default=0,
        ge=0,
        description="Steps of delta cuts trained again from their rows while restoring (not retrained: no new "
        "audit record, the same prompts).",
    )
    seconds_lost_per_preemption: list[float] = Field(
        default_factory=list,
        max_length=64,
        description="Per resumed attempt (newest 64): from the cut it resumed from to its first trained step.",
    )


class CutEstimateStatus(ApiObject):
    """How long a barrier cut would take now, estimated by the controller from its last cuts
    (:mod:`spotrl_runtime.core.cut_estimate`); the operator compares it with the shortest
    barrier window (condition ``BarrierAtRisk``)."""

    seconds: float = Field(ge=0, description="Predicted seconds of a barrier cut, request to commit.")
    bytes: int = Field(ge=0, description="The newest cut's size: what a barrier would write now.")
    bytes_per_second: float = Field(ge=0, description="The store's throughput over the recent cuts.")
    overhead_seconds: float = Field(
        default=0.0, ge=0, description="The largest fixed part of a recent cut (all but writing its files)."
    )
    based_on_cuts: int = Field(ge=1, description="Recent cuts the estimate is made from.")
    step_seconds: float | None = Field(
        default=None, ge=0, description="Wall seconds per optimizer step between the recent cuts."
    )
    attempt: int | None = Field(default=None, ge=0, description="The controller attempt that made it.")


class LearningSignalStatus(ApiObject):
    """Whether the run's steps train anything (set by the controller after each step; the
    operator turns it into condition ``NoLearningSignal``)."""

    steps_without_signal: int = Field(
        ge=0, description="Steps in a row in which every group's rollouts had equal rewards (nothing was trained)."
    )
    threshold: int = Field(ge=1, description="Steps in a row after which the run is said to learn nothing.")
    step: int = Field(ge=0, description="The step this was measured at.")
    reward_mean: float = Field(description="That step's mean reward.")


class PodPlacement(ApiObject):
    """What Kueue's admission adds to the pods of one pod set: its ResourceFlavors' node labels
    (a nodeSelector) and tolerations."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="The assigned flavors' nodeLabels.")
    tolerations: list[Toleration] = Field(default_factory=list, description="The assigned flavors' tolerations.")


class QueueEviction(ApiObject):
    """One eviction by Kueue, and the barrier cut that answered it."""

    reason: str = Field(description="The Workload's Evicted reason: Preempted, InactiveWorkload, Deactivated...")
    message: str = Field(default="", max_length=2048)
    at: str = Field(description="When Kueue evicted the Workload (its Evicted condition's lastTransitionTime).")
    barrier: str | None = Field(default=None, description="The barrier's request id.")
    cut_id: str | None = Field(default=None, description="The cut the barrier committed, if it did.")
    released_at: str | None = Field(
        default=None,
        description="When the operator gave the quota back (the pods gone, the cut committed or given up).",
    )


class QueueStatus(ApiObject):
    """The job's place in Kueue (label ``kueue.x-k8s.io/queue-name``; set by the operator)."""

    name: str = Field(description="The LocalQueue (the label's value).")
    workload: str | None = Field(default=None, description="The job's Kueue Workload.")
    cluster_queue: str | None = Field(default=None, description="The ClusterQueue that admitted it, while admitted.")
    admitted: bool = Field(default=False, description="Kueue admitted the Workload and has not evicted it.")
    flavors: dict[str, list[str]] = Field(
        default_factory=dict, description="Per pod set, the ResourceFlavors of the admission."
    )
    placement: dict[str, PodPlacement] = Field(
        default_factory=dict, description="Per pod set, what the admission adds to its pods."
    )
    evictions: int = Field(default=0, ge=0, description="Evictions by Kueue, each answered with a barrier.")
    last_eviction: QueueEviction | None = None


JobPhase = Literal["Pending", "Queued", "Running", "Checkpointing", "Rescheduling", "Suspended", "Succeeded", "Failed"]


class RLJobStatus(ApiObject):
    """What the operator and the job's controller report."""

    phase: JobPhase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = Field(default=None, ge=0)
    step: int | None = Field(default=None, ge=0, description="Optimizer steps trained.")
    total_steps: int | None = Field(default=None, ge=0)
    last_cut: CutRef | None = None
    barrier: BarrierStatus | None = None
    preemptions: int = Field(default=0, ge=0, description="Preemptions survived.")
    restarts: int = Field(default=0, ge=0, description="Controller restarts after crashes.")
    seconds_lost: float = Field(default=0.0, ge=0, description="Wall time preemptions cost, retraining included.")
    controller_pod: str | None = None
    controller_node: str | None = None
    attempt: int = Field(default=0, ge=0, description="Controller incarnation; grows with every restart.")
    step_attempt: int | None = Field(
        default=None, ge=0, description="The controller attempt that reported `step` (set by the controller)."
    )
    interrupted_at: str | None = Field(
        default=None,
        description="Where the work lost to the current interruption starts (the newest cut, or when the "
        "controller began training if later); cleared at the next trained step.",
    )
    interrupted_attempt: int | None = Field(
        default=None, ge=0, description="The attempt that was interrupted; a later attempt's first step ends it."
    )
    training_since: str | None = Field(
        default=None, description="When the current controller was created (attempt 1) or trained its first step."
    )
    retry_after: str | None = Field(default=None, description="Crash backoff: no new controller before this time.")
    refused_generation: int | None = Field(
        default=None,
        ge=0,
        description="The spec generation whose controller refused its storage (exit 3: another job's store, a cut "
        "that fails the validation chain); no controller starts until the spec changes.",
    )
    ray_head: RayHead | None = Field(
        default=None, description="The current controller's Ray head, for worker pods (set by the controller)."
    )
    resume: ResumeStatus | None = Field(
        default=None, description="Which cut the current controller resumed from, and which it skipped."
    )
    workers_ready: int | None = Field(
        default=None, ge=0, description="Worker pods of the current attempt that run (generation.workerPods)."
    )
    worker_restarts: int = Field(
        default=0, ge=0, description="Worker pods of the current attempt that ended by themselves and were replaced."
    )
    worker_retry_after: str | None = Field(
        default=None, description="Worker backoff: no replacement worker pod before this time."
    )
    worker_backoff_seconds: int | None = Field(
        default=None,
        ge=0,
        description="Length of the last worker backoff; the next doubles it unless the workers ran "
        "for twice failureBudget.maxBackoffSeconds after it ended.",
    )
    trainers_ready: int | None = Field(
        default=None,
        ge=0,
        description="Trainer pods of the current attempt that run (training.parallelism.trainerPods).",
    )
    standby_pod: str | None = Field(
        default=None,
        description="The warm standby controller's pod (spec.standby), from its creation until it goes or takes over.",
    )
    standby_failed_attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt during which a standby pod failed by itself: no other standby is made "
        "until the next attempt (the Event StandbyFailed says why).",
    )
    trainers_attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt whose trainer pods have all been created and seen: one of them that goes "
        "is not created again (the controller exits with code 5 and the next attempt gets new ones).",
    )
    recovering: RecoveryMarks | None = Field(
        default=None, description="The recovery in progress: the operator's marks (set by the operator)."
    )
    attempt_times: AttemptTimes | None = Field(
        default=None, description="The current controller's start, phase by phase (set by the controller)."
    )
    last_recovery: LastRecovery | None = Field(
        default=None, description="The newest recovery from a preemption, phase by phase, in seconds."
    )
    accounting: Accounting | None = Field(
        default=None, description="Exactly-once over the whole run, from the audit (set by the controller)."
    )
    cut_estimate: CutEstimateStatus | None = Field(
        default=None, description="A barrier cut's estimated seconds, from the last cuts (set by the controller)."
    )
    learning_signal: LearningSignalStatus | None = Field(
        default=None, description="Whether the steps train anything (set by the controller after each step)."
    )
    queue: QueueStatus | None = Field(
        default=None,
        description="Kueue: the LocalQueue, the Workload, its admission and evictions (set by the operator).",
    )
    message: str | None = None


# ------------------------------------------------------------------------- parsing


class SpecError(ValueError):
    """An RLJob that cannot be accepted. ``problems`` holds (field path, what is allowed)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("invalid RLJob:\n" + "\n".join(f"  {path}: {msg}" for path, msg in problems))


def _alias_path(model: type[ApiObject], loc: tuple[Any, ...]) -> str:
    """Turns a pydantic error location (python names) into the camelCase field path."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
            continue
        parts.append(str(item))
    return ".".join(parts)


def _problems(err: ValidationError, prefix: str) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        path = ".".join(p for p in (prefix, _alias_path(RLJobSpec, tuple(e["loc"]))) if p)
        if e["type"] == "rljob_rule":
            path = f"{path}.{e['ctx']['field']}" if path else e["ctx"]["field"]
        elif e["type"] == "extra_forbidden":
            out.append((path, "unknown field; check its spelling against `kubectl explain rljob.spec`"))
            continue
        out.append((path, e["msg"]))
    return out


def parse_spec(spec: Any) -> RLJobSpec:
    """Validates a spec mapping (camelCase). Raises :class:`SpecError` naming each bad field."""
    try:
        return RLJobSpec.model_validate(spec)
    except ValidationError as err:
        raise SpecError(_problems(err, "spec")) from None


def read_stored_spec(spec: Any) -> tuple[RLJobSpec, list[str]]:
    """A spec as the API server stores it, which a newer CRD may have given fields this version
    does not know (it defaults its new fields into every stored RLJob): those are skipped, and
    returned as ``spec.``-prefixed paths for the reader to report. Any other problem raises
    :class:`SpecError`, as :func:`parse_spec` does."""
    if not isinstance(spec, dict):
        return parse_spec(spec), []
    try:
        model, skipped = ignoring_unknown(RLJobSpec, spec)
    except ValidationError as err:
        raise SpecError(_problems(err, "spec")) from None
    return model, [f"spec.{p}" for p in skipped]


class RLJob(ApiObject):
    """A whole RLJob document (the parts SpotRL reads)."""

    model_config = ApiObject.model_config | {"extra": "ignore"}

    api_version: str
    kind: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLJobSpec
    status: RLJobStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", "default"))


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and len(name) <= NAME_MAX and re.fullmatch(NAME, name) is not None


def _document_problems(doc: Any) -> list[tuple[str, str]]:
    """What is wrong with a document's envelope (apiVersion, kind, metadata, a spec at all)."""
    if not isinstance(doc, dict):
        return [("", "an RLJob document must be a mapping")]
    problems: list[tuple[str, str]] = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(("apiVersion", f"must be {API_VERSION!r}"))
    if doc.get("kind") != KIND:
        problems.append(("kind", f"must be {KIND!r}"))
    if "spec" not in doc:
        problems.append(("spec", "Field required"))
    metadata = doc.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        problems.append(("metadata", "must be a mapping"))
    elif metadata and "name" in metadata and not _valid_name(metadata["name"]):
        problems.append(
            (
                "metadata.name",
                f"{metadata['name']!r} is not a valid name: use at most {NAME_MAX} lowercase letters, digits, "
                "'-' and '.', starting and ending with a letter or digit (a DNS-1123 subdomain, as Kubernetes)",
            )
        )
    return problems


def parse_rljob(doc: Any) -> RLJob:
    """Validates a whole RLJob document (as `kubectl apply` would send it)."""
    problems = _document_problems(doc)
    if problems:
        raise SpecError(problems)
    try:
        return RLJob.model_validate(doc)
    except ValidationError as err:
        raise SpecError(_problems(err, "")) from None


def read_stored_rljob(doc: Any) -> tuple[RLJob, list[str]]:
    """An RLJob as the API server stores it, read by a version that may be older than the CRD or
    the operator that wrote it: the spec by :func:`read_stored_spec`, the status leniently
    (:mod:`~spotrl_runtime.api.lenient`). Returns the job and the dotted paths it skipped."""
    problems = _document_problems(doc)
    if problems:
        raise SpecError(problems)
    spec, skipped = read_stored_spec(doc["spec"])
    stored_status = doc.get("status")
    status, _, dropped = read_leniently(RLJobStatus, stored_status if isinstance(stored_status, dict) else {})
    job = RLJob(
        api_version=doc["apiVersion"],
        kind=doc["kind"],
        metadata=doc.get("metadata") or {},
        spec=spec,
        status=status if stored_status else None,
    )
    return job, [*skipped, *(f"status.{p}" for p in dropped)]
