"""Heads for each Hugging Face decoder family: capture -> training -> greedy-identical decoding -> export.

Tiny random targets of each family are built from their transformers configs with the tiny test
tokenizer. The exported weight names are checked against the decoder layer the exported config
describes, built by transformers itself (the layer vLLM and SGLang build from the same config).
"""

import importlib
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from headstart.data_recipes.capture import run_capture
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.proposers_medusa import Medusa
from headstart.decoding.verify import generate
from headstart.export.common import VLLM_UNSERVED_FAMILIES, captures_natively
from headstart.export.registry import layouts_of
from headstart.heads import WEIGHTS_NAME, arch_from_target, build_head, load_head, read_head_config
from headstart.heads.layers import DecoderLayer, RotaryEmbedding
from headstart.scripts.export.command import engine_files, export_head
from headstart.scripts.export.import_head import import_head
from headstart.train import eagle, medusa
from tests.helpers import base_config, engine_layer_names, layer, records, run_here

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": 64}),
    "qwen2": (Qwen2Config, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),  # q/k norm, head_dim != hidden / heads
    "gemma": (GemmaConfig, {"head_dim": 8}),  # scaled embeddings, (1 + w) RMSNorm, GELU
}
HEAD_TYPES = {"llama": ("eagle", "eagle3"), "mistral": ("eagle", "eagle3"), "qwen2": ("eagle", "eagle3", "medusa")}
HEAD_TYPES |= {"qwen3": ("eagle", "eagle3"), "gemma": ("medusa",)}
TRAINERS = {"eagle": eagle, "eagle3": eagle, "medusa": medusa}


