"""Resume on another process count: data order by global sample index, optimizer state re-partitioned.

A run stopped after step 4 (its later checkpoints and head removed, as a kill leaves it) resumes with
another ``torchrun --nproc_per_node`` and ends where the uninterrupted run ends. CPU, tiny target.
"""

import json
import shutil
from collections import Counter

import pytest
import torch

from headstart.train import eagle
from headstart.train.checkpoint import MARKER, check_data_order, complete_steps, loads_universal, tag_for
from headstart.train.data import epoch_order, rank_micro_batches
from tests.helpers import REPO, head_weights, records, run_here, run_torchrun

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS, STOP = 6, 4


def stopped_copy(src, dst, step):
    """``src`` as a run stopped right after checkpointing ``step`` leaves it (no later checkpoint, no final head)."""
    shutil.copytree(src, dst)
    for later in [s for s in complete_steps(dst / "checkpoints") if s > step]:
        shutil.rmtree(dst / "checkpoints" / tag_for(later))
    shutil.rmtree(dst / "head")


def test_every_sample_is_seen_once_whatever_the_process_count_per_step():
    order = epoch_order(list(range(40)), seed=3, epoch=0)
    batch, micro = 8, 2
    # Steps 0-1 on 2 processes, then steps 2-4 on 1 process: exactly the samples of 5 steps on 1 process.
    seen = [i for s in (0, 1) for r in (0, 1) for mb in rank_micro_batches(order, s, batch, micro, r, 2) for i in mb]
    seen += [i for s in (2, 3, 4) for mb in rank_micro_batches(order, s, batch, micro, 0, 1) for i in mb]
    assert Counter(seen) == Counter(order[: 5 * batch]) and max(Counter(seen).values()) == 1
    # Each step's samples are the same set for any process count that divides the batch into micro-batches.
    for world in (1, 2, 4):
        per_rank = [rank_micro_batches(order, 3, batch, micro, r, world) for r in range(world)]
        assert sorted(i for rank in per_rank for mb in rank for i in mb) == sorted(order[24:32])


def test_resume_refuses_what_would_change_the_data_order_or_cannot_reload():
    marker = {"step": 40, "world": 2, "zero_stage": 2, "seed": 0, "batch_size": 16, "train_samples": 900}
    check_data_order(marker, {"seed": 0, "batch_size": 16, "train_samples": 900})
    with pytest.raises(ValueError, match=r"cannot resume from step 40: batch_size 16 -> 32 \(checkpoint -> now\)"):
        check_data_order(marker, {"seed": 0, "batch_size": 32, "train_samples": 900})
    assert loads_universal(marker, 1, 2) and not loads_universal(marker, 2, 2)
    assert not loads_universal({**marker, "zero_stage": 0}, 1, 0)  # ZeRO-0 keeps the whole optimizer state
    assert loads_universal({**marker, "zero_stage": 3}, 4, 3)
    with pytest.raises(ValueError, match="needs the same stage, not 1"):
        loads_universal(marker, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then", "zero_stage"), [(2, 1, 2), (1, 2, 2), (2, 1, 0), (2, 1, 3)])
def test_run_resumes_on_another_process_count(first, then, zero_stage, make_config, monkeypatch, capsys):
    settings = dict(max_steps=STEPS, save_every=2, keep_checkpoints=0, eval_every=0, zero_stage=zero_stage)
    config, full = make_config("eagle3", name="full", **settings)
    stopped = config.parent / "stopped"
    launch = {
        1: lambda *o: run_here(monkeypatch, eagle, config, *o),
        2: lambda *o: run_torchrun(REPO / "train" / "eagle.py", config, *o),
    }
    launch[first](f"train.out_dir={full}")
    stopped_copy(full, stopped, STOP)
    assert json.loads((stopped / "checkpoints" / tag_for(STOP) / MARKER).read_text())["world"] == first

    out = launch[then](f"train.out_dir={stopped}")
    assert f"resumed from step {STOP} of {STEPS}" in (out or capsys.readouterr().out)
    # Same samples in every step (the per-step token counts), each step logged once.
    assert [(r["step"], r["tokens"]) for r in records(stopped)] == [(r["step"], r["tokens"]) for r in records(full)]
    # The same micro-batches, gradients averaged over ranks instead of accumulated: fp32 summation order only.
    resumed, uninterrupted = head_weights(stopped), head_weights(full)
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-5, rtol=0, msg=name)
    assert [json.loads((stopped / "checkpoints" / tag_for(s) / MARKER).read_text())["world"] for s in (4, 6)] == [
        first,
        then,
    ]
    assert not list((stopped / "checkpoints").glob("*universal*"))  # the converted copy is gone once loaded
