"""The training config: the ``train:``, ``wandb:`` and ``metrics:`` sections, the root ``TrainConfig`` that composes
them with the target, data and capture sections (``data_recipes.settings``) and the head's (``heads.Head``), and
the checks that span sections.

``resolve_config`` checks a loaded YAML config (after ``key=value`` overrides) and fills in the
defaults, so a typo, a wrong type, a value out of range or a head the trainer does not train fails
before any model is loaded. Sections of the other stages (``regenerate``) may be in the same file:
one config drives capture, training, eval and export, and those sections are checked against their
own schema too.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from headstart.core.config_files import load_config
from headstart.core.settings import (
    Count,
    Float,
    Folder,
    Fraction,
    NonNegative,
    NonNegativeFloat,
    Positive,
    Section,
    Stage,
    TrainDtype,
    check,
    not_a_flag,
    raise_problems,
)
from headstart.data_recipes.settings import Capture, Regenerate, Target, TokenizedData
from headstart.heads import Head, trainers
from headstart.heads.medusa import Lora


class Train(Section):
    out_dir: Folder  # never "": an unset shell variable would train into the folder the command runs in
    seed: NonNegative = 0
    epochs: Count = 1
    max_steps: Count | None = None  # null: epochs x steps per epoch
    batch_size: Count = 16  # samples per optimizer step, over all ranks
    micro_batch_size: Count = 4  # samples per forward, per rank
    lr: Positive = 1e-4
    min_lr_ratio: Fraction = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_steps: NonNegative = 0
    weight_decay: NonNegativeFloat = 0.0
    betas: Annotated[list[Annotated[Float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.95]
    max_grad_norm: NonNegativeFloat = 1.0  # 0: no clipping
    # adamw: torch's AdamW over every trained parameter. muon: Muon on the draft's weight matrices at muon_lr (its
    # updates are orthogonalised, so they take a larger rate) and AdamW at lr on the rest: norms, biases, embeddings
    # and vocabulary matrices (train/optimizers.py); speculators' default for drafts.
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: Positive = 0.02
    # Parameters whose names contain one of these stay with AdamW under muon, beside the embedding-like and vocabulary
    # matrices that always do (train/optimizers.py). null: the head type's own list (Domino's correction); []: none.
    muon_exclude: list[str] | None = None
    zero_stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(not_a_flag)] = 2
    dtype: TrainDtype = "fp32"  # the head's training precision
    # Recompute the head's drafting steps (EAGLE-3's training-time-test steps) in backward instead of keeping their
    # activations: memory per token falls several-fold for one more draft-layer forward per step. auto: for
    # samples of heads.base.RECOMPUTE_FROM (4096) tokens and more.
    checkpoint_steps: Literal["auto"] | bool = "auto"
    # EAGLE-3's training-time-test attention. exact: the reference, its scores computed in chunks (memory linear in
    # the length); fused: the causal part by the device's fused attention kernel, the diagonal keys merged by
    # log-sum-exp (heads.sparse_attention.ttt_attention_fused): no S x S scores, equal up to float rounding.
    attention: Literal["exact", "fused"] = "exact"
    # true: the target runs inside each step, here; vllm: each batch's states are asked of a vLLM server
    # (capture.base_url, or one started from capture.engine_python); false: the shards in capture.out_dir
    online_capture: bool | Literal["vllm"] = False
    # true: each micro-batch's samples end to end in one row (data_recipes.shards.pack_collate), no padding; every
    # sample attends and is scored within itself. From shards only: the target's own forward would see across them.
    pack: bool = False
    heldout_samples: NonNegative = 0
    eval_every: NonNegative = 0  # 0: held-out eval at the end only
    # Measured acceptance at each held-out evaluation (train/measured.py): the head drafts greedy chains at its
    # trained depth and the target verifies, on eval_prompts prompts (the held-out samples' prompts, or the first
    # of eval_bench), eval_new_tokens new tokens each. 0: off (it loads the whole target, not only the borrowed
    # tensors); off too with nothing to draw prompts from (heldout_samples: 0 and no eval_bench: ``measures``).
    eval_prompts: NonNegative = 0
    eval_new_tokens: Count = 64
    eval_bench: str | None = None  # a benchmark JSONL (data_recipes.bench) instead of the held-out samples
    # last: the exported head (<out_dir>/head) is the last step's; measured_tau: the one whose measured tau was best
    keep_best: Literal["last", "measured_tau"] = "last"
    save_every: NonNegative = 0  # 0: checkpoint at the end only
    keep_checkpoints: NonNegative = 2  # 0 keeps them all
    num_workers: NonNegative = 0
    resume: Literal["auto"] | bool = "auto"


class Wandb(Section):
    mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "headstart"
    name: str | None = None


class Metrics(Section):
    """Where training metrics go besides metrics.jsonl (always written) and wandb (its own section)."""

    tensorboard: bool = False  # event files in <train.out_dir>/tensorboard
    mlflow: bool = False  # an MLflow file store in <train.out_dir>/mlruns: no server, no network
    mlflow_experiment: str = "headstart"  # each launch is one run in it, named after train.out_dir


LORA_TRAINER = "medusa"  # the recipe that reads a lora: section (Medusa-2 trains the target with its heads)


class TrainConfig(Stage):
    """Training; ``resolve_config`` adds the checks that span sections (batch sizes, shards or online)."""

    command: ClassVar[str] = "training"
    target: Target
    data: TokenizedData
    capture: Capture = Capture()
    head: Head
    train: Train
    lora: Lora | None = None
    wandb: Wandb = Wandb()
    metrics: Metrics = Metrics()
    regenerate: Regenerate | None = None


def resolve_config(given: dict[str, Any], trainer: str, source: str | None = None) -> TrainConfig:
    """The loaded YAML mapping ``given`` (from the file ``source``) with defaults filled in, or ConfigError naming
    the file and every unknown key, bad type or bad value."""
    resolved, problems = check(given, TrainConfig)
    # Said beside the schema's problems, so read from the mapping as given: a Medusa config run by train/eagle.py
    # has EAGLE-unknown head keys too.
    given_head = given.get("head")
    head_type = given_head.get("type") if isinstance(given_head, dict) else None
    other = trainers().get(head_type, trainer) if isinstance(head_type, str) else trainer
    if other != trainer:
        problems.append(f"head.type {head_type!r} is trained by train/{other}.py, not train/{trainer}.py")
    if resolved is not None and not problems:
        problems = consistency_problems(resolved, trainer)
    raise_problems(TrainConfig, problems, source)
    assert resolved is not None
    return resolved


def consistency_problems(cfg: TrainConfig, trainer: str) -> list[str]:
    """What no one section says is wrong, but the sections together are."""
    train, problems = cfg.train, []
    if train.batch_size % train.micro_batch_size:
        problems.append(
            f"train.batch_size ({train.batch_size}) must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) times the number of processes"
        )
    problems += _state_source_problems(cfg)
    problems += _lora_problems(cfg, trainer)
    problems += cfg.head.length_problems(cfg.data.max_length)
    return problems + _measurement_problems(train)


def _state_source_problems(cfg: TrainConfig) -> list[str]:
    """Where the hidden states come from (shards, the step's own forward, a server) against what needs them."""
    train, problems = cfg.train, []
    if not train.online_capture and not cfg.capture.out_dir:
        problems.append("capture.out_dir is required unless train.online_capture is true (where are the shards?)")
    if cfg.lora and not train.online_capture:
        problems.append(
            "Medusa-2 (a lora: section) trains the target itself, so its hidden states cannot come from "
            "shards: set train.online_capture: true"
        )
    if train.online_capture == "vllm" and cfg.capture.engine != "vllm":
        problems.append(
            "train.online_capture: vllm asks the server the capture section describes: set capture.engine: vllm "
            "(and capture.base_url for a running server, else one starts from capture.engine_python)"
        )
    if train.pack and train.online_capture:
        problems.append(
            "train.pack lays a micro-batch's samples end to end in one row, and the target's forward inside the step "
            "(train.online_capture) would attend across them: pack shards (train.online_capture: false)"
        )
    if cfg.lora and train.online_capture == "vllm":
        problems.append(
            "Medusa-2 (a lora: section) trains the target itself, so a server's states (train.online_capture: "
            "vllm) are not its states: set train.online_capture: true"
        )
    return problems


def _lora_problems(cfg: TrainConfig, trainer: str) -> list[str]:
    """Medusa-2 (a lora: section) against the target's split and the recipe."""
    problems = []
    if cfg.lora and cfg.target.tp_size > 1:
        problems.append(
            f"Medusa-2 (a lora: section) cannot train a split target (target.tp_size={cfg.target.tp_size}): "
            "peft's LoRA adapters on transformers' tensor-parallel layers fail in the forward with the pinned "
            "peft 0.21.2 and transformers 5.23 (a shape error in the split attention), and their sharded and "
            "partial-gradient weights would need tensor-parallel-aware gradient reduction besides; train Medusa-1 "
            "(no lora:) online or from shards, or Medusa-2 on a target one device holds"
        )
    if cfg.lora and trainer != LORA_TRAINER:
        problems.append("a lora: section (Medusa-2) is only read by train/medusa.py")
    return problems


def _measurement_problems(train: Train) -> list[str]:
    """Held-out evaluation and measured acceptance asked for without the prompts they need."""
    problems = []
    if train.eval_every and not train.heldout_samples:
        problems.append("train.eval_every needs train.heldout_samples > 0 (nothing held out to evaluate)")
    # Only where prompts are decoded: a short run overriding heldout_samples=0 eval_every=0 measures nothing, so
    # a config's eval_prompts (the demo's 8) is no reason to refuse it.
    if measures_acceptance(train) and not train.eval_bench and train.eval_prompts > train.heldout_samples:
        problems.append(
            f"train.eval_prompts ({train.eval_prompts}) exceeds train.heldout_samples ({train.heldout_samples}): "
            "measured acceptance decodes held-out prompts at every evaluation, the last step's included (or set "
            "train.eval_bench to a benchmark file)"
        )
    if train.keep_best == "measured_tau" and not measures_acceptance(train):
        problems.append(
            f"train.keep_best: measured_tau needs train.eval_prompts > 0 (now {train.eval_prompts}) and prompts to "
            f"draw them from, train.heldout_samples > 0 (now {train.heldout_samples}) or train.eval_bench: nothing "
            "is measured"
        )
    return problems


def measures_acceptance(train: Train) -> bool:
    """Whether the run measures acceptance (``train.measured``): prompts asked for (``eval_prompts``) and somewhere
    to draw them from, a benchmark file or held-out samples. Each evaluation decodes them, the last step's always."""
    return train.eval_prompts > 0 and (train.eval_bench is not None or train.heldout_samples > 0)


def parse_args(trainer: str, argv: list[str] | None = None) -> TrainConfig:
    """The recipe's command line: ``--config FILE [--resume] [key=value ...]`` -> the resolved config."""
    parser = argparse.ArgumentParser(description=f"Train a draft head with train/{trainer}.py (DeepSpeed).")
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    # The deepspeed launcher passes --local_rank; torchrun sets LOCAL_RANK instead. Both are read from the env.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    overrides = args.overrides + (["train.resume=true"] if args.resume else [])
    return resolve_config(load_config(args.config, overrides), trainer, args.config)
