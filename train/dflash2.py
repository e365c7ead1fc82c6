"""Train a DFlash-2 block drafter (``head.type: dflash2``) on a frozen target.

    python -m data_recipes.capture --config configs/demo-dflash2.yaml         # shards (or train.online_capture)
    torchrun --nproc_per_node 2 train/dflash2.py --config configs/demo-dflash2.yaml [--resume] [key=value ...]

As train/dflash.py: the head reads the fused target layers the capture recorded (an EAGLE-3 capture serves as
is) plus the last hidden state (the soft labels), and samples ``head.num_anchors`` blocks per sequence and step
from the generator the loop seeds per micro-batch, so a resumed run trains on exactly the same blocks. The loss
is DFlash's plus the candidate selector's (``heads.dflash2.DFlash2Head.loss``). Writes what train/eagle.py writes.
"""

from __future__ import annotations

from headstart.core.config import run_command
from headstart.train.eagle import train_head


def main(argv: list[str] | None = None) -> None:
    train_head("dflash2", argv)


if __name__ == "__main__":
    run_command(main, "torchrun train/dflash2.py")
