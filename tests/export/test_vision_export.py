"""An EAGLE-3 head for a vision-language target exports in the layout vLLM serves for those targets: a text-only
Llama EAGLE-3 draft of the text model's shape, whose config has no mrope (so vLLM feeds it the temporal row of the
target's positions, as it was trained: data_recipes.states.VisionRows)."""

import json

from headstart.heads import build_head
from headstart.scripts.export.command import export_head


def test_a_qwen_vl_targets_head_exports_as_a_text_llama_eagle3_draft_without_mrope(tiny_qwen_vl, tmp_path):
    target = tiny_qwen_vl[0]
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, target)
    assert head.config.arch.rope == {"rope_theta": 10000.0, "rope_type": "default"}  # the target's mrope split dropped
    head.save_pretrained(tmp_path / "head")
    config = json.loads((export_head(tmp_path / "head", "vllm", tmp_path / "out") / "config.json").read_text())
    text = target.config.get_text_config()
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["rope_scaling"] is None
    assert (config["hidden_size"], config["target_hidden_size"], config["vocab_size"]) == (
        text.hidden_size, text.hidden_size, text.vocab_size
    )  # fmt: skip
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
