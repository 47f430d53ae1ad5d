"""`parity train`'s typed config: one dataclass per section, the estimator's values filled in, every
key checked before any work (the error names the key and the expected form). `TrainConfig` is what
`config.yaml` holds; `rl/loop.py` runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from parity import config as config_mod
from parity.config import ConfigError, check_range, one_of
from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.lora import TARGETS, LoRAConfig
from parity.engines.models.io import AGENT_DIR, BUILTIN_DIR, SHIPPED_MODELS
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import CHAT_TEMPLATE_MODES
from parity.engines.trainer import OptimConfig
from parity.files import regular_file_problem
from parity.rl.algorithms import ESTIMATORS, AlgorithmConfig
from parity.rl.problems import DIFFICULTIES, MAX_PROBLEMS
from parity.rl.rewards import IN_PROCESS_TIMEOUT_S, WORKER_START_S
from parity.rl.tasks import TASKS, difficulty_has_no_effect

# trainer.micro_batch_tokens when unset, per device.
MICRO_BATCH_TOKENS = {"cpu": 8192, "cuda": 16384}
# Keys `parity train --resume RUN key=value` may change: how long and how often, never what is trained (the
# bounds on your code in the training process stop a run, or refuse it, and never change a score).
# The learner count changes only how the gradient's sum is split (round-off): sharded checkpoints reshard.
# So do the trainer's memory keys, for a run resumed after it ran out of memory: they change how the
# gradient's sums are grouped, not what is trained.
# Data paths may change too (the same data moved, or the run resumed from another folder): the data order
# is a position in the file's rows. So may where a distributed run's processes run and how long it waits for
# them: a run stopped by restart_timeout_s is told to raise it, and a cluster may come back at another address.
RESUMABLE_KEYS = (
    "steps",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "log.to",
    "log.completions",
    "distributed.learners",
    "distributed.address",
    "distributed.restart_timeout_s",
    "distributed.connect_timeout_s",
    "trainer.micro_batch_tokens",
    "trainer.activation_checkpointing",
    "trainer.chunked_head",
    "task.data",
    "eval.data",
    "reward.import_timeout_s",
    "reward.in_process_timeout_s",
)
LR_SCHEDULES = ("constant", "linear", "cosine")
CHUNKED_HEAD_MODES = {"auto": "auto", "always": True, "never": False}  # trainer.chunked_head -> CausalLM.chunked_head
COMPLETION_FORMATS = ("text", "messages", "auto")  # task.completion_format (`rl/reward_fns.py`)
TOOL_FORMATS = ("auto", "hermes", "llama3", "mistral", "gemma")  # episode.tool_format (`engines/turns.py`)
MAX_TURNS = 100
TRACKERS = ("wandb", "trackio", "mlflow")

# ----------------------------------------------------------------------------- config


@dataclass
class RolloutSection:
    precision: str | None = None  # overrides `precision` for the rollout engine
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 96
    group_size: int = 8


@dataclass
class TrainerSection(OptimConfig):
    """`trainer.*`: the trainer's own config (`OptimConfig`: AdamW, the clip, FP16's loss scaler) and the
    run's use of it."""

    precision: str | None = None  # overrides `precision` for the trainer
    lr: float | None = None  # unset: 2e-4 on the built-in model; on any other 1e-6, or 1e-5 with LoRA
    # The learning rate over the run: constant, or down to 0 at the last step, linearly or along a cosine,
    # after `warmup_steps` steps rising linearly from 0 (trainer/lr logs it every step)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # Tokens per forward/backward (a prompt counted once per micro-batch, less the prefix it shares with one
    # before it there; responses in full); unset: 8,192 on the CPU, 16,384 on CUDA (large enough for the
    # matmuls to fill the GPU).
    micro_batch_tokens: int | None = None
    # Keep only each decoder layer's input through the forward and recompute the layer in the
    # backward: activation memory of one layer instead of all, for about one more forward.
    activation_checkpointing: bool = False
    # The LM head a chunk of rows at a time with its log-probabilities, forward and backward: no [tokens,
    # vocabulary] tensor, for one more pass of the head's matmul. auto | always | never; auto: where one
    # micro-batch's head would take more than 512 MiB.
    chunked_head: str = "auto"


