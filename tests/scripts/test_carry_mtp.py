"""A Llama carried into MiMo's layout with a fresh MTP layer (scripts/bench/carry_mtp.py): the same logits, a checkpoint
whose MTP layer an MTP head borrows, and the Llamas Qwen2's layer cannot hold refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from headstart.heads import build_head
from headstart.scripts.bench.carry_mtp import carried_logit_gap, carry_to_mimo, fresh_mtp_layer, mimo_config
from tests.helpers import save_tiny_llama


def test_carried_llama_gives_its_logits_and_a_fresh_mtp_layer(tmp_path):
    llama = save_tiny_llama(tmp_path / "llama", num_hidden_layers=2)
    carried = carry_to_mimo(llama, tmp_path / "mimo", seed=3)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    assert carried_logit_gap(llama, carried, ids) == 0.0
    assert json.loads((carried / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(carried)
    assert model.model.layers[1].self_attn.k_proj.bias.abs().sum() == 0
    head = build_head({"type": "mtp"}, model)  # init: checkpoint, the family found from the carried config
    fresh = fresh_mtp_layer(model.config, seed=3)
    assert head.family.name == "mimo"
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, fresh[head.family.checkpoint_name(name)]), name


@pytest.mark.parametrize("change", [{"attention_bias": True}, {"mlp_bias": True}, {"head_dim": 16}])
def test_a_llama_qwen2_cannot_hold_is_refused(change):
    with pytest.raises(ValueError, match="Qwen2"):
        mimo_config(LlamaConfig(hidden_size=64, num_attention_heads=2, **change))
