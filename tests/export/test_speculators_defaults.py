"""What speculators 0.9.0's trainer writes by default, read exactly: ``norm_before_residual`` (the residual around the
draft layer's attention is the normed feature, vLLM's ``_norm_before_residual``) as an EAGLE-3 head option that
trains, drafts, exports and imports back to the same logits; and its 2048-token sliding window, which is full
attention on a target whose context it covers and refused on one whose context it does not."""

import json

import pytest
import torch
from safetensors.torch import load_file

from headstart.export.common import arch_from_decoder
from headstart.heads import WEIGHTS_NAME, load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from tests.helpers import make_batch, make_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_residual_is_the_normed_feature_as_vllm_computes_it(tiny_llama_from_dir, tmp_path):
    head = load_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3", norm_before_residual=True), tiny_llama_from_dir)
    layer = head.midlayer
    embeds, features = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    cos, sin = head.rotary(torch.arange(5)[None], features.dtype)
    with torch.no_grad():
        # vLLM llama_eagle3.py: hidden_states, residual = hidden_norm(h), hidden_norm(h); attention; then the
        # post-attention norm and MLP with their residual.
        normed = layer.hidden_norm(features)
        x = normed + layer.self_attn(torch.cat((layer.input_layernorm(embeds), normed), -1), cos, sin)
        expected = x + layer.mlp(layer.post_attention_layernorm(x))
        got = layer(embeds, features, cos, sin)
        layer.norm_before_residual = False
        assert not torch.allclose(layer(embeds, features, cos, sin), expected)  # the option changes the layer
    torch.testing.assert_close(got, expected)


def test_training_reads_the_option(tiny_llama_from_dir, tmp_path):
    head = load_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3", norm_before_residual=True), tiny_llama_from_dir)
    batch = make_batch(tiny_llama_from_dir)
    loss, _ = head.loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and head.midlayer.hidden_norm.weight.grad.abs().sum() > 0
    head.midlayer.norm_before_residual = False
    with torch.no_grad():
        assert not torch.isclose(head.loss(batch)[0], loss)


def test_a_head_without_it_saves_as_before_and_one_with_it_exports_and_imports_to_the_same_logits(
    tiny_llama_dir, tiny_llama_from_dir, tmp_path
):
    plain = json.loads((make_head(tiny_llama_from_dir, tmp_path, "eagle3", name="plain") / "config.json").read_text())
    assert "norm_before_residual" not in plain  # unset options are not written: saved heads stay byte-identical
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", norm_before_residual=True)
    head = load_head(head_dir, tiny_llama_from_dir).eval()
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    aux = make_batch(tiny_llama_from_dir, 1, 9)["aux_hidden"]
    with torch.no_grad():
        expected, _ = head(ids, head.first_features(aux))
    for fmt, kind in (("vllm", "eagle3"), ("speculators", "speculators")):
        exported = export_head(head_dir, fmt, tmp_path / fmt, tiny_llama_dir)
        assert json.loads((exported / "config.json").read_text())["norm_before_residual"] is True
        back = import_head(kind, exported, tmp_path / f"in-{fmt}", tiny_llama_dir)
        again = load_head(back, tiny_llama_from_dir).eval()
        assert again.config.options.norm_before_residual is True
        assert load_file(str(back / WEIGHTS_NAME)).keys() == head.state_dict().keys()
        with torch.no_grad():
            torch.testing.assert_close(again(ids, again.first_features(aux))[0], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="norm_before_residual"):
        export_head(head_dir, "sglang", tmp_path / "sglang", tiny_llama_dir)


def test_a_sliding_window_is_read_as_full_attention_only_where_it_covers_the_targets_context(tiny_llama_from_dir):
    context = tiny_llama_from_dir.config.max_position_embeddings
    decoder = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    decoder |= {"layer_types": ["sliding_attention"], "use_sliding_window": True}
    arch = arch_from_decoder(decoder | {"sliding_window": context}, tiny_llama_from_dir.config)
    assert arch.num_hidden_layers == len(tiny_llama_from_dir.model.layers) and arch.intermediate_size == 64
    with pytest.raises(ValueError, match=f"{context - 1}-token window, shorter than the target's {context}-token"):
        arch_from_decoder(decoder | {"sliding_window": context - 1}, tiny_llama_from_dir.config)
    with pytest.raises(ValueError, match="layer_types"):
        arch_from_decoder(decoder | {"layer_types": ["chunked_attention"]}, tiny_llama_from_dir.config)
