"""The training loop every recipe shares: processes, steps, evaluation, checkpoints.

A recipe builds a module whose ``forward(batch, step)`` returns ``(loss, metrics)`` and hands it to ``fit``,
which wraps it in the DeepSpeed engine (``train.deepspeed_engine``) and runs ``train``. Only that module is
wrapped: the frozen target is reached through plain attributes (``head.target``, ``OnlineCapture``), so ZeRO never
partitions it, the optimizer never sees it and checkpoints never store it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.config_files import save_config
from headstart.core.io import atomic_write_text, check_writable
from headstart.core.memory import (
    MemoryNeed,
    TargetSizes,
    capture_activations,
    check_memory,
    head_activations,
    head_training_parts,
    kv_cache_bytes,
)
from headstart.core.models import load_target
from headstart.core.runtime import (
    Ranks,
    collective_device,
    leave_process_group,
    mix_seed,
    rank_device,
    resolve_dtype,
    slow_dtype_warning,
)
from headstart.core.settings import as_dict
from headstart.data_recipes.prompts import data_prompt_format
from headstart.data_recipes.states import OnlineCapture, resolve_aux_layers
from headstart.heads import (
    CONFIG_NAME,
    DraftHead,
    check_tokenizer,
    meta_head,
    read_head_config,
)
from headstart.train.checkpoint import all_finite, last_good, resume, save_checkpoint
from headstart.train.data import TrainData, data_fingerprint, fuses_layers, head_settings, heldout_batches, step_batches
from headstart.train.deepspeed_engine import build_engine, wait_for_op_build
from headstart.train.measured import (
    MeasuredAcceptance,
    check_eval_bench,
    export_best,
    forget_best_after,
    is_better,
    keep_best_head,
)
from headstart.train.metrics import (
    ACCEPTANCE_PLOT,
    MetricsLog,
    head_readme,
    heldout_top1,
    measured_summary,
    plot_acceptance,
    predicted_tau,
    training_summary,
)
from headstart.train.optimizers import optimizer_settings
from headstart.train.train_config import Train, TrainConfig, measures_acceptance


class NonFiniteLoss(RuntimeError):
    """The loss (or the weights) went NaN/inf: the run stops, naming the step and the last good checkpoint."""


@dataclass(frozen=True)
class Process:
    """This process's place in the job: its rank among ``world`` processes and its device; with a split target
    (``tp_size`` > 1) the ranks of one tensor-parallel group train on the same batches (``core.runtime.Ranks``),
    and the data is split across the ``dp_world`` groups."""

    rank: int
    world: int
    device: torch.device
    tp_size: int = 1

    @property
    def dp_rank(self) -> int:
        return Ranks(self.rank, self.world, self.tp_size).dp_rank

    @property
    def dp_world(self) -> int:
        return self.world // self.tp_size


def init_distributed(device_name: str, tp_size: int = 1) -> Process:
    """Join the process group torchrun (or the deepspeed launcher) describes; a world of one without one.

    ``tp_size``: the processes one copy of the target is split across (only where the target runs: online
    capture, Medusa-2); the world must be a whole number of such groups."""
    if "RANK" not in os.environ:  # python train/eagle.py ... (or a test calling main())
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    if int(os.environ["WORLD_SIZE"]) % tp_size:
        raise ValueError(
            f"target.tp_size={tp_size} does not divide the {os.environ['WORLD_SIZE']} processes torchrun started: "
            "the world is tp_size x data-parallel groups"
        )
    device = rank_device(device_name)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would drown the progress bar
    if not dist.is_initialized():
        wait_for_op_build()  # DeepSpeed's backend builds its op here, behind a lock a killed build may have left
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
        # Destroyed at exit, not when main() returns: DeepSpeed caches groups made from this one, so a
        # second main() in the same process (the tests) must find the same group.
        atexit.register(leave_process_group)
    return Process(dist.get_rank(), dist.get_world_size(), device, tp_size)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def load_run_target(cfg: TrainConfig, proc: Process) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target as this run needs it (whole, or its borrowed tensors: ``runs_target``), on this rank's own
    device (``cuda`` alone would put every rank on GPU 0). A ``train.eval_bench`` is checked first."""
    check_eval_bench(cfg)
    target = cfg.target
    return load_target(
        target.path,
        str(proc.device),
        target.dtype,
        target.tp_size,
        borrowed_only=not runs_target(cfg),
        attention=target.attn_implementation,
        tokenizer_fits=True,
    )


def forward_in_step(cfg: TrainConfig) -> bool:
    """Whether each training step runs the target's forward (online capture, Medusa-2's LoRA)."""
    return cfg.train.online_capture is True or cfg.lora is not None


