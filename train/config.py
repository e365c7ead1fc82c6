"""The training config: the one schema (``core.schema.TrainConfig``) plus what only a trainer knows.

``resolve_config`` checks a loaded YAML config (after ``key=value`` overrides) and fills in the
defaults, so a typo, a wrong type, a value out of range or a head the trainer does not train fails
before any model is loaded. Sections of the other stages (``regenerate``) may be in the same file:
one config drives capture, training, eval and export, and those sections are checked against their
own schema too.
"""

from __future__ import annotations

import argparse
from typing import Any

from headstart.core.config import load_config
from headstart.core.schema import TrainConfig, check_config, raise_problems

# train/<trainer>.py -> the head types it trains; `headstart train` picks the recipe by head.type.
TRAINERS = {"eagle": ("eagle", "eagle3"), "medusa": ("medusa",), "dflash": ("dflash",)}
TRAINER_OF = {head_type: trainer for trainer, head_types in TRAINERS.items() for head_type in head_types}


def resolve_config(config: dict[str, Any], trainer: str) -> dict[str, Any]:
    """``config`` with defaults filled in, or ConfigError naming every unknown key, bad type or bad value."""
    resolved, problems = check_config(config, TrainConfig)
    # Said beside the schema's problems: a Medusa config run by train/eagle.py has EAGLE-unknown head keys too.
    head = config.get("head")
    head_type = head.get("type") if isinstance(head, dict) else None
    other = TRAINER_OF.get(head_type, trainer) if isinstance(head_type, str) else trainer
    if other != trainer:
        problems.append(f"head.type {head_type!r} is trained by train/{other}.py, not train/{trainer}.py")
    if not problems:
        _check_consistency(resolved, trainer, problems)
    raise_problems(TrainConfig, problems)
    return resolved


def _check_consistency(cfg: dict[str, Any], trainer: str, problems: list[str]) -> None:
    train = cfg["train"]
    if train["batch_size"] % train["micro_batch_size"]:
        problems.append(
            f"train.batch_size ({train['batch_size']}) must be a multiple of train.micro_batch_size "
            f"({train['micro_batch_size']}) times the number of processes"
        )
    if not train["online_capture"] and not cfg["capture"]["out_dir"]:
        problems.append("capture.out_dir is required unless train.online_capture is true (where are the shards?)")
    if "lora" in cfg and not train["online_capture"]:
        problems.append(
            "Medusa-2 (a lora: section) trains the target itself, so its hidden states cannot come from "
            "shards: set train.online_capture: true"
        )
    if train["online_capture"] == "vllm" and cfg["capture"]["engine"] != "vllm":
        problems.append(
            "train.online_capture: vllm asks the server the capture section describes: set capture.engine: vllm "
            "(and capture.base_url for a running server, else one starts from capture.engine_python)"
        )
    if "lora" in cfg and train["online_capture"] == "vllm":
        problems.append(
            "Medusa-2 (a lora: section) trains the target itself, so a server's states (train.online_capture: "
            "vllm) are not its states: set train.online_capture: true"
        )
    if "lora" in cfg and cfg["target"]["tp_size"] > 1:
        problems.append(
            f"Medusa-2 (a lora: section) cannot train a split target (target.tp_size={cfg['target']['tp_size']}): "
            "peft's LoRA adapters on transformers' tensor-parallel layers fail in the forward with the pinned "
            "peft 0.21.2 and transformers 5.23 (a shape error in the split attention), and their sharded and "
            "partial-gradient weights would need tensor-parallel-aware gradient reduction besides; train Medusa-1 "
            "(no lora:) online or from shards, or Medusa-2 on a target one device holds"
        )
    if "lora" in cfg and trainer != "medusa":
        problems.append("a lora: section (Medusa-2) is only read by train/medusa.py")
    head, max_length = cfg["head"], cfg["data"]["max_length"]
    if head["type"] == "dflash" and head["block_size"] > max_length:
        # Every step holds num_anchors blocks of block_size slots per sequence (5000 slots: 120 GB, after the
        # target has loaded); slots past a sample's max_length tokens are never scored anyway.
        problems.append(
            f"head.block_size ({head['block_size']}) must not exceed data.max_length ({max_length}): "
            "a block's slots past the end of a sample have no token to learn"
        )
    if train["eval_every"] and not train["heldout_samples"]:
        problems.append("train.eval_every needs train.heldout_samples > 0 (nothing held out to evaluate)")
    if train["eval_prompts"] and not train["eval_bench"] and train["eval_prompts"] > train["heldout_samples"]:
        problems.append(
            f"train.eval_prompts ({train['eval_prompts']}) exceeds train.heldout_samples ({train['heldout_samples']}): "
            "measured acceptance decodes held-out prompts (or set train.eval_bench to a benchmark file)"
        )
    if train["keep_best"] == "measured_tau" and not train["eval_prompts"]:
        problems.append("train.keep_best: measured_tau needs train.eval_prompts > 0 (nothing is measured)")


def parse_args(trainer: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The recipe's command line: ``--config FILE [--resume] [key=value ...]`` -> the resolved config."""
    parser = argparse.ArgumentParser(description=f"Train a draft head with train/{trainer}.py (DeepSpeed).")
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    # The deepspeed launcher passes --local_rank; torchrun sets LOCAL_RANK instead. Both are read from the env.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    overrides = args.overrides + (["train.resume=true"] if args.resume else [])
    return resolve_config(load_config(args.config, overrides), trainer)
