"""Train a DFlash block drafter (``head.type: dflash``) on a frozen target.

    python -m data_recipes.capture --config configs/demo-dflash.yaml          # shards (or train.online_capture)
    torchrun --nproc_per_node 2 train/dflash.py --config configs/demo-dflash.yaml [--resume] [key=value ...]

The head reads the target layers the capture recorded (``capture.aux_layers``; its ``auto`` layers are
EAGLE-3's, so an EAGLE-3 capture serves as is) plus the last hidden state, from which the target's
distributions (the soft labels) come. Each step samples ``head.num_anchors`` blocks per sequence
(``heads.dflash.DFlashHead.loss``) from torch's generator, which the loop seeds per micro-batch: a
resumed run trains on exactly the blocks the uninterrupted one would have. Writes what train/eagle.py
writes: ``<train.out_dir>/head``, DeepSpeed checkpoints, ``metrics.jsonl`` and the resolved ``config.yaml``.
"""

from __future__ import annotations

from headstart.core.runtime import seed_everything
from headstart.heads import DFlashHead
from headstart.train.config import parse_args
from headstart.train.data import head_settings, load_data, loss_token_counts
from headstart.train.eagle import save_head
from headstart.train.loop import HeadLoss, fit, load_run_target, start_processes


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args("dflash", argv)  # unknown keys, wrong types, another head's config: fail here, before any work
    proc = start_processes(cfg)  # refuses a run its devices cannot hold, before loading
    target, tokenizer = load_run_target(cfg, proc)
    data = load_data(cfg, target, tokenizer, aux=True, online_states=True)  # shards checked vs target

    seed_everything(cfg.train.seed)
    head = DFlashHead.build(head_settings(cfg.head, data.aux_layers), target, tokenizer)  # records its hash
    if head.lm_head is not None:  # a reduced draft vocabulary: the most frequent loss tokens of the training samples
        head.set_vocab_mapping(loss_token_counts(data.dataset, data.train_ids, target.config.vocab_size))

    fit(HeadLoss(head, data.capture), head, data, cfg, proc, target, tokenizer, lambda out: save_head(head, out))


if __name__ == "__main__":
    main()
