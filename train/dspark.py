"""Train a DSpark block drafter (``head.type: dspark``) on a frozen target.

    python -m data_recipes.capture --config configs/demo-dspark.yaml          # shards (or train.online_capture)
    torchrun --nproc_per_node 2 train/dspark.py --config configs/demo-dspark.yaml [--resume] [key=value ...]

As train/dflash.py: the head reads the fused target layers the capture recorded (an EAGLE-3 capture serves as
is) plus the last hidden state (the soft labels), and samples ``head.num_anchors`` blocks per sequence and step
from the generator the loop seeds per micro-batch, so a resumed run trains on exactly the same blocks. The loss
is DeepSpec's (``heads.dspark.DSparkHead.loss``). Writes what train/eagle.py writes.
"""

from __future__ import annotations

from headstart.core.config import run_command
from headstart.train.eagle import train_head


def main(argv: list[str] | None = None) -> None:
    train_head("dspark", argv)


if __name__ == "__main__":
    run_command(main, "torchrun train/dspark.py")