@dataclass
class TaskSection:
    name: str = "builtin"  # the reward: builtin | length | exact | math | number | lookup (the tool task)
    # builtin (generated problems: word problems for name=number, else arithmetic) or a JSONL/Parquet file
    data: str = "builtin"
    num_problems: int = 1024  # size of the generated builtin dataset
    difficulty: str = "standard"  # name=number's generated word problems: standard | easy | worked
    # Reward functions of your own, module:function each (a list, or comma-separated); they replace `name`'s
    # reward. Batched fn(prompts, completions, **columns) -> list, or per sample fn(prompt, completion,
    # **columns) -> float (docs/your-task.md)
    reward_fn: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)  # one per reward_fn: the weighted sum; empty: 1 each
    prompt_column: str = "prompt"  # the data's column holding the prompt
    answer_column: str = "answer"  # ... and the reference answer (needed by the built-in rewards only)
    chat_template: str = "auto"  # auto (the model's chat template, when it has one) | none (raw text)
    # How your reward functions get each completion: text (a string) | messages (TRL's chat form,
    # [{"role": "assistant", "content": text}]) | auto (messages when the prompt is chat messages, as TRL does)
    completion_format: str = "text"
    # Episodes of several model turns (docs/agents.md): an environment class of your own, module:Class or
    # file.py:Class, made once per episode; or tools, module:function each, called when the model asks
    environment: str = ""
    tools: list[str] = field(default_factory=list)


@dataclass
class RewardSection:
    timeout_s: float = 5.0  # per call in a worker process: past it the call scores 0 and the worker is replaced
    # Your code in the training process, which no worker's kill can bound: a reward module's import may take
    # import_timeout_s (the run is then refused), a call of a reward run there in_process_timeout_s (the run
    # then stops)
    import_timeout_s: float = WORKER_START_S  # as long as a reward worker has to start and import them
    in_process_timeout_s: float = IN_PROCESS_TIMEOUT_S
    strict: bool = False  # a failing reward stops the run instead of scoring 0
    isolate: str = "auto"  # auto (user/math rewards in a worker process) | always | never
    warn_error_rate: float = 0.1  # warn when this share of a step's rewards failed or timed out
    max_failed_steps: int = 3  # stop after this many consecutive steps where every reward failed; 0 = never


@dataclass
class LogSection:
    # Trackers that receive every step's metrics besides metrics.jsonl and TensorBoard (`tensorboard`),
    # through their own libraries (installed separately): wandb, trackio, mlflow. Offline where the library
    # allows it: WANDB_MODE=offline, MLFLOW_TRACKING_URI=file:..., trackio's local store.
    to: list[str] = field(default_factory=list)
    project: str = "parity"  # the tracker's project (wandb, trackio) or experiment (mlflow)
    # Completions of each step printed as a table with their rewards (that many rows; 0 = none); every
    # completion of the step is written to completions/step_N.jsonl either way
    completions: int = 4


@dataclass
class HealthSection:
    alarm_window: int = 20  # steps; the rule is in docs/training.md
    alarm_factor: float = 4.0
    on_alarm: str = "warn"  # warn | checkpoint (save, go on) | stop (save, end the run)
    # FP16: stop after this many consecutive steps whose every update the loss scaler skipped.
    # (FP32/BF16 have no scaler: a non-finite loss or gradient stops the run at once.)
    max_skipped_steps: int = 10


@dataclass
class EvalSection:
    """Held-out evaluation by the rollout engine, and the deployment gap (docs/deployment.md)."""

    every: int = 10  # steps between evaluations, and one after the last step; 0 = after the last only; -1 = never
    # auto: the task's held-out split when Parity generates its problems (task.name builtin or number, or
    # task.data=builtin), without the problems trained on; or a JSONL/Parquet file as task.data reads
    data: str = "auto"
    num_prompts: int = 32
    samples: int = 4  # responses per prompt: eval/pass@k's k
    temperature: float = 1.0  # 0 = greedy
    max_new_tokens: int | None = None  # unset: rollout.max_new_tokens
    # Serving precisions to evaluate the same weights under, beside the trainer's policy: eval/<p>/*,
    # deploy/gap_<p>, deploy/kl_<p>. Empty: the run's own rollout engine only.
    precisions: list[str] = field(default_factory=list)


@dataclass
class EpisodeSection:
    """`episode.*`: the limits of an episode (task.environment or task.tools); rollout.max_new_tokens bounds
    all its tokens after the first prompt, the fed ones included."""

    max_turns: int = 4  # model turns; the episode is cut off after the last
    turn_tokens: int | None = None  # tokens of one model turn; unset: rollout.max_new_tokens
    tool_timeout_s: float = 10.0  # per tool call (past it the model reads that it timed out), per environment step
    # The tool-call format the model's output is parsed in: auto (from the chat template) | hermes | llama3 |
    # mistral | gemma
    tool_format: str = "auto"
    # Count, every step, the sampled tokens a pipeline that re-tokenizes the conversation would get wrong
    # (retokenization/* metrics; tokenization only, no forward)
    retokenization: bool = True
    # ... and the log-probability what such a pipeline trains in their place carries (one more forward, of
    # the episodes that drift)
    retokenization_logprob: bool = False

    def given(self) -> list[str]:
        """The keys set to other than their defaults, as `episode.KEY=VALUE`: settings that need episodes."""
        fields = dataclasses.fields(self)
        return [f"episode.{f.name}={getattr(self, f.name)}" for f in fields if getattr(self, f.name) != f.default]


