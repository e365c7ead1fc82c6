"""The training config's schema: every key the trainers read, its type and its default.

``resolve_config`` checks a loaded YAML config (after ``key=value`` overrides) against ``SCHEMA``
and fills in the defaults, so a typo, a wrong type or a head the trainer does not train fails
before any model is loaded. Sections that belong to other stages (``OTHER_STAGES``) pass
through unchecked: one config file drives capture, training, eval and export.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from typing import Any

from core.config import ConfigError, load_config
from heads import HEADS

REQUIRED = object()

# Each field: (accepted types, default, allowed values or None). ``None`` in the types admits null.
SCHEMA: dict[str, dict[str, tuple[tuple, Any, tuple | None]]] = {
    "target": {
        "path": ((str,), REQUIRED, None),
        "device": ((str,), "auto", None),
        "dtype": ((str,), "fp32", ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    },
    "data": {
        "source": ((str,), REQUIRED, None),
        "format": ((str,), REQUIRED, None),
        "max_length": ((int,), REQUIRED, None),
        "on_error": ((str,), "raise", ("raise", "skip")),
        "limit": ((int, None), None, None),
    },
    "capture": {
        "out_dir": ((str, None), None, None),
        "aux_layers": ((str, list), "auto", None),
        "store_dtype": ((str,), "bf16", ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
        "shard_samples": ((int,), 256, None),
        "batch_tokens": ((int,), 8192, None),
        "allow_other_weights": ((bool,), False, None),  # train on shards of another checkpoint of the same shape
    },
    "train": {
        "out_dir": ((str,), REQUIRED, None),
        "seed": ((int,), 0, None),
        "epochs": ((int,), 1, None),
        "max_steps": ((int, None), None, None),  # null: epochs x steps per epoch
        "batch_size": ((int,), 16, None),  # samples per optimizer step, over all ranks
        "micro_batch_size": ((int,), 4, None),  # samples per forward, per rank
        "lr": ((float,), 1e-4, None),
        "min_lr_ratio": ((float,), 0.0, None),  # cosine decays to lr * min_lr_ratio
        "warmup_steps": ((int,), 0, None),
        "weight_decay": ((float,), 0.0, None),
        "betas": ((list,), [0.9, 0.95], None),
        "max_grad_norm": ((float,), 1.0, None),
        "zero_stage": ((int,), 2, (0, 1, 2, 3)),
        "dtype": ((str,), "fp32", ("fp32", "bf16")),  # the head's training precision
        "online_capture": ((bool,), False, None),
        "heldout_samples": ((int,), 0, None),
        "eval_every": ((int,), 0, None),  # 0: held-out eval at the end only
        "save_every": ((int,), 0, None),  # 0: checkpoint at the end only
        "keep_checkpoints": ((int,), 2, None),  # 0 keeps them all
        "num_workers": ((int,), 0, None),
        "resume": ((str, bool), "auto", ("auto", True, False)),
    },
    "lora": {  # Medusa-2: present -> the target trains jointly through LoRA adapters
        "r": ((int,), 16, None),
        "alpha": ((float,), 32.0, None),
        "dropout": ((float,), 0.05, None),
        "target_modules": ((list,), ["q_proj", "k_proj", "v_proj", "o_proj"], None),
        "head_weight": ((float,), 0.2, None),  # weight of the Medusa heads' loss beside the LM loss
        "head_weight_warmup": ((int,), 0, None),  # steps over which that weight rises from 0
    },
    "wandb": {
        "mode": ((str,), "disabled", ("online", "offline", "disabled")),
        "project": ((str,), "headstart", None),
        "name": ((str, None), None, None),
    },
}
OTHER_STAGES = {"regenerate", "eval", "export"}
TRAINERS = {"eagle": ("eagle", "eagle3"), "medusa": ("medusa",)}


def resolve_config(config: dict[str, Any], trainer: str) -> dict[str, Any]:
    """``config`` with defaults filled in, or ConfigError naming every unknown key, bad type or bad value."""
    problems: list[str] = []
    out: dict[str, Any] = {}
    for section in config:
        if section not in SCHEMA and section not in OTHER_STAGES and section != "head":
            problems.append(f"unknown section {section!r} (known: {', '.join(sorted({*SCHEMA, 'head'}))})")
    for section, fields in SCHEMA.items():
        given = config.get(section)
        if given is None and section == "lora":  # no lora section: Medusa-1
            continue
        out[section] = _resolve_section(section, given or {}, fields, problems)
    out["head"] = _resolve_head(config.get("head"), trainer, problems)
    out |= {k: v for k, v in config.items() if k in OTHER_STAGES}
    if not problems:
        _check_consistency(out, trainer, problems)
    if problems:
        raise ConfigError("invalid training config:\n  " + "\n  ".join(problems))
    return out


def _resolve_section(section: str, given: Any, fields: dict, problems: list[str]) -> dict[str, Any]:
    if not isinstance(given, dict):
        problems.append(f"{section} must be a mapping, got {type(given).__name__}")
        return {}
    for key in given.keys() - fields.keys():
        problems.append(f"unknown key {section}.{key} (known: {', '.join(sorted(fields))})")
    resolved = {}
    for key, (types, default, allowed) in fields.items():
        if key not in given:
            if default is REQUIRED:
                problems.append(f"{section}.{key} is required")
            resolved[key] = copy.deepcopy(default)
            continue
        resolved[key] = _check_value(f"{section}.{key}", given[key], types, allowed, problems)
    return resolved


def _check_value(name: str, value: Any, types: tuple, allowed: tuple | None, problems: list[str]) -> Any:
    # YAML 1.1 reads "1e-3" (no dot) as a string: accept numeric strings where a float is expected.
    if float in types and isinstance(value, str):
        with contextlib.suppress(ValueError):  # not a number: reported as a wrong type below
            value = float(value)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _type_ok(value, types):
        names = " or ".join("null" if t is None else t.__name__ for t in types)
        problems.append(f"{name} must be {names}, got {value!r} ({type(value).__name__})")
    elif allowed is not None and not any(value == a and type(value) is type(a) for a in allowed):
        problems.append(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def _type_ok(value: Any, types: tuple) -> bool:
    if value is None:
        return None in types
    # bool is an int subclass in Python; a flag where a count belongs is a mistake.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, tuple(t for t in types if t is not None))


def _resolve_head(head: Any, trainer: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(head, dict) or "type" not in head:
        problems.append("head.type is required (a head section such as `head: {type: eagle3}`)")
        return {}
    head_type = head["type"]
    if head_type not in HEADS:
        problems.append(f"head.type {head_type!r} is not a head type (known: {', '.join(sorted(HEADS))})")
        return dict(head)
    if head_type not in TRAINERS[trainer]:
        other = next(name for name, types in TRAINERS.items() if head_type in types)
        problems.append(f"head.type {head_type!r} is trained by train/{other}.py, not train/{trainer}.py")
    defaults = HEADS[head_type].defaults
    resolved = {"type": head_type}
    for key, value in head.items():
        if key == "type":
            continue
        if key not in defaults:
            problems.append(f"unknown key head.{key} for a {head_type} head (known: type, {', '.join(defaults)})")
            continue
        default = defaults[key]
        types = (list, None) if default is None else (type(default),)
        resolved[key] = _check_value(f"head.{key}", value, types, None, problems)
    return resolved


def _check_consistency(cfg: dict[str, Any], trainer: str, problems: list[str]) -> None:
    train = cfg["train"]
    if train["micro_batch_size"] < 1 or train["batch_size"] % train["micro_batch_size"]:
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
    if "lora" in cfg and trainer != "medusa":
        problems.append("a lora: section (Medusa-2) is only read by train/medusa.py")
    if cfg["capture"]["aux_layers"] != "auto" and not isinstance(cfg["capture"]["aux_layers"], list):
        problems.append(f"capture.aux_layers must be auto or a list of layer ids, got {cfg['capture']['aux_layers']!r}")
    if train["eval_every"] and not train["heldout_samples"]:
        problems.append("train.eval_every needs train.heldout_samples > 0 (nothing held out to evaluate)")


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
