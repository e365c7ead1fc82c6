"""DFlash-2 block drafters: the sublayer convolution against a per-block reference, the loss term by term, the
selector's walk through the verifier (greedy identity for chains and trees, lossless sampling), training with exact
resume, export for vLLM and import."""

import json

import pytest
import torch
from safetensors.torch import load_file

from headstart.core.config_files import ConfigError, load_config
from headstart.decoding.proposers_block import DFlash, DFlash2
from headstart.decoding.verify import Sampling, probabilities
from headstart.heads import build_head, load_head
from headstart.heads.dflash2 import GroupedConv
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from headstart.train.train_config import resolve_config
from tests.block_drafters import (
    SAMPLED_PROMPT,
    V,
    assert_decodes_as_target_greedy,
    assert_same_head,
    assert_samples_as_the_target,
    block_batch,
    block_drafter_resumes,
    exported_for_vllm,
    features,
    first_tree,
    five_token_target,
    prompts,
    served_blocks,
    trained_on,
)
from tests.helpers import REPO

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = {"type": "dflash2", "layer_ids": [1, 3, 4], "block_size": 4, "num_layers": 2, "selector_rank": 8}


def dflash2_head(target, seed: int = 1, **options):
    torch.manual_seed(seed)
    head = build_head(SETTINGS | {"selector_top_k": 4} | options, target)
    with torch.no_grad():  # convolutions and pair scores that matter, as after training (they start as identity, ~0)
        for name, p in head.named_parameters():
            if "kernel_projection" in name or "candidate_selector" in name:
                p.normal_(0, 0.3)
            elif "base_kernel" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return head


def test_the_convolution_reads_earlier_slots_of_its_own_block_only():
    torch.manual_seed(0)
    conv = GroupedConv(8, taps=3, group_size=4)
    assert torch.equal(conv.prepare(x := torch.randn(2, 10, 8), 5)[0], x)  # it starts as the identity
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 10, 8)
    out, delta = conv.prepare(x, 5)
    expected = torch.zeros_like(x)
    for b in range(2):
        for i in range(10):
            coefficients = conv.kernel_projection(x[b, i]).view(2, 3, 2)  # [side, tap, group]
            for t in range(min(3, i % 5 + 1)):  # never across the block start at 0 and 5
                kernel = conv.base_kernel[0, t] + coefficients[0, t].repeat_interleave(4)
                expected[b, i] += kernel * x[b, i - t]
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(delta, conv.kernel_projection(x).view(2, 10, 2, 3, 2)[:, :, 1])


