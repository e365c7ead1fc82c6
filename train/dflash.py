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

from headstart.core.config import run_command
from headstart.train.eagle import train_head


def main(argv: list[str] | None = None) -> None:
    train_head("dflash", argv)


if __name__ == "__main__":
    run_command(main, "torchrun train/dflash.py")
