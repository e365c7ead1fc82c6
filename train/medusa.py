"""Train Medusa heads: Medusa-1 on a frozen target, or Medusa-2 jointly with the target through LoRA.

    torchrun --nproc_per_node 2 train/medusa.py --config configs/demo-medusa.yaml [--resume] [key=value ...]

A ``lora:`` section makes it Medusa-2: the target gets peft LoRA adapters, trains on its own LM loss
plus ``lora.head_weight`` x the heads' loss (that weight warming up from 0 over
``lora.head_weight_warmup`` steps), and its hidden states are computed in the step (online).
Writes ``<train.out_dir>/head`` (and ``lora/``, the adapters, for Medusa-2), DeepSpeed checkpoints,
``metrics.jsonl`` and the resolved ``config.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from torch import nn

from headstart.core.config_files import run_command
from headstart.core.io import atomic_dir
from headstart.core.runtime import seed_everything
from headstart.heads.medusa import Lora, MedusaHead, medusa2_wrap, medusa_loss, medusa_weight_at
from headstart.train.data import load_data
from headstart.train.loop import HeadLoss, fit, load_run_target, start_processes
from headstart.train.train_config import parse_args


class Medusa2Loss(nn.Module):
    """The engine's module for Medusa-2: the LoRA-wrapped target and the heads train together."""

    def __init__(self, head: MedusaHead, model: PeftModel, lora: Lora):
        super().__init__()
        self.head, self.model = head, model
        self.head_weight, self.warmup = lora.head_weight, lora.head_weight_warmup

    def forward(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
        weight = medusa_weight_at(step, self.warmup, self.head_weight)
        head_logits = self.head(out.hidden_states[-1])  # the last state after the final norm, as lm_head reads it
        lk_target = out.logits.detach() if self.head.config.options.loss == "lk" else None  # what verifies the heads
        return medusa_loss(
            head_logits,
            batch,
            self.head.config.options.decay,
            lm_logits=out.logits,
            medusa_weight=weight,
            lk_target_logits=lk_target,
        )


def save_medusa(head: MedusaHead, model: PeftModel | None, out_dir: Path) -> None:
    head.save_pretrained(out_dir / "head")
    if model is not None:
        with atomic_dir(out_dir / "lora") as tmp:
            model.save_pretrained(str(tmp))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args("medusa", argv)  # unknown keys, wrong types, an EAGLE config: fail here, before any work
    proc = start_processes(cfg)  # refuses a run its devices cannot hold, before loading
    target, tokenizer = load_run_target(cfg, proc)
    lora = cfg.lora
    # Medusa-2 runs the (changing) target itself; Medusa-1 reads shards or captures in the step.
    data = load_data(cfg, target, tokenizer, aux=False, online_states=lora is None)

    seed_everything(cfg.train.seed)
    head = MedusaHead.build(cfg.head, target, tokenizer)  # its lm_heads start as copies of the target's
    model = None
    if lora is None:
        module: nn.Module = HeadLoss(head, data.capture)
    else:
        model = medusa2_wrap(target, lora)
        module = Medusa2Loss(head, model, lora)

    fit(module, head, data, cfg, proc, target, tokenizer, lambda out: save_medusa(head, model, out))


if __name__ == "__main__":
    run_command(main, "torchrun train/medusa.py")