def runs_target(cfg: TrainConfig) -> bool:
    """Whether training holds the whole target: its forward in the step, or the verification of measured acceptance
    (``train.eval_prompts``). From shards, or from a server's states (``online_capture: vllm``), without measured
    acceptance, it only borrows the embedding, final norm and lm_head (``core.models.load_target(borrowed_only=True)``).
    """
    return forward_in_step(cfg) or measures_acceptance(cfg.train)


def start_processes(cfg: TrainConfig) -> Process:
    """This rank's process, once the run is known to fit its device (``training_memory``); the target splits
    across ``target.tp_size`` ranks only where training runs it; ``train.out_dir`` is writable."""
    check_writable(cfg.train.out_dir)  # before the target loads, not at the first checkpoint
    proc = init_distributed(cfg.target.device, cfg.target.tp_size if runs_target(cfg) else 1)
    line = check_memory(training_memory(cfg, proc), proc.device, MEMORY_REMEDY)
    if proc.rank == 0:
        print(line)
    return proc


MEMORY_REMEDY = (
    "train from shards (train.online_capture: false) to hold only the borrowed tensors, split the target across "
    "more ranks (target.tp_size), lower train.micro_batch_size or data.max_length, or raise train.zero_stage"
)


def training_memory(cfg: TrainConfig, proc: Process) -> MemoryNeed:
    """What one rank of this run holds: the target's share (when it runs) or the borrowed tensors, the head with
    its gradients and optimizer state, and one micro-batch's activations (``core.memory``), before loading."""
    config = AutoConfig.from_pretrained(cfg.target.path)
    sizes, dtype = TargetSizes.of(config), resolve_dtype(cfg.target.dtype)
    train, layers = cfg.train, config.get_text_config().num_hidden_layers
    aux = resolve_aux_layers(cfg.capture.aux_layers, layers) if fuses_layers(cfg.head) else []
    head = meta_head(head_settings(cfg.head, aux), config)
    need = MemoryNeed("training")
    need.parts["target share" if runs_target(cfg) else "borrowed tensors"] = (
        sizes.target_share(dtype, proc.tp_size) if runs_target(cfg) else sizes.borrowed_bytes(dtype)
    )
    need.parts |= head_training_parts(head, train.zero_stage, proc.world, train.dtype == "bf16")
    tokens = train.micro_batch_size * cfg.data.max_length
    options = head.config.options
    set_training_kernels(head, train)
    recompute = head.recomputes(cfg.data.max_length)
    need.parts["activations"] = head_activations(
        config, tokens, len(aux), options.trained_depth(), options.draft_vocab(), dtype, recompute, proc.device
    )
    if forward_in_step(cfg):  # the target's forward inside the step (its backward too for Medusa-2's LoRA)
        forward = capture_activations(config, tokens, cfg.data.max_length, len(aux), dtype, proc.tp_size)
        need.parts["target activations"] = forward * (3 if cfg.lora else 1)
    if measures_acceptance(
        train
    ):  # measured acceptance: one sequence's KV cache, its prompt (at most max_length) and reply
        context = cfg.data.max_length + train.eval_new_tokens
        need.parts["measured acceptance KV cache"] = kv_cache_bytes(config, context, dtype, proc.tp_size)
    return need


def set_training_kernels(head: DraftHead, train: Train) -> None:
    """What the head computes its training steps with, not saved with it: ``train.checkpoint_steps`` (auto: None,
    the head's own length rule) and ``train.attention``."""
    head.checkpoint_steps = None if train.checkpoint_steps == "auto" else train.checkpoint_steps
    head.fused_attention = train.attention == "fused"


