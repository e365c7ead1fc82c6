"""Gemma-3 text targets (model_type gemma3_text) for EAGLE-3 (and DFlash's training): a tiny random Gemma3ForCausalLM
with what sets the family apart: embeddings scaled by sqrt(hidden), final-logit soft-capping, sliding-window layers
mixed with global ones (each with its own rotary), tied embeddings, and a vocabulary larger than the draft's.
"""

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3Config, Gemma3TextConfig

from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.states import capture_hidden_states
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import generate
from headstart.heads import WEIGHTS_NAME, build_head, load_head, read_head_config
from headstart.heads.target import draft_target_config
from headstart.scripts.export.command import engine_files
from headstart.train import eagle
from tests.helpers import base_config, engine_layer_names, layer, records, run_here

pytestmark = pytest.mark.usefixtures("one_thread")

SOFTCAP = 0.25  # below the tiny target's largest logits (about 0.6), so capping changes its distributions
WINDOW = 4  # shorter than the prompt: the sliding layers see less than the global ones
ROPE = {  # the global layers' rotary (linear-scaled, as in the 4B+ checkpoints) differs from the sliding ones'
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def gemma3_config(tokenizer, **overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters=ROPE,
        final_logit_softcapping=SOFTCAP,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )


def random_gemma3(tokenizer, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(gemma3_config(tokenizer, **overrides)).eval()


@pytest.fixture(scope="module")
def gemma3_run(tiny_target_dir, gsm8k_file, tmp_path_factory):
    """(target folder, shards captured from it for EAGLE-3, a tmp folder)."""
    root = tmp_path_factory.mktemp("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    random_gemma3(tokenizer).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    run_capture(base_config(root / "target", gsm8k_file, root / "shards", root, "eagle3"))
    return root / "target", root / "shards", root


@pytest.fixture(scope="module")
def gemma3_target(gemma3_run):
    return AutoModelForCausalLM.from_pretrained(gemma3_run[0]).eval()


def prompt_ids(target_dir):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return tokenizer("Ann has 3 apples and buys 5 more. How many?", return_tensors="pt").input_ids


def test_gemma3_eagle3_head_trains_decodes_greedily_and_exports_for_sglang(
    gemma3_run, gemma3_target, gsm8k_file, monkeypatch
):
    target_dir, shards, root = gemma3_run
    cfg = base_config(target_dir, gsm8k_file, shards, root / "eagle3", "eagle3", max_steps=3, eval_every=3)
    (root / "eagle3.yaml").write_text(yaml.safe_dump(cfg))
    run_here(monkeypatch, eagle, root / "eagle3.yaml")
    steps = records(root / "eagle3")
    assert [r["step"] for r in steps] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)

    head = load_head(root / "eagle3" / "head", gemma3_target)
    arch = head.config.arch
    assert (arch.family, arch.hidden_act, arch.qk_norm) == ("gemma3_text", "silu", False)  # the Llama draft layer
    assert arch.rope == ROPE["full_attention"]  # the global layers' rotary
    vocab = gemma3_target.config.vocab_size
    assert head.config.options.draft_vocab_size == 256 < vocab and int(head.t2d.sum()) == 256

    # Greedy speculative decoding is the target's greedy decoding, token for token, on a prompt longer
    # than the sliding window, whose layers then see other keys than the global ones (checked: a target
    # whose window covers the prompt decodes otherwise).
    prompt = prompt_ids(target_dir)
    assert prompt.shape[1] > 2 * WINDOW
    expected = gemma3_target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert len(set(expected[0, prompt.shape[1] :].tolist())) > 2
    unwindowed = AutoModelForCausalLM.from_pretrained(target_dir, sliding_window=64).eval()
    assert not torch.equal(unwindowed.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0), expected)
    got, stats = generate(gemma3_target, Eagle(head, top_k=3, depth=3, total_tokens=8), prompt, 12)
    assert torch.equal(got, expected)
    assert stats.target_forwards == len(stats.accepted_lengths) <= 12

    # SGLang: LlamaForCausalLMEagle3 with a Llama layer (SiLU, the global rotary), the draft vocabulary, and
    # the aux layers as SGLang counts them (the layer whose output it takes: ours - 1).
    config = read_head_config(root / "eagle3" / "head")
    state = load_file(str(root / "eagle3" / "head" / WEIGHTS_NAME))
    exported, tensors, _ = engine_files(config, state, "sglang", str(target_dir), gemma3_target.config)
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["model_type"] == "llama"
    assert exported["hidden_act"] == "silu" and exported["rope_theta"] == 1_000_000.0
    assert exported["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert exported["draft_vocab_size"] == 256 and exported["vocab_size"] == vocab
    assert exported["tie_word_embeddings"] is False  # SGLang would make the draft's lm_head the embedding
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert layer(tensors, "midlayer.") == engine_layer_names(exported) | {"hidden_norm.weight"}
    assert tensors["lm_head.weight"].shape == (256, 64) and tensors["d2t"].shape == (256,)
    for fmt in ("vllm", "speculators"):  # only vLLM reads these, and vLLM 0.32 cannot serve a Gemma-3 target
        with pytest.raises(ValueError, match="Gemma3ForCausalLM .* does not implement SupportsEagle3"):
            engine_files(config, state, fmt, str(target_dir), gemma3_target.config)


def captured_batch(target, target_dir, layers):
    ids = prompt_ids(target_dir)
    mask = torch.ones_like(ids)
    states = capture_hidden_states(target, ids, mask, list(layers))
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, **states}


def test_gemma3_soft_labels_are_the_targets_soft_capped_logits(gemma3_run, gemma3_target):
    target_dir = gemma3_run[0]
    # The whole vocabulary: every position's target argmax counts in the loss.
    head = build_head({"type": "eagle3", "draft_vocab_size": 10**6, "layer_ids": [1, 3, 4]}, gemma3_target)
    batch = captured_batch(gemma3_target, target_dir, head.hidden_layers)
    with torch.no_grad():
        theirs = gemma3_target(batch["input_ids"]).logits  # transformers applies the soft-cap
        uncapped = gemma3_target.lm_head(batch["last_hidden"])
        torch.testing.assert_close(head.target.logits(batch["last_hidden"]), theirs)
        assert theirs.abs().max() < SOFTCAP < uncapped.abs().max()
        # The loss the trainer computes (soft labels from last_hidden) is the loss on the target's own logits.
        loss, _ = head.loss(batch)
        torch.testing.assert_close(loss, head.loss(batch, target_logits=theirs)[0])
        assert not torch.allclose(loss, head.loss(batch, target_logits=uncapped)[0])
        dflash = build_head({"type": "dflash", "layer_ids": [1, 3, 4]}, gemma3_target)
        torch.testing.assert_close(dflash.target_logits(batch["last_hidden"]), theirs)
        assert torch.isfinite(dflash.loss(captured_batch(gemma3_target, target_dir, dflash.hidden_layers))[0])


def test_gemma3_drafts_embed_the_unscaled_table_rows_as_the_engines_do(gemma3_target):
    """vLLM and SGLang hand the draft the target's embedding table; Gemma's sqrt(hidden) scale is applied by
    the target's own forward only (transformers' module applies it, so the head must not call the module)."""
    ids = torch.tensor([[3, 17, 42]])
    table = gemma3_target.get_input_embeddings()
    scale = gemma3_target.config.hidden_size**0.5
    torch.testing.assert_close(table(ids), table.weight[ids] * scale)  # what the target itself reads
    for head_type in ("eagle3", "dflash"):
        head = build_head({"type": head_type, "layer_ids": [1, 3, 4]}, gemma3_target)
        assert torch.equal(head.embed(ids), table.weight[ids]), head_type


def test_gemma3_refusals_say_why(gemma3_target, gemma3_run):
    with pytest.raises(NotImplementedError, match="no engine serves an EAGLE-1 draft for Gemma-3 targets"):
        build_head({"type": "eagle"}, gemma3_target)
    # The multimodal checkpoint's heads read its text model (tests/train/test_vision_families.py).
    assert draft_target_config(Gemma3Config()).model_type == "gemma3_text"
    head = build_head({"type": "dflash", "layer_ids": [1, 3, 4]}, gemma3_target)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    with pytest.raises(ValueError, match="dflash head for a gemma3_text target as 'vllm'.*no engine serves it"):
        engine_files(head.config, state, "vllm", str(gemma3_run[0]), gemma3_target.config)
