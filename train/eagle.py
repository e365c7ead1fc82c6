"""Train a draft head on a frozen target from the target's states alone: every head type whose registry entry
names this recipe (``heads.HeadType.trainer``: EAGLE-1/2, EAGLE-3 and P-EAGLE, DFlash, DSpark, DFlash-2, and a
head type registered from outside). The config's ``head.type`` picks the head.

    python -m data_recipes.capture --config configs/demo-eagle3.yaml          # shards (or train.online_capture)
    torchrun --nproc_per_node 2 train/eagle.py --config configs/demo-eagle3.yaml [--resume] [key=value ...]
    torchrun --nproc_per_node 2 train/eagle.py --config configs/demo-dflash.yaml   # the EAGLE-3 capture's shards

Multi-node: torchrun's usual --nnodes/--node_rank/--rdzv_* flags; the ``deepspeed`` launcher works too.
Writes ``<train.out_dir>/head`` (load with ``heads.load_head``), DeepSpeed checkpoints under
``<train.out_dir>/checkpoints``, ``metrics.jsonl`` and the resolved ``config.yaml``.

A head that fuses target layers reads the ones the capture recorded (``capture.aux_layers``; DFlash's ``auto``
layers are EAGLE-3's, so an EAGLE-3 capture serves as is). A block drafter samples ``head.num_anchors`` blocks per
sequence from torch's generator, which the loop seeds per micro-batch: a resumed run trains on exactly the blocks
the uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path

from headstart.core.config_files import run_command
from headstart.core.runtime import seed_everything
from headstart.heads import DraftHead, build_head
from headstart.train.data import fuses_layers, head_settings, load_data, loss_token_counts
from headstart.train.loop import HeadLoss, fit, load_run_target, start_processes
from headstart.train.train_config import parse_args


def save_head(head: DraftHead, out_dir: Path) -> None:
    head.save_pretrained(out_dir / "head")


def main(argv: list[str] | None = None) -> None:
    """The recipe of a head trained on the target's states alone: its loss over capture's batch."""
    cfg = parse_args("eagle", argv)  # unknown keys, wrong types, another recipe's head: fail here, before any work
    proc = start_processes(cfg)  # refuses a run its devices cannot hold, before loading
    target, tokenizer = load_run_target(cfg, proc)
    data = load_data(cfg, target, tokenizer, aux=fuses_layers(cfg.head), online_states=True)  # shards checked

    seed_everything(cfg.train.seed)
    head = build_head(head_settings(cfg.head, data.aux_layers), target, tokenizer)  # records its hash
    if head.picks_draft_vocab():  # a reduced draft vocabulary: the most frequent loss tokens of the training samples
        vocab = target.config.get_text_config().vocab_size  # a vision-language target's: its text model's
        head.set_vocab_mapping(loss_token_counts(data.dataset, data.train_ids, vocab))

    fit(HeadLoss(head, data.capture), head, data, cfg, proc, target, tokenizer, lambda out: save_head(head, out))


if __name__ == "__main__":
    run_command(main, "torchrun train/eagle.py")