def save_family_target(out, family, tokenizer):
    config_cls, extra = FAMILIES[family]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = config_cls(
        vocab_size=len(tokenizer),
        **SHAPE,
        **ids,
        pad_token_id=tokenizer.pad_token_id,
        **{"tie_word_embeddings": False, **extra},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.get_output_embeddings().weight.data *= 30  # peaked predictions: something to learn in 3 steps
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_capture(request, tiny_target_dir, gsm8k_file, tmp_path_factory):
    """(family, target folder, shards captured from it, a tmp folder) for each family."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    save_family_target(root / "target", family, AutoTokenizer.from_pretrained(tiny_target_dir))
    run_capture(base_config(root / "target", gsm8k_file, root / "shards", root, "eagle3"))
    return family, root / "target", root / "shards", root


def train_head(monkeypatch, family_capture, gsm8k_file, head_type):
    _, target_dir, shards, root = family_capture
    out = root / head_type
    cfg = base_config(target_dir, gsm8k_file, shards, out, head_type, max_steps=3, eval_every=3)
    (root / f"{head_type}.yaml").write_text(yaml.safe_dump(cfg))
    run_here(monkeypatch, TRAINERS[head_type], root / f"{head_type}.yaml")
    return out


def check_eagle_export(exported, tensors, fmt, family):
    """EAGLE-1: the family's layer without input_layernorm (both engines drop it); q/k/v biases for Qwen2."""
    if family == "qwen2" and fmt == "sglang":
        assert exported["architectures"] == ["Qwen2ForCausalLMEagle"] and exported["model_type"] == "qwen2"
    else:
        assert exported["model_type"] == "llama"  # no engine has an EAGLE-1 layer with Qwen3's q/k norm
    assert exported.get("qkv_bias", False) == (family == "qwen2")
    expected = engine_layer_names(exported)
    assert layer(tensors, "layers.0.") == expected - {"input_layernorm.weight"}, fmt
    fc = {"fc.weight", "fc.bias"} if fmt == "sglang" else {"fc.weight"}  # SGLang's fc always has a bias
    assert set(tensors) - {f"layers.0.{n}" for n in expected} == fc


def check_eagle3_export(exported, tensors, fmt, config):
    """EAGLE-3: the head's layer (the Qwen3 families': q/k norm; never biases) + hidden_norm, 2H-wide q/k/v."""
    decoder, qk_norm = exported.get("transformer_layer_config", exported), config.arch.qk_norm
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    assert decoder["model_type"] == ("qwen3" if qk_norm else "llama") and "qkv_bias" not in decoder
    if fmt == "vllm":
        arch = "Eagle3Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLMEagle3"
        assert exported["architectures"] == [arch]
    assert layer(tensors, prefix) == engine_layer_names(decoder) | {"hidden_norm.weight"}, fmt
    q = tensors[f"{prefix}self_attn.q_proj.weight"]
    assert q.shape == (decoder["num_attention_heads"] * decoder["head_dim"], 2 * decoder["hidden_size"])
    rest = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    # gpt-oss: the norm over the fused states before fc, under vLLM's flag and tensor name
    assert exported["norm_before_fc"] == config.options.norm_before_fc
    rest |= {"input_norm.weight"} if config.options.norm_before_fc else set()
    assert set(tensors) - {prefix + n for n in layer(tensors, prefix)} == rest


def check_dflash_export(exported, tensors, config):
    """DFlash: vLLM's Qwen3 draft layers, sized as the head's arch, the target's layers one less."""
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["model_type"] == "qwen3"
    assert exported["intermediate_size"] == config.arch.intermediate_size
    assert exported["dflash_config"]["target_layer_ids"] == [i - 1 for i in config.options.layer_ids]
    assert {k.split(".")[0] for k in tensors} == {"fc", "hidden_norm", "layers", "norm"}


def check_export(head_dir, family, target_dir):
    config = read_head_config(head_dir)
    state = load_file(str(head_dir / WEIGHTS_NAME))
    target_config = AutoModelForCausalLM.from_pretrained(target_dir).config
    for fmt in layouts_of(config.type).LAYOUTS:
        if config.type in ("eagle3", "dflash") and fmt in ("vllm", "speculators") and family in VLLM_UNSERVED_FAMILIES:
            with pytest.raises(ValueError, match=f"cannot export a {config.type} head for a {family} target as"):
                engine_files(config, state, fmt, str(target_dir), target_config)
            continue
        if config.type == "eagle3" and fmt == "sglang" and not captures_natively(family, "sglang"):
            with pytest.raises(ValueError, match=f"SGLang 0.5.23 has no {family} model class that captures"):
                engine_files(config, state, fmt, str(target_dir), target_config)
            continue
        if config.type == "eagle3" and config.arch.qk_norm and fmt == "sglang":
            with pytest.raises(ValueError, match="q/k norm, which no SGLang EAGLE-3 draft has"):
                engine_files(config, state, fmt, str(target_dir), target_config)
            continue
        exported, tensors, _ = engine_files(config, state, fmt, str(target_dir), target_config)
        if config.type == "eagle":
            check_eagle_export(exported, tensors, fmt, family)
        elif config.type == "eagle3":
            check_eagle3_export(exported, tensors, fmt, config)
        elif config.type == "dflash":
            check_dflash_export(exported, tensors, config)
        else:
            assert exported["medusa_num_heads"] == config.options.num_heads
            assert {k.split(".")[0] for k in tensors} == {"0", "1"}


def test_heads_train_decode_greedily_and_export_for_each_family(family_capture, gsm8k_file, monkeypatch):
    family, target_dir, _, _ = family_capture
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer("Ann has 3 apples and buys 5 more.", return_tensors="pt").input_ids
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)
    for head_type in HEAD_TYPES[family]:
        out = train_head(monkeypatch, family_capture, gsm8k_file, head_type)
        steps = records(out)
        assert [r["step"] for r in steps] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
        assert json.loads((out / "head" / "config.json").read_text())["training"]["step"] == 3
        head = load_head(out / "head", target)
        assert head.config.arch.family == family
        medusa_tree = [(0,), (1,), (0, 0), (0, 1), (1, 0)]  # two heads: a tree two deep
        proposer = Medusa(head, medusa_tree) if head_type == "medusa" else Eagle(head, top_k=3, depth=3, total_tokens=8)
        got, stats = generate(target, proposer, prompt, 12)
        assert torch.equal(got, expected), (family, head_type)
        assert stats.target_forwards == len(stats.accepted_lengths) <= 12
        check_export(out / "head", family, target_dir)
        if head_type != "medusa":  # vLLM's folder imports back to the same head (q/k/v biases, q/k norm kept)
            exported = export_head(out / "head", "vllm", out / "export", str(target_dir))
            imported = import_head(head_type, exported, out / "imported", str(target_dir))
            again = load_file(str(imported / WEIGHTS_NAME))
            assert again.keys() == head.state_dict().keys()
            assert all(torch.equal(again[k], v) for k, v in head.state_dict().items())


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_eagle_heads_refuse_families_no_engine_serves(head_type, tiny_target_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    save_family_target(tmp_path / "gemma", "gemma", tokenizer)
    gemma = AutoModelForCausalLM.from_pretrained(tmp_path / "gemma")
    with pytest.raises(NotImplementedError, match=f"{head_type} heads for gemma targets are not supported: no serving"):
        build_head({"type": head_type}, gemma)
    build_head({"type": "medusa", "num_heads": 2}, gemma)  # Medusa needs only the last hidden state


def test_llama_heads_saved_before_families_load_as_bias_free_llama_heads(tiny_target_dir, tmp_path):
    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    head = build_head({"type": "eagle"}, target)
    head.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    del config["arch"]["family"], config["arch"]["qkv_bias"]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    loaded = load_head(tmp_path / "head", target)
    assert loaded.layers[0].self_attn.q_proj.bias is None


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_draft_layer_with_the_family_options_computes_the_family_layer(family):
    """Our decoder layer, built from arch_from_target, equals transformers' own layer of that family
    (Qwen2: q/k/v biases; Qwen3: q/k norm, head_dim != hidden / heads) on the same weights."""
    config_cls, extra = FAMILIES[family]
    config = config_cls(vocab_size=64, **SHAPE, **extra, attn_implementation="sdpa")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    theirs = getattr(module, f"{prefix}DecoderLayer")(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # norms start at 1 and biases at 0: randomise all
            p.normal_(0, 0.2)
    arch = arch_from_target(config)
    ours = DecoderLayer(arch)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 7, config.hidden_size)
    positions = torch.arange(7).expand(2, -1)
    position_embeddings = getattr(module, f"{prefix}RotaryEmbedding")(config)(x, positions)
    expected = theirs(x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
    expected = expected[0] if isinstance(expected, tuple) else expected
    cos, sin = RotaryEmbedding(arch)(positions, x.dtype)
    torch.testing.assert_close(ours(x, cos, sin), expected, atol=1e-5, rtol=1e-5)


def test_qwen3_eagle3_head_with_a_llama_layer_exports_for_sglang(tiny_target_dir, tmp_path):
    """draft_layer: llama drops Qwen3's q/k norm: the plain Llama layer SGLang's LlamaForCausalLMEagle3 builds."""
    save_family_target(tmp_path / "qwen3", "qwen3", AutoTokenizer.from_pretrained(tiny_target_dir))
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"draft_layer must be one of 'target' or 'llama', got 'qwen3'"):
        build_head({"type": "eagle3", "draft_layer": "qwen3"}, target)
    head = build_head({"type": "eagle3", "layer_ids": [1, 3, 4], "draft_layer": "llama"}, target)
    assert not any("q_norm" in name for name in head.state_dict())
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    for fmt in ("vllm", "sglang"):
        exported, tensors, _ = engine_files(head.config, state, fmt, str(tmp_path / "qwen3"), target.config)
        assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["model_type"] == "llama"
        assert layer(tensors, "midlayer.") == engine_layer_names(exported) | {"hidden_norm.weight"}
    # A published Llama-layer Qwen3 head (SpecForge's kind) imports as one: draft_layer llama, no q/k norm.
    head.save_pretrained(tmp_path / "head")
    exported = export_head(tmp_path / "head", "sglang", tmp_path / "export", str(tmp_path / "qwen3"))
    imported = load_head(import_head("eagle3", exported, tmp_path / "imported", str(tmp_path / "qwen3")), target)
    assert imported.config.options.draft_layer == "llama" and not imported.config.arch.qk_norm
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in state.items())