@dataclass
class DiagnosticsSection:
    # Positions per step where the rollout engine's whole next-token distribution is compared with the
    # trainer's (full_vocab/* metrics; in exact mode they must be the same bits); 0 = off.
    full_vocab_positions: int = 32


@dataclass
class DistributedSection:
    """Rollout workers (Ray actors) and learners (torch.distributed, FSDP2). Both at their
    defaults (0 workers, 1 learner): one process, no Ray."""

    rollout_workers: int = 0
    learners: int = 1
    address: str = ""  # "" starts a local Ray cluster for the run; "auto" or host:port joins one
    threads: int = 0  # torch threads per worker and learner process; 0 = cores / processes (at least 1)
    # How long a dead rollout worker may take to come back while Ray reports it restarting (a
    # busy machine is slow to start one); a worker Ray gives up on stops the run at once.
    restart_timeout_s: float = 900.0
    # How long joining a user's cluster (`address`) may take before the run is refused in one line: a join
    # to an address where no cluster answers would otherwise wait for ever (Ray's own client retries).
    connect_timeout_s: float = 30.0


@dataclass
class MoESection:
    # The trainer (π_old and π_θ) uses the experts the rollout engine chose for each token, so
    # the routing mismatch (moe/routing_mismatch) does not enter the log-probabilities.
    routing_replay: bool = False


@dataclass
class LoRASection:
    """Low-rank adapters on a frozen base (docs/training.md, "LoRA"). rank 0: full fine-tuning."""

    rank: int = 0
    alpha: float | None = None  # unset: 2 x rank (each adapter's update is scaled by alpha / rank)
    targets: list[str] = field(default_factory=lambda: list(TARGETS))  # the projections adapted
    # true: the rollout engine gets W + scale·B·A each sync; false: it keeps the base and applies the
    # adapters unmerged, as the trainer does (docs/real-models.md measures both)
    merge: bool = True


@dataclass
class AsyncSection:
    max_staleness: int = 0  # policy versions a sample may lag the learners; 0 = synchronous, on-policy
    # Partial rollouts: N >= 2 lets a worker end a request once enough prompt groups are complete and
    # continue the unfinished responses in its next request, on the weights it then holds; one response
    # spans at most N weight versions (a token is at most max_staleness + N - 1 versions old). 0 = off.
    partial_rollouts: int = 0

    @property
    def max_token_staleness(self) -> int:
        """How many versions older than the learners' a trained token may be."""
        return self.max_staleness + max(self.partial_rollouts - 1, 0)


def default_lr(model: str, lora: bool) -> float:
    """`trainer.lr` when unset. The built-in 0.8M model learns its task at 2e-4, the built-in agent model
    its tool task at 3e-4 (docs/agents.md); a pretrained model takes the RL fine-tuning norm (TRL's GRPO
    default, the research's scripts) of 1e-6, and ten times that with LoRA, whose low-rank updates need a
    larger step for the same change."""
    if model == "builtin" or Path(model).expanduser().resolve() == BUILTIN_DIR.resolve():
        return 2e-4
    if model == "builtin-agent" or Path(model).expanduser().resolve() == AGENT_DIR.resolve():
        return 3e-4
    return 1e-5 if lora else 1e-6


MAX_SEED = 2**32 - 1  # the seeds are scaled and offset (`RunParts.rollout_seed`) and must stay within torch's int64
# Steps, and the counts of steps: far past any fine-tuning run (11 days at a step a second), and within what
# keeps each step's rollout seed (`seed * 1,000,003 + step`) apart from the next seed's.
MAX_STEPS = 1_000_000
# Passes over a step's samples: each is a full update of the batch (ppo_epochs x num_minibatches optimizer
# steps); PPO takes a few, and past this a step costs a hundred updates on the same samples.
MAX_PPO_EPOCHS = 100
MAX_WAIT_S = 86400  # timeouts: a day; far past it, the waits' own clocks overflow (a 1e10 s reward timeout crashed)
CORES = os.cpu_count() or 1