class HeadLoss(nn.Module):
    """The engine's module for a head on a frozen target: ``head.loss`` on the batch's hidden states.

    With online capture the states are computed here from the batch's tokens; ``OnlineCapture`` is a
    plain attribute, so the target it runs stays outside the engine.
    """

    def __init__(self, head: DraftHead, capture: OnlineCapture | None):
        super().__init__()
        self.head = head
        self.capture = capture

    def forward(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.capture is not None:
            batch = self.capture(batch)
        # EAGLE-3 scores against the target's distribution: head.loss runs the frozen target lm_head over
        # the batch's last_hidden (no grad), which is exactly the target's logits at each position.
        return self.head.loss(batch)


def total_steps(train: Train, data: TrainData) -> int:
    per_epoch = len(data.train_ids) // train.batch_size
    return train.max_steps if train.max_steps is not None else train.epochs * per_epoch


def data_order(train: Train, data: TrainData) -> dict[str, int | str]:
    """What fixes the samples of every step (``step_batches``): checked on resume."""
    return {
        "seed": train.seed,
        "batch_size": train.batch_size,
        "train_samples": len(data.train_ids),
        "data": data_fingerprint(data),
    }


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _reduce_mean(values: list[torch.Tensor], count: int) -> list[float]:
    """Sum across ranks and divide by the number of micro-batches that contributed (all ranks)."""
    packed = torch.stack([v.detach().float() for v in values]).to(collective_device())
    dist.all_reduce(packed)
    return (packed.cpu() / max(count, 1)).tolist()


def train_step(
    engine: deepspeed.DeepSpeedEngine, batches: list[dict[str, torch.Tensor]], step: int, seed: int, proc: Process
) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; metrics are averaged over all ranks."""
    start = time.perf_counter()
    lr = engine.get_lr()[0]  # the rate this step's update uses (the schedule advances in engine.step)
    sums: dict[str, torch.Tensor] = {}
    tokens = torch.zeros((), device=proc.device)  # metrics stay on the device until the step's one reduction
    for m, batch in enumerate(batches):
        # Dropout (Medusa-2's LoRA) draws from a generator set per micro-batch chunk: the same numbers for
        # a resumed run, for any number of processes, and on every rank of a tensor-parallel group.
        torch.manual_seed(mix_seed(seed, step, m * proc.dp_world + proc.dp_rank))
        batch = _to(batch, proc.device)
        loss, metrics = engine(batch, step)
        # One host wait per micro-batch, before its update: a non-finite loss stops every rank while the weights
        # are still finite (and can be saved).
        finite = torch.isfinite(loss.detach()).float().reshape(1).to(collective_device())
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise NonFiniteLoss(f"non-finite loss ({loss.item()}) at step {step + 1}")
        engine.backward(loss)
        engine.step()
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0) + value.detach().float()
        tokens += batch["attention_mask"].sum()
    means = _reduce_mean(list(sums.values()), len(batches) * proc.world)
    total_tokens = _reduce_mean([tokens], proc.tp_size)[0]  # each group's ranks all counted its tokens
    seconds = time.perf_counter() - start
    return {
        "step": step + 1,
        "split": "train",
        "lr": lr,
        **dict(zip(sums, means)),
        "tokens": int(total_tokens),
        "tokens_per_s": total_tokens / seconds,
    }


@torch.no_grad()
def evaluate(engine: deepspeed.DeepSpeedEngine, data: TrainData, train: Train, step: int, proc: Process) -> dict:
    """Loss and per-position accuracy on the held-out samples (each rank scores its share), averaged per batch."""
    engine.eval()
    sums: dict[str, float] = {}
    count = 0
    for batch in heldout_batches(data, train.micro_batch_size, proc.dp_rank, proc.dp_world):
        loss, metrics = engine(_to(batch, proc.device), step)
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0.0) + float(value)
        count += 1
    engine.train()
    # A rank may hold no held-out batch at all (fewer batches than ranks): gather dicts, not fixed tensors.
    shares: list[Any] = [None] * proc.world
    dist.all_gather_object(shares, (count, sums))
    batches = sum(n for n, _ in shares)
    keys = next(s for _, s in shares if s)
    record = {"step": step, "split": "heldout", **{k: sum(s.get(k, 0.0) for _, s in shares) / batches for k in keys}}
    return record | {"predicted_tau": predicted_tau(heldout_top1(record))}


def fit(
    module: nn.Module,
    head: DraftHead,
    data: TrainData,
    cfg: TrainConfig,
    proc: Process,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    save_artifacts: Callable[[Path], None],
) -> None:
    """A recipe's last step: DeepSpeed over ``module`` (``build_engine``), then ``train`` to the end, measuring the
    acceptance where the config asks for it (``train.eval_prompts``), its prompts rendered as the run's data was."""
    set_training_kernels(head, cfg.train)
    measured = None
    if measures_acceptance(cfg.train):
        prompts = data_prompt_format(cfg.data.format)
        measured = MeasuredAcceptance(cfg, target, tokenizer, data, prompts, proc.rank, proc.tp_size)
    engine = build_engine(
        module, cfg.train, proc, total_steps(cfg.train, data), head.config.vocab_size, head.adamw_under_muon
    )
    train(engine, head, data, cfg, proc, save_artifacts, measured)


def train(
    engine: deepspeed.DeepSpeedEngine,
    head: DraftHead,
    data: TrainData,
    cfg: TrainConfig,
    proc: Process,
    save_artifacts: Callable[[Path], None],
    measured: MeasuredAcceptance | None = None,
) -> None:
    """Resume, then step to the end: log every step, evaluate and checkpoint on schedule, stop on NaN/inf.

    Each held-out evaluation's accuracies and predicted acceptance, and the acceptance ``measured`` finds by
    decoding (``train.measured``), go into ``head.config.training``, so the head saved next (``save_artifacts``)
    carries them in its config.json and README.md.
    """
    train_cfg = cfg.train
    out_dir = Path(train_cfg.out_dir)
    total = total_steps(train_cfg, data)
    order, settings = data_order(train_cfg, data), optimizer_settings(train_cfg)
    head.config.prompt_format = data_prompt_format(cfg.data.format)
    save_artifacts = partial(_save_with_readme, save_artifacts, head, measured)
    start = resume(engine, out_dir, train_cfg.resume, order, settings)
    keeps_best = train_cfg.keep_best == "measured_tau"
    # Checked now, before any step: a tampered record or a missing head would otherwise surface at the export.
    best = forget_best_after(out_dir, start, head.config.trained_depth) if keeps_best else None
    if start and (out_dir / "head" / CONFIG_NAME).is_file():
        # The steps still to come must see the tokens the resumed ones saw.
        saved = out_dir / "head"
        remedy = "train into a new train.out_dir"
        check_tokenizer(read_head_config(saved), head.config.tokenizer_hash, saved, remedy=remedy)
    if proc.rank == 0:
        save_config(as_dict(cfg), out_dir / "config.yaml")
        if why := slow_dtype_warning(proc.device, resolve_dtype(train_cfg.dtype)):
            warnings.warn(f"train.dtype: {why}", stacklevel=2)
        if start:
            print(f"{out_dir}: resumed from step {start} of {total}")
    log = MetricsLog(cfg, proc.rank, start, total)
    save = partial(
        save_checkpoint,
        engine,
        out_dir,
        save_artifacts=save_artifacts,
        keep=train_cfg.keep_checkpoints,
        order=order,
        settings=settings,
    )
    done = start
    # Online states from a server: it runs (or is reached) while the steps run.
    with data.capture or contextlib.nullcontext():
        try:
            for step, batches in step_batches(data, train_cfg, start, total, proc.dp_rank, proc.dp_world):
                head.training_progress = step / total
                log.log(train_step(engine, batches, step, train_cfg.seed, proc))
                done = step + 1
                if _due(done, train_cfg.eval_every, total):
                    best = _evaluate_all(engine, head, data, cfg, proc, done, log, measured, best, save_artifacts)
                if _due(done, train_cfg.save_every, total):
                    if not all_finite(engine):
                        raise NonFiniteLoss(f"the weights became non-finite at step {done}")
                    save(step=done)
            if best is not None and proc.rank == 0:
                export_best(out_dir)
        except NonFiniteLoss as err:
            raise NonFiniteLoss(f"{err}; stopped. {last_good(engine, out_dir, done, save)}") from None
        finally:
            log.close()


def _evaluate_all(
    engine: deepspeed.DeepSpeedEngine,
    head: DraftHead,
    data: TrainData,
    cfg: TrainConfig,
    proc: Process,
    done: int,
    log: MetricsLog,
    measured: MeasuredAcceptance | None,
    best: dict[str, Any] | None,
    save_artifacts: Callable[[Path], None],
) -> dict[str, Any] | None:
    """The held-out evaluation and the measured acceptance after step ``done``, logged and summarised in the head's
    config; with ``keep_best: measured_tau`` a better head is kept in ``<out_dir>/best``. Returns the best record."""
    summary: dict[str, Any] = {}
    if data.heldout_ids:
        heldout = evaluate(engine, data, cfg.train, done, proc)
        log.log(heldout)
        summary = training_summary(heldout)
    decoded = None
    if measured is not None:
        decoded = measured(engine, head, done, proc.dp_rank, proc.dp_world)
        log.log(decoded)
        summary = {"step": done, **summary, **measured_summary(decoded)}
        if proc.rank == 0:
            plot_acceptance(log.path, log.path.with_name(ACCEPTANCE_PLOT))
    if summary:
        head.config.training = summary
    if decoded is not None and cfg.train.keep_best == "measured_tau" and is_better(decoded, best):
        best = keep_best_head(engine, Path(cfg.train.out_dir), done, decoded["tau"], save_artifacts)
    return best


def _save_with_readme(
    save_artifacts: Callable[[Path], None], head: DraftHead, measured: MeasuredAcceptance | None, folder: Path
) -> None:
    """The recipe's files under ``folder`` (``folder/head``), then the head's README.md naming its acceptance."""
    save_artifacts(folder)
    command = measured.command(head) if measured is not None else None
    atomic_write_text(folder / "head" / "README.md", head_readme(head.config, command))


def _due(done: int, every: int, total: int) -> bool:
    return done == total or (every > 0 and done % every == 0)