def test_loss_is_the_block_loss_plus_the_selectors_over_every_block_recomputed_through_the_served_block(
    peaked_wide_llama,
):
    head = dflash2_head(peaked_wide_llama, num_anchors=64, loss_gamma=2.0, selector_weight=0.5)
    batch = block_batch(peaked_wide_llama, head)
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    loss, metrics = head.loss(batch)
    slot_sums, counts, inserted = torch.zeros(3), torch.zeros(3), 0
    selector = head.candidate_selector
    with torch.no_grad():
        for b, a, hidden in served_blocks(head, batch, 3):
            for k in range(len(hidden)):
                if not loss_mask[b, a + 1 + k]:
                    continue
                logits = peaked_wide_llama.lm_head(hidden[k])
                p_target = peaked_wide_llama.lm_head(batch["last_hidden"][b, a + k]).softmax(-1)
                gold = int(p_target.argmax())
                unary, candidates = logits.topk(4)
                if gold not in candidates.tolist():  # the gold replaces the weakest candidate
                    candidates[-1], unary[-1], inserted = gold, logits[gold], inserted + 1
                query = selector.predecessor_codebook[ids[b, a + k]] * selector.hidden_projection(hidden[k])
                scores = unary + selector.successor_codebook[candidates] @ query
                ce = -scores.log_softmax(-1)[candidates.tolist().index(gold)]
                slot_sums[k] += -(p_target * logits.log_softmax(-1)).sum() + 0.5 * ce
                counts[k] += 1
    weights = torch.exp(-torch.arange(3) / 2.0)
    torch.testing.assert_close(loss, (weights * slot_sums / counts).sum() / weights.sum(), atol=1e-4, rtol=1e-4)
    assert 0 < inserted < counts.sum() and 0 < metrics["candidate_recall"] < 1
    loss.backward()  # every new part learns: the convolutions, both codebooks, the projection
    for name in ("layers.0.attention_conv.kernel_projection.weight", "layers.1.mlp_conv.base_kernel", "fc.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name
    for p in selector.parameters():
        assert p.grad.abs().sum() > 0
    assert peaked_wide_llama.lm_head.weight.grad is None


def test_training_raises_the_selectors_chain_accuracy(peaked_wide_llama):
    head = dflash2_head(peaked_wide_llama, num_anchors=64)
    batch = block_batch(peaked_wide_llama, head)
    first, (loss, metrics) = trained_on(head, batch, 40)
    assert loss < 0.5 * first[0] and metrics["selector_ce"] < 0.5 * first[1]["selector_ce"]
    assert metrics["acc_0"] > first[1]["acc_0"] and metrics["acc_2"] > 0.5


def test_each_node_is_its_parents_best_candidate_under_the_selector(peaked_wide_llama):
    head = dflash2_head(peaked_wide_llama)
    proposer = DFlash2(head, choices=[[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0]])
    tokens = prompts()[2][0]
    tree, aux = first_tree(peaked_wide_llama, proposer)
    with torch.no_grad():
        hidden = head.draft_hidden(tokens[-1], 11, head.context_kv(aux, torch.arange(11)[None]), 3)
        first = head.walk_logits(hidden[0], tokens[-1:])[0]
        second = head.walk_logits(hidden[1], first.topk(2).indices[1:])[0]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1, 2] and tree.tokens[:2].tolist() == first.topk(2).indices.tolist()
    assert tree.tokens[3:5].tolist() == second.topk(2).indices.tolist()  # the second candidate's own ranking
    # vLLM's edge score, written out: the slot's top-k by the lm_head, each scored by its logit plus the pair term.
    selector = head.candidate_selector
    unary, candidates = peaked_wide_llama.lm_head(hidden[1]).topk(4)
    query = selector.predecessor_codebook[tree.tokens[1]] * selector.hidden_projection(hidden[1])
    scores = unary + selector.successor_codebook[candidates] @ query
    assert tree.tokens[3:5].tolist() == candidates[scores.topk(2).indices].tolist()


@pytest.mark.parametrize("choices", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["chain", "tree"])
def test_greedy_output_equals_target_greedy(peaked_wide_llama, choices):
    head = dflash2_head(peaked_wide_llama)
    assert_decodes_as_target_greedy(peaked_wide_llama, DFlash2(head, choices), lambda: DFlash2(head, choices))