# Every numeric key and its range (floats are already finite, integers 64-bit: `config._coerce`). A count
# that sizes memory (rows, positions, ranks) is checked against the machine where the model's sizes are
# known (`engines.budget`, `engines.lora.check_lora`); a count of steps or updates, which sets how long a
# run takes, is at most MAX_STEPS.
NUMERIC_RANGES = (
    ("trainer.lr", lambda v: v > 0, "> 0"),
    ("trainer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("trainer.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer.eps", lambda v: v > 0, "> 0"),
    ("trainer.grad_clip", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("trainer.loss_scale_init", lambda v: v >= 1, ">= 1 (the scaler's floor)"),
    ("trainer.loss_scale_growth_interval", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS:,}]"),
    ("trainer.micro_batch_tokens", lambda v: v >= 1, ">= 1"),
    ("trainer.warmup_steps", lambda v: 0 <= v <= MAX_STEPS, f"in [0, {MAX_STEPS:,}]"),
    ("log.completions", lambda v: 0 <= v <= MAX_PROBLEMS, f"in [0, {MAX_PROBLEMS:,}] (0 = print none)"),
    ("reward.timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("episode.tool_timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("episode.max_turns", lambda v: 1 <= v <= MAX_TURNS, f"in [1, {MAX_TURNS}]"),
    ("reward.import_timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("reward.in_process_timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("reward.warn_error_rate", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("reward.max_failed_steps", lambda v: 0 <= v <= MAX_STEPS, f"in [0, {MAX_STEPS:,}] (0 = never stop)"),
    ("health.alarm_window", lambda v: 2 <= v <= MAX_STEPS, f"in [2, {MAX_STEPS:,}]"),
    ("health.alarm_factor", lambda v: v >= 0, ">= 0"),
    ("health.max_skipped_steps", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS:,}]"),
    ("steps", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS:,}]"),
    ("seed", lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("rollout.group_size", lambda v: v >= 1, ">= 1"),
    ("algorithm.ppo_epochs", lambda v: 1 <= v <= MAX_PPO_EPOCHS, f"in [1, {MAX_PPO_EPOCHS}]"),
    ("algorithm.num_minibatches", lambda v: v >= 1, ">= 1"),
    ("algorithm.kl_coef", lambda v: v >= 0, ">= 0 (0 = no KL loss)"),
    ("keep_checkpoints", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS:,}]"),
    ("checkpoint_every", lambda v: -1 <= v <= MAX_STEPS, f"in [-1, {MAX_STEPS:,}] (-1 = never)"),
    ("task.num_problems", lambda v: 1 <= v <= MAX_PROBLEMS, f"in [1, {MAX_PROBLEMS:,}] (each one is generated)"),
    ("distributed.rollout_workers", lambda v: v >= 0, ">= 0 (0 = sample in this process)"),
    ("distributed.learners", lambda v: v >= 1, ">= 1"),
    ("distributed.threads", lambda v: 0 <= v <= CORES, f"in [0, {CORES}] (this machine's cores; 0 = share them)"),
    ("distributed.restart_timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("distributed.connect_timeout_s", lambda v: 0 < v <= MAX_WAIT_S, f"in (0, {MAX_WAIT_S}] seconds"),
    ("async.max_staleness", lambda v: 0 <= v <= MAX_STEPS, f"in [0, {MAX_STEPS:,}] (0 = synchronous)"),
    (
        "async.partial_rollouts",
        lambda v: v == 0 or 2 <= v <= MAX_STEPS,
        f"0 (off) or in [2, {MAX_STEPS:,}] (weight versions one response may span)",
    ),
    ("lora.rank", lambda v: v >= 0, ">= 0 (0 = off: full fine-tuning)"),
    ("diagnostics.full_vocab_positions", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("eval.every", lambda v: -1 <= v <= MAX_STEPS, f"in [-1, {MAX_STEPS:,}] (0 = after the last step, -1 = never)"),
    ("eval.num_prompts", lambda v: 1 <= v <= MAX_PROBLEMS, f"in [1, {MAX_PROBLEMS:,}]"),
    ("eval.samples", lambda v: v >= 1, ">= 1"),
    ("eval.temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
)


# TRL's GRPOConfig names and the Parity key each one maps onto (`rl/trl_config.py` maps their values): an
# unknown key that is one of them is answered with its key ("did you mean rollout.group_size (TRL's
# num_generations)?").
TRL_KEYS = {
    "num_generations": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "learning_rate": "trainer.lr",
    "lr_scheduler_type": "trainer.lr_schedule",
    "warmup_steps": "trainer.warmup_steps",
    "warmup_ratio": "trainer.warmup_steps",
    "weight_decay": "trainer.weight_decay",
    "adam_beta1": "trainer.beta1",
    "adam_beta2": "trainer.beta2",
    "adam_epsilon": "trainer.eps",
    "max_grad_norm": "trainer.grad_clip",
    "gradient_checkpointing": "trainer.activation_checkpointing",
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_low",
    "epsilon_high": "algorithm.clip_high",
    "num_iterations": "algorithm.ppo_epochs",
    "steps_per_generation": "algorithm.num_minibatches",
    "loss_type": "algorithm.aggregation",
    "importance_sampling_level": "algorithm.name",
    "sapo_temperature_pos": "algorithm.tau_pos",
    "sapo_temperature_neg": "algorithm.tau_neg",
    "mask_truncated_completions": "algorithm.truncated",
    "scale_rewards": "algorithm.scale_rewards",
    "multi_objective_aggregation": "algorithm.multi_objective_aggregation",
    "reward_weights": "task.reward_weights",
    "generation_batch_size": "prompts_per_step",
    "per_device_train_batch_size": "prompts_per_step",
    "max_steps": "steps",
    "save_steps": "checkpoint_every",
    "save_total_limit": "keep_checkpoints",
    "output_dir": "run_dir",
}


@dataclass
class TrainConfig:
    # Keys renamed since a run could have saved them (old -> new): its config.yaml still loads and resumes.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"algorithm.shadow_forward": "algorithm.probe"}
    # Other libraries' names for keys: an unknown key that is one is answered with the key it names.
    FOREIGN_NAMES: ClassVar[dict[str, tuple[str, str]]] = {name: (key, "TRL's") for name, key in TRL_KEYS.items()}

    model: str = "builtin"
    precision: str = "fp16"  # both engines; rollout.precision / trainer.precision override one side
    device: str = "cpu"  # cpu | cuda: where both engines run, and the batch and the RL arithmetic with them
    # Exact mode: the rollout engine and the trainer compute the same bits for every sampled token
    # (μ = π_old), checked every step (docs/exact.md).
    exact: bool = False
    allow_precision_mismatch: bool = False
    steps: int = 50
    prompts_per_step: int = 16
    seed: int = 0
    run_dir: str = ""  # default: runs/train-<time>
    checkpoint_every: int = 10  # steps; 0 = only at the end; -1 = never
    keep_checkpoints: int = 2
    tensorboard: bool = True  # when the tensorboard package is installed
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskSection = field(default_factory=TaskSection)
    reward: RewardSection = field(default_factory=RewardSection)
    log: LogSection = field(default_factory=LogSection)
    health: HealthSection = field(default_factory=HealthSection)
    diagnostics: DiagnosticsSection = field(default_factory=DiagnosticsSection)
    episode: EpisodeSection = field(default_factory=EpisodeSection)
    eval: EvalSection = field(default_factory=EvalSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    async_: AsyncSection = field(default_factory=AsyncSection, metadata={"key": "async"})
    moe: MoESection = field(default_factory=MoESection)
    lora: LoRASection = field(default_factory=LoRASection)

    def resume_command(self, run_dir: object) -> str:
        """The command that continues this run: with --trust-reward-fn where it imports Python code of yours."""
        code = self.task.reward_fn or self.task.tools or self.task.environment
        return f"parity train --resume {run_dir}" + (" --trust-reward-fn" if code else "")

    @property
    def turn_tokens(self) -> int:
        """The token limit of one model turn: episode.turn_tokens, unset the whole rollout.max_new_tokens (read
        here, not filled in: a config with another rollout.max_new_tokens follows it)."""
        return self.episode.turn_tokens or self.rollout.max_new_tokens

    @property
    def episodes(self) -> bool:
        """Several model turns per sample, with an environment or tools between them (the built-in tool
        task, task.name=lookup, has its own)."""
        task = TASKS.get(self.task.name)
        return bool(self.task.environment or self.task.tools) or (task is not None and task.episodes)

    @property
    def distributed_mode(self) -> bool:
        """Rollout workers on Ray and learners under torch.distributed, instead of one process."""
        return self.distributed.rollout_workers > 0 or self.distributed.learners > 1

    def lora_config(self) -> LoRAConfig | None:
        """The resolved LoRA settings, None for full fine-tuning."""
        r = self.lora
        return LoRAConfig(r.rank, r.alpha, tuple(r.targets), r.merge) if r.rank else None

    def _check_lora(self) -> None:
        """Check the lora keys and fill the unset alpha (saved resolved in config.yaml)."""
        r = self.lora
        if r.alpha is not None and not r.alpha > 0:
            raise ConfigError(f"lora.alpha: must be > 0, got {r.alpha!r}")
        unknown = [t for t in r.targets if t not in TARGETS]
        if unknown or not r.targets or len(set(r.targets)) != len(r.targets):
            raise ConfigError(
                f"lora.targets: expected distinct names from {', '.join(TARGETS)} (a list or a comma-separated "
                f"string), got {','.join(r.targets) or 'none'}"
            )
        if not r.rank:
            if r.alpha is not None:
                raise ConfigError(f"lora.alpha={r.alpha:g} has no effect with lora.rank=0 (LoRA off); set lora.rank")
            if not r.merge:
                raise ConfigError("lora.merge=false has no effect with lora.rank=0 (LoRA off); set lora.rank")
            if list(r.targets) != list(TARGETS):
                raise ConfigError(
                    f"lora.targets={','.join(r.targets)} has no effect with lora.rank=0 (LoRA off); set lora.rank"
                )
            return
        r.alpha = 2.0 * r.rank if r.alpha is None else r.alpha
        if not r.merge and self.algorithm.probe:
            raise ConfigError(
                "lora.merge=false with algorithm.probe=true: the probe scores merged weights; "
                "set lora.merge=true or drop the probe"
            )
        if self.algorithm.ratio_source == "shadow":
            raise ConfigError(
                "algorithm.ratio_source=shadow with lora.rank > 0: the sampler scores π_old on the merged weights, "
                "not the trainer's code path (base and adapters apart), so the merge's rounding would enter the "
                "clip; use algorithm.ratio_source=recompute"
            )
        if self.distributed_mode:
            raise ConfigError(
                "lora.rank > 0 runs in one process only so far (distributed learners shard a full model); "
                "set distributed.rollout_workers=0 and distributed.learners=1"
            )

    @property
    def rollout_precision(self) -> prec.Precision:
        return prec.Precision.named(self.rollout.precision or self.precision)

    @property
    def trainer_precision(self) -> prec.Precision:
        return prec.Precision.named(self.trainer.precision or self.precision)

    def _check_ranges(self) -> None:
        for key, ok, expected in NUMERIC_RANGES:
            value = config_mod.get_key(self, key)
            check_range(key, value, ok(value), expected)

    def validate(self) -> None:
        """Check every key and fill the unset algorithm keys (saved resolved in config.yaml)."""

        for key, value in (
            ("precision", self.precision),
            ("rollout.precision", self.rollout.precision or self.precision),
            ("trainer.precision", self.trainer.precision or self.precision),
        ):
            one_of(key, value, prec.PRECISIONS)
        if self.rollout_precision != self.trainer_precision and not self.allow_precision_mismatch:
            raise ConfigError(
                f"rollout.precision={self.rollout_precision} and trainer.precision={self.trainer_precision} differ; "
                "a mismatched pair is an ablation: set allow_precision_mismatch=true to run it on purpose"
            )
        try:  # first: other keys' checks read the sampling settings (episode.turn_tokens)
            SamplingParams(
                self.rollout.temperature, self.rollout.top_k, self.rollout.top_p, self.rollout.max_new_tokens
            )
        except ValueError as e:
            raise ConfigError(str(e).replace("sampling.", "rollout.")) from None
        if not self.model.strip():  # "" is the working directory to a path
            raise ConfigError("model: empty; give a model directory, a Hugging Face id in the local cache or builtin")
        one_of("algorithm.name", self.algorithm.name, ESTIMATORS)
        one_of("task.name", self.task.name, TASKS)
        one_of("task.chat_template", self.task.chat_template, CHAT_TEMPLATE_MODES)
        one_of("task.difficulty", self.task.difficulty, DIFFICULTIES)
        if difficulty_has_no_effect(self.task.difficulty, self.task.name, self.task.data):
            raise ConfigError(
                f"task.difficulty={self.task.difficulty}: only the generated word problems of task.name=number "
                "(task.data=builtin) have levels"
            )
        self.algorithm.resolve(TASKS[self.task.name])
        if self.trainer.lr is None:
            self.trainer.lr = default_lr(self.model, self.lora.rank > 0)
        kernels.check_device(self.device)  # before anything is looked up by it
        if self.trainer.micro_batch_tokens is None:
            self.trainer.micro_batch_tokens = MICRO_BATCH_TOKENS[self.device]
        one_of("trainer.chunked_head", self.trainer.chunked_head, CHUNKED_HEAD_MODES)
        one_of("reward.isolate", self.reward.isolate, ("auto", "always", "never"))
        one_of("health.on_alarm", self.health.on_alarm, ("warn", "checkpoint", "stop"))
        self._check_ranges()
        if self.prompts_per_step % self.algorithm.num_minibatches:
            raise ConfigError(
                f"algorithm.num_minibatches={self.algorithm.num_minibatches} must divide "
                f"prompts_per_step={self.prompts_per_step} (mini-batches hold whole groups)"
            )
        if self.rollout.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.rollout.group_size}: the group baseline of algorithm.advantage="
                f"{self.algorithm.advantage} needs rollout.group_size >= 2 (with one sample every advantage is 0)"
            )
        self._check_task()
        one_of("trainer.lr_schedule", self.trainer.lr_schedule, LR_SCHEDULES)
        for i, name in enumerate(self.log.to):
            one_of(f"log.to[{i}]", name, TRACKERS)
        self._check_eval()
        self._check_distributed()
        self._check_lora()
        self._check_exact()

    def _check_task(self) -> None:
        t = self.task
        for i, spec in enumerate(t.reward_fn):
            if spec.count(":") != 1:
                raise ConfigError(
                    f"task.reward_fn[{i}]: expected 'module:function' or 'file.py:function', got {spec!r}"
                )
        # Weights without functions are refused when the run binds its rewards (`reward_fns.run_rewards`): a
        # config made before them (parity.GRPOConfig(reward_weights=...)) gets its functions from parity.train.
        if t.reward_weights and t.reward_fn and len(t.reward_weights) != len(t.reward_fn):
            raise ConfigError(
                f"task.reward_weights: {len(t.reward_weights)} weights for {len(t.reward_fn)} reward functions "
                "(task.reward_fn); give one per function, or none (1 each)"
            )
        one_of("task.completion_format", t.completion_format, COMPLETION_FORMATS)
        if t.prompt_column == t.answer_column:
            raise ConfigError(f"task.answer_column: the same column as task.prompt_column ({t.prompt_column!r})")
        self._check_episodes()

    def _check_episodes(self) -> None:
        t, e = self.task, self.episode
        for key, specs in (("task.environment", [t.environment] if t.environment else []), ("task.tools", t.tools)):
            for spec in specs:
                if spec.count(":") != 1:
                    raise ConfigError(f"{key}: expected 'module:name' or 'file.py:name', got {spec!r}")
        if t.environment and t.tools:
            raise ConfigError(
                "task.environment and task.tools: give one (an environment offers its own tools, as its `tools`)"
            )
        one_of("episode.tool_format", e.tool_format, TOOL_FORMATS)
        if e.turn_tokens is not None and not 1 <= e.turn_tokens <= self.rollout.max_new_tokens:
            raise ConfigError(
                f"episode.turn_tokens: must be in [1, rollout.max_new_tokens={self.rollout.max_new_tokens}] (the "
                f"episode's whole budget), got {e.turn_tokens}"
            )
        if not self.episodes:  # they were ignored; turn_tokens is left out, as older runs' config.yaml fill it in
            changed = [key for key in e.given() if not key.startswith("episode.turn_tokens=")]
            if changed:
                raise ConfigError(
                    f"{changed[0]}: a setting of episodes, and this run has none (task.tools, task.environment or "
                    "task.name=lookup)"
                )
            return
        refusal = TASKS[self.task.name].refused_models.get(self.model)
        if refusal:
            raise ConfigError(refusal)
        if e.retokenization_logprob and not e.retokenization:
            raise ConfigError("episode.retokenization_logprob=true needs episode.retokenization=true (the count)")
        if t.chat_template == "none":  # it was ignored: an episode's turns are the template's
            raise ConfigError(
                "task.chat_template=none: episodes are conversations, rendered by the model's chat template"
            )

    def resolve_paths(self, origin: Path) -> None:
        """Data paths and a model directory made absolute against `origin` (the working directory the run
        started in), so that config.yaml names the same files from anywhere."""
        if self.model not in SHIPPED_MODELS and (origin / Path(self.model).expanduser()).is_dir():
            self.model = str((origin / Path(self.model).expanduser()).resolve())
        if self.task.data != "builtin":
            self.task.data = str((origin / Path(self.task.data).expanduser()).resolve())
        if self.eval.data != "auto":
            self.eval.data = str((origin / Path(self.eval.data).expanduser()).resolve())

        def found_from_anywhere(spec: str) -> str:  # a Python file's functions: rewards, tools, an environment
            module, function = spec.split(":")
            return f"{(origin / Path(module).expanduser()).resolve()}:{function}" if module.endswith(".py") else spec

        self.task.reward_fn = [found_from_anywhere(spec) for spec in self.task.reward_fn]
        self.task.tools = [found_from_anywhere(spec) for spec in self.task.tools]
        if self.task.environment:
            self.task.environment = found_from_anywhere(self.task.environment)

    def _check_eval(self) -> None:
        e = self.eval
        if e.max_new_tokens is not None and e.max_new_tokens < 1:
            raise ConfigError(
                f"eval.max_new_tokens: must be >= 1 (unset: rollout.max_new_tokens), got {e.max_new_tokens}"
            )
        unknown = [p for p in e.precisions if p not in prec.PRECISIONS]
        if unknown or len(set(e.precisions)) != len(e.precisions):
            raise ConfigError(
                f"eval.precisions: expected distinct names from {', '.join(prec.PRECISIONS)} (a list or a "
                f"comma-separated string), got {','.join(e.precisions) or 'none'}"
            )
        problem = regular_file_problem(Path(e.data).expanduser()) if e.data != "auto" else None
        if problem is not None:
            raise ConfigError(
                f"eval.data: {e.data!r} {problem} (use auto for the task's held-out split, or a JSONL/Parquet file)"
            )

    @property
    def eval_data(self) -> str | None:
        """Where held-out problems come from: a file, "heldout" (the task's generated split), or None
        (nothing to evaluate on: the run trains on a file of a task Parity does not generate)."""
        if self.eval.data != "auto":
            return self.eval.data
        # your reward functions score your data: generated problems of a built-in task would not fit them
        generated = self.task.data == "builtin" or (TASKS[self.task.name].generated and not self.task.reward_fn)
        return "heldout" if generated and not (self.task.environment or self.task.tools) else None

    def _check_exact(self) -> None:
        if not self.exact:
            return
        if self.rollout_precision != self.trainer_precision:
            raise ConfigError(
                f"exact=true with rollout.precision={self.rollout_precision} and trainer.precision="
                f"{self.trainer_precision}: exact mode makes both engines compute the same bits in one precision"
            )

    def _check_distributed(self) -> None:
        """Combinations the distributed trainer cannot run, refused before any work."""
        d, staleness = self.distributed, self.async_.max_staleness
        if not self.distributed_mode:
            if staleness or self.async_.partial_rollouts:
                key = "max_staleness" if staleness else "partial_rollouts"
                raise ConfigError(
                    f"async.{key}={getattr(self.async_, key)}: asynchronous training needs rollout workers; "
                    "set distributed.rollout_workers >= 1"
                )
            if d.address:  # it was ignored: the run went on in one process
                raise ConfigError(
                    f"distributed.address={d.address}: the cluster to run rollout workers and learners on; set "
                    "distributed.rollout_workers >= 1"
                )
            return
        if self.device != "cpu":
            raise ConfigError(
                f"device={self.device}: distributed training runs on the CPU only so far (Ray does not place "
                "rollout workers and learners on GPUs yet: docs/scaling.md)"
            )
        if d.rollout_workers < 1:
            raise ConfigError(
                f"distributed.learners={d.learners} needs distributed.rollout_workers >= 1: in distributed mode "
                "the samples come from rollout workers"
            )
        rows = self.prompts_per_step * self.rollout.group_size // self.algorithm.num_minibatches
        if rows % d.learners:
            raise ConfigError(
                f"distributed.learners={d.learners} must divide the rows of a mini-batch (prompts_per_step x "
                f"rollout.group_size / algorithm.num_minibatches = {rows}): every learner takes an equal share"
            )
        if self.prompts_per_step < d.rollout_workers:
            raise ConfigError(
                f"distributed.rollout_workers={d.rollout_workers} is more than prompts_per_step="
                f"{self.prompts_per_step}: each worker samples whole prompt groups"
            )


def _checked_init(init):
    """`TrainConfig(...)` checked as the loader checks a config: an unknown key or a value of the wrong type
    or range is the loader's one-line ConfigError when the object is made, not a TypeError, nor a failure
    once a run starts. A section may be given as its dataclass or as a dict of its keys."""
    hints: dict[str, object] = {}
    keys: dict[str, str] = {}

    @functools.wraps(init)
    def __init__(self, **given):
        if not hints:
            hints.update(typing.get_type_hints(TrainConfig))
            keys.update({f.name: f.metadata.get("key", f.name) for f in dataclasses.fields(TrainConfig)})
        by_key = {key: name for name, key in keys.items()}
        values = {}
        for name, value in given.items():
            field_name = name if name in keys else by_key.get(name)
            if field_name is None:
                raise ConfigError(config_mod.unknown_key(TrainConfig, name, list(keys.values())))
            tp = hints[field_name]
            keep = dataclasses.is_dataclass(tp) and isinstance(value, tp)
            values[field_name] = value if keep else config_mod.coerce(value, tp, keys[field_name], TrainConfig)
        init(self, **values)
        # Checked on a copy: validating fills unset keys from the estimator and task (algorithm.resolve),
        # which must follow the keys as they are when the run validates it, after any change made here.
        copy.deepcopy(self).validate()

    return __init__


TrainConfig.__init__ = _checked_init(TrainConfig.__init__)
config_mod.closed_keys(TrainConfig)
