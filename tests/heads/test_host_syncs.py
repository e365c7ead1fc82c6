"""A head's training step (loss and backward) reads nothing back to the host that would make a GPU wait: no
``.item()``/``bool()``/``int()`` of a tensor, no op whose output size depends on the data, except where named. The
ops are counted as they are dispatched (the same on a CPU as on a GPU), so a new wait is caught here, without one."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headstart.heads import build_head
from tests.helpers import LAYER_IDS, make_batch, tiny_llama

# The ops after which the host must wait for the device: a scalar read, or an output sized by the data.
WAITING_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
HEADS = {  # each head type, and the waits its step is allowed
    "eagle3": ({"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 3, "draft_vocab_size": 120}, {}),
    "peagle": ({"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 3, "parallel_drafting": True}, {}),
    "medusa": ({"type": "medusa"}, {}),
    # The block drafters select the slots that have a label once per step (``labelled.nonzero()``): every later
    # op then runs on scored slots only.
    "dflash": ({"type": "dflash", "layer_ids": LAYER_IDS, "block_size": 4, "num_anchors": 8}, {"nonzero": 1}),
    "dspark": ({"type": "dspark", "layer_ids": LAYER_IDS, "block_size": 3, "markov_rank": 8}, {"nonzero": 1}),
    "dflash2": (
        {"type": "dflash2", "layer_ids": LAYER_IDS, "block_size": 4, "selector_rank": 8, "selector_top_k": 4},
        {"nonzero": 1},
    ),
    "domino": ({"type": "domino", "layer_ids": LAYER_IDS, "block_size": 4, "gru_hidden_dim": 8}, {"nonzero": 1}),
}


class CountWaits(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.waits: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in WAITING_OPS:
            self.waits[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(bool_index(i) for i in args[1]):
            self.waits["bool index"] += 1  # a GPU runs nonzero for it; a CPU indexes without dispatching one
        return func(*args, **(kwargs or {}))


def bool_index(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_heads_training_step_waits_for_the_device_only_where_named(name: str) -> None:
    options, allowed = HEADS[name]
    target = tiny_llama()
    torch.manual_seed(0)
    head = build_head(options, target)
    batch = make_batch(target, batch=2, seq=24, seed=2)
    for fused in (False, True) if options["type"] == "eagle3" else (False,):
        head.fused_attention = fused
        with CountWaits() as counter:
            loss, metrics = head.loss(batch)
            loss.backward()
        assert dict(counter.waits) == allowed, (name, fused)
        assert torch.isfinite(loss) and metrics  # a real step ran


def test_the_counter_sees_a_wait() -> None:
    with CountWaits() as counter:
        x = torch.arange(5.0)
        float(x.sum()), bool((x > 2).any()), x[x > 1]
    assert counter.waits == Counter({"_local_scalar_dense": 2, "bool index": 1})