def test_sampled_selector_tree_is_lossless():
    target = five_token_target()
    head = dflash2_head(target, seed=4, selector_top_k=3, selector_rank=4)
    sampling = Sampling(temperature=1.0)
    prompt = SAMPLED_PROMPT
    with torch.no_grad():
        aux, _ = features(target, prompt[:, :-1], head.hidden_layers)
        hidden = head.draft_hidden(prompt[0, -1], 6, head.context_kv(aux, torch.arange(6)[None]), 2)
        q0 = probabilities(head.walk_logits(hidden[0], prompt[0, -1:])[0], sampling)
        q1 = probabilities(head.walk_logits(hidden[1], torch.arange(5)), sampling)
    assert (q0 == 0).sum() == 2  # two of five tokens are never candidates: the draft cannot propose them
    choices = [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert_samples_as_the_target(target, lambda: DFlash2(head, choices), sampling, (q0[:, None] * q1).flatten())


def test_refusals(peaked_wide_llama):
    with pytest.raises(ValueError, match="DFlash drafting needs a dflash head, not a dflash2 head"):
        DFlash(dflash2_head(peaked_wide_llama))
    with pytest.raises(ValueError, match="DFlash-2 picks its candidates over the target's whole vocabulary"):
        build_head(SETTINGS | {"draft_vocab_size": 100}, peaked_wide_llama)
    with pytest.raises(ValueError, match="head.conv_group_size 48 must divide the hidden size 64"):
        build_head(SETTINGS | {"conv_group_size": 48}, peaked_wide_llama)


def test_training_resumes_to_the_same_head(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    # train/eagle.py (the config's dflash2 head) through DeepSpeed (a world of one, online capture), with D-PACE:
    # 4 steps straight, then resumed from the step-2 checkpoint, the same head bit for bit.
    head = {"type": "dflash2", "block_size": 3, "num_anchors": 8, "selector_rank": 8, "loss_weighting": "dpace"}
    straight, heldout, _ = block_drafter_resumes(monkeypatch, tmp_path, tiny_target_dir, gsm8k_file, head)
    assert {"selector_ce", "candidate_recall", "acc_0", "acc_1"} <= heldout.keys() and "acc_2" not in heldout
    assert {"candidate_selector.successor_codebook", "layers.0.mlp_conv.base_kernel"} <= straight.keys()


def test_export_for_vllm_and_import_back_to_the_same_drafts(peaked_wide_llama, tmp_path):
    head = dflash2_head(peaked_wide_llama, mask_embedding=True)
    out, config, target_dir = exported_for_vllm(peaked_wide_llama, head, tmp_path)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 0,
        "target_layer_ids": [0, 2, 3],
        "causal": False,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(head.state_dict()) - {"mask_embedding"} and (out / "mask_embedding.pt").exists()
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert tensors["layers.1.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 64)
    assert tensors["candidate_selector.predecessor_codebook"].shape == (V, 8)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (8, 64)
    readme = (out / "README.md").read_text()
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme
    assert "DFlash candidate-head drafts" in readme

    imported = load_head(import_head("dflash2", out, tmp_path / "imported", str(target_dir)), peaked_wide_llama)
    assert_same_head(imported, head)
    trees = [first_tree(peaked_wide_llama, DFlash2(one, [[0], [1], [0, 0], [0, 0, 0]]))[0] for one in (head, imported)]
    assert torch.equal(trees[0].tokens, trees[1].tokens)

    with pytest.raises(ValueError, match="this is a DFlash-2 draft .*import it --from dflash2"):
        import_head("dflash", out, tmp_path / "as-dflash", str(target_dir))
    config["dflash_config"] |= {"output_multiplier": 2.0}
    del config["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks \['selector_rank'\]"):
        import_head("dflash2", out, tmp_path / "refused", str(target_dir))
    config["dflash_config"]["selector_rank"] = 8
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="uses a candidate logit multiplier"):
        import_head("dflash2", out, tmp_path / "refused", str(target_dir))
    with pytest.raises(ValueError, match="cannot export a dflash2 head as 'sglang': SGLang 0.5.23 serves DFlash"):
        export_head(tmp_path / "head", "sglang", tmp_path / "sglang", str(target_dir))


def test_a_kernel_longer_than_the_block_is_refused_with_the_config(peaked_wide_llama):
    """Unchecked, it passed every check, loaded the target and wrote config.yaml, then died mid-step."""
    overrides = ["head.conv_kernel_size=100", "head.block_size=4"]
    with pytest.raises(ConfigError, match=r"head.conv_kernel_size \(100\) must not exceed block_size \(4\)"):
        resolve_config(load_config(REPO / "configs" / "demo-dflash2.yaml", overrides), "eagle")
    head = build_head(SETTINGS | {"conv_kernel_size": 4}, peaked_wide_llama)  # every slot of a block of 4
    assert head.layers[0].attention_conv.taps == 4
