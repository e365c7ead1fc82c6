"""DSpark block drafters: DeepSpec's loss term by term, drafting through the verifier (greedy identity for chains,
trees and every confidence cut, lossless sampling), training with exact resume, export for vLLM and import."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from headstart.decoding.proposers_block import DFlash
from headstart.decoding.proposers_dspark import DSpark
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import Sampling, generate, probabilities
from headstart.heads import NonFiniteWeights, build_head, load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from tests.block_drafters import (
    NEW,
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
from tests.helpers import greedy_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def dspark_head(target, seed: int = 1, **options):
    torch.manual_seed(seed)
    settings = {"type": "dspark", "layer_ids": [1, 3, 4], "block_size": 4, "num_layers": 2, "markov_rank": 16}
    head = build_head(settings | options, target)
    with torch.no_grad():  # a Markov bias that matters, as after training (it starts at 0)
        head.markov_head.markov_w2.weight.normal_(0, 0.5)
    return head


@pytest.mark.parametrize("draft_vocab_size", [None, 150])
def test_loss_is_deepspecs_over_every_block_recomputed_through_the_served_block(peaked_wide_llama, draft_vocab_size):
    # Every candidate is an anchor (num_anchors >= positions): each block's terms recomputed from the block
    # vLLM drafts (the anchor + masks, every slot drafting the next token), the Markov bias of the data's
    # previous token, the target's distribution one position earlier.
    head = dspark_head(peaked_wide_llama, num_anchors=64, draft_vocab_size=draft_vocab_size, loss_gamma=2.0)
    if draft_vocab_size:
        head.set_vocab_mapping(torch.arange(V).flip(0).float())  # the draft vocabulary: the ids 0..149
    batch = block_batch(peaked_wide_llama, head)
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    loss, metrics = head.loss(batch)
    total, weight = torch.tensor(0.0), torch.tensor(0.0)
    draft_ids = head.draft_ids()
    with torch.no_grad():
        for b, a, hidden in served_blocks(head, batch, 4):
            for k in range(len(hidden)):
                if not loss_mask[b, a + 1 + k]:
                    break  # scored up to the first unlabelled slot
                previous = head.markov_head.markov_w1(ids[b, a + k])
                logits = head.draft_logits(hidden[k]) + head.markov_head.markov_w2(previous)
                p_target = peaked_wide_llama.lm_head(batch["last_hidden"][b, a + k])[draft_ids].softmax(-1)
                l1 = (logits.softmax(-1) - p_target).abs().sum()
                token = int(ids[b, a + k + 1])
                in_vocab = bool((draft_ids == token).any())
                ce = -logits.log_softmax(-1)[(draft_ids == token).nonzero()[0, 0]] if in_vocab else 0.0
                conf = head.confidence_head.proj(torch.cat((hidden[k], previous)))[0]
                bce = F.binary_cross_entropy_with_logits(conf, (1 - l1 / 2).clamp(0, 1))
                w = torch.exp(torch.tensor(-k / 2.0))
                total += w * (0.1 * ce + 0.9 * l1 + bce)
                weight += w
    torch.testing.assert_close(loss, total / weight, atol=1e-4, rtol=1e-4)
    assert {"confidence_bce", "confidence_gap", "acc_3", "loss_3"} <= set(metrics)
    loss.backward()  # DeepSpec's gradient paths: the backbone, both Markov tables and the confidence head
    for p in (head.fc.weight, head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert head.confidence_head.proj.weight.grad.abs().sum() > 0 and peaked_wide_llama.lm_head.weight.grad is None


def test_training_lowers_every_term_and_the_confidence_head_learns_the_acceptance_rate(peaked_wide_llama):
    head = dspark_head(peaked_wide_llama, num_anchors=64)
    batch = block_batch(peaked_wide_llama, head)
    first, (loss, metrics) = trained_on(head, batch, 120)
    assert loss < 0.5 * first[0]
    assert abs(float(metrics["confidence_gap"])) < 0.05 and metrics["acc_0"] > first[1]["acc_0"]


def test_the_tree_adds_each_parents_markov_bias_to_its_depths_logits(peaked_wide_llama):
    head = dspark_head(peaked_wide_llama)
    proposer = DSpark(head, choices=[[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0]])
    tokens = prompts()[2][0]
    tree, aux = first_tree(peaked_wide_llama, proposer)
    with torch.no_grad():
        hidden = head.draft_hidden(tokens[-1], 11, head.context_kv(aux, torch.arange(11)[None]), 3)
        first = head.markov_logits(hidden[0], tokens[-1]).topk(2).indices
        second = head.markov_logits(hidden[1], first[1]).topk(2).indices
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1, 2] and tree.tokens[:2].tolist() == first.tolist()
    assert tree.tokens[3:5].tolist() == second.tolist()  # the children of the second candidate: its own bias
    assert tree.survival is not None and (tree.survival[2:5] < tree.survival[tree.parents[2:5]]).all()


@pytest.mark.parametrize("choices", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]], ids=["chain", "tree"])
@pytest.mark.parametrize("min_confidence", [0.0, 0.3, 0.9])
def test_greedy_output_equals_target_greedy_at_every_confidence_cut(peaked_wide_llama, choices, min_confidence):
    head = dspark_head(peaked_wide_llama)
    tree = TreeSpec.static(choices or [[0] * d for d in range(1, 5)])
    proposer = DSpark.for_tree(head, TreeSpec(**{**tree.__dict__, "min_confidence": min_confidence}))
    assert_decodes_as_target_greedy(peaked_wide_llama, proposer, lambda: DSpark(head, choices))


def test_a_bf16_head_and_target_score_confidence_and_decode_as_the_bf16_target(peaked_wide_llama):
    """On a GPU the whole head is cast to bf16 (eval --dtype bf16, DeepSpeed's bf16 training): the confidence
    head computes in its own dtype and hands back an fp32 logit (it once met fp32 inputs and failed)."""
    head = dspark_head(peaked_wide_llama)
    half_head, half_target = (
        dspark_head(peaked_wide_llama).to(torch.bfloat16),
        copy.deepcopy(peaked_wide_llama).to(torch.bfloat16),
    )
    hidden, previous = torch.randn(6, head.config.arch.hidden_size), torch.arange(6)
    logit = half_head.confidence_logit(hidden.to(torch.bfloat16), previous)
    assert logit.dtype == torch.float32
    torch.testing.assert_close(logit, head.confidence_logit(hidden, previous), atol=0.05, rtol=0.05)
    proposer = DSpark(half_head, min_confidence=0.3)
    for prompt in prompts():
        out, _ = generate(half_target, proposer, prompt, NEW, eos_token_id=peaked_wide_llama.config.eos_token_id)
        assert torch.equal(out, greedy_reference(half_target, prompt))
    loss, metrics = half_head.loss(block_batch(half_target, half_head))
    assert torch.isfinite(loss) and metrics["confidence_bce"].dtype == torch.float32


def test_the_confidence_cut_drafts_less_where_the_head_doubts(peaked_wide_llama):
    head = dspark_head(peaked_wide_llama)
    tokens = prompts()[2][0]
    aux, _ = features(peaked_wide_llama, tokens[None, :-1], head.hidden_layers)
    sizes = []
    for threshold in (0.0, 0.45, 0.99):
        proposer = DSpark(head, min_confidence=threshold)
        proposer.reset(Sampling())
        with torch.no_grad():
            proposer.update(tokens, aux[0])
            sizes.append(len(proposer.propose(tokens)))
    assert sizes[0] == 4 and sizes[2] == 1 and sizes[0] >= sizes[1] >= sizes[2]


def test_sampled_markov_tree_with_a_confidence_cut_is_lossless():
    target = five_token_target()
    head = dspark_head(target, seed=4, markov_rank=4)
    sampling = Sampling(temperature=1.0)
    prompt = SAMPLED_PROMPT
    with torch.no_grad():
        aux, _ = features(target, prompt[:, :-1], head.hidden_layers)
        hidden = head.draft_hidden(prompt[0, -1], 6, head.context_kv(aux, torch.arange(6)[None]), 2)
        q0 = probabilities(head.markov_logits(hidden[0], prompt[0, -1]), sampling)
        q1 = probabilities(head.markov_logits(hidden[1].expand(5, -1), torch.arange(5)), sampling)
    choices, wrong = [[0], [1], [0, 0], [0, 1], [1, 0]], (q0[:, None] * q1).flatten()
    assert_samples_as_the_target(target, lambda: DSpark(head, choices, min_confidence=0.2), sampling, wrong)


def test_a_dflash_proposer_refuses_a_dspark_head_and_a_mask_embedding_is_refused(peaked_wide_llama):
    head = dspark_head(peaked_wide_llama)
    with pytest.raises(ValueError, match="DFlash drafting needs a dflash head, not a dspark head"):
        DFlash(head)
    with pytest.raises(ValueError, match="vLLM's DSpark ignores a learned mask vector"):
        dspark_head(peaked_wide_llama, mask_embedding=True)
    with pytest.raises(ValueError, match="trained without one"):
        DSpark(dspark_head(peaked_wide_llama, confidence_head=False), min_confidence=0.5)


def test_training_resumes_to_the_same_head(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    # train/eagle.py (the config's dspark head) through DeepSpeed (a world of one, online capture): 4 steps
    # straight, then resumed from the step-2 checkpoint: the same blocks from the loop's per-micro-batch seeds, the
    # same head bit for bit.
    head = {"type": "dspark", "block_size": 3, "num_anchors": 8, "markov_rank": 8, "loss_weighting": "dpace"}
    straight, heldout, _ = block_drafter_resumes(monkeypatch, tmp_path, tiny_target_dir, gsm8k_file, head)
    assert sorted(k for k in heldout if k.startswith("acc_")) == ["acc_0", "acc_1", "acc_2"]  # 3 slots, 3 drafts
    assert "confidence_bce" in heldout
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.bias"} <= straight.keys()


@pytest.mark.parametrize("confidence_head", [True, False])
def test_export_for_vllm_and_import_back_to_the_same_logits(peaked_wide_llama, tmp_path, confidence_head):
    head = dspark_head(peaked_wide_llama, draft_vocab_size=120, confidence_head=confidence_head)
    head.set_vocab_mapping(torch.arange(V).float())  # the 120 highest ids
    out, config, target_dir = exported_for_vllm(peaked_wide_llama, head, tmp_path)
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["sample_from_anchor"] is True and "sample_from_anchor" not in config["dflash_config"]
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 2, 3], "causal": False}
    assert (config["markov_rank"], config["markov_head_type"], config["mask_token_id"]) == (16, "vanilla", 0)
    assert config["enable_confidence_head"] is config["confidence_head_with_markov"] is confidence_head
    assert (config["block_size"], config["draft_vocab_size"]) == (4, 120)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(head.state_dict()) - {"t2d"}
    assert tensors["markov_head.markov_w1.weight"].shape == (V, 16)
    assert tensors["markov_head.markov_w2.weight"].shape == (120, 16)
    if confidence_head:
        assert tensors["confidence_head.proj.weight"].shape == (1, 64 + 16)
    readme = (out / "README.md").read_text()
    assert '"method": "dspark"' in readme and '"num_speculative_tokens": 4' in readme
    assert "Model Runner V2 requires Triton" in readme

    imported = load_head(import_head("dspark", out, tmp_path / "imported", str(target_dir)), peaked_wide_llama)
    assert_same_head(imported, head)
    tokens = prompts()[2][0]
    drafted = []
    for one in (head, imported):
        proposer = DSpark(one, [[0], [1], [0, 0], [0, 0, 0]])
        tree, _ = first_tree(peaked_wide_llama, proposer)
        with torch.no_grad():
            hidden = one.draft_hidden(tokens[-1], 11, proposer.context_kv, 3)
            drafted.append((tree.tokens, one.markov_logits(hidden, tree.tokens[[0, 2, 3]])))
    assert torch.equal(drafted[0][0], drafted[1][0]) and torch.equal(drafted[0][1], drafted[1][1])

    config["sample_from_anchor"], config["markov_head_type"] = False, "rnn"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"uses the fill-in block .*, a 'rnn' Markov head"):
        import_head("dspark", out, tmp_path / "refused", str(target_dir))
    with pytest.raises(
        ValueError, match=r"cannot export a dspark head as 'sglang': no SGLang DSpark layout is written"
    ):
        export_head(tmp_path / "head", "sglang", tmp_path / "sglang", str(target_dir))


def test_a_dspark_checkpoint_with_a_nan_is_refused_on_import_naming_the_tensor(peaked_wide_llama, tmp_path):
    # Unchecked, it would evaluate at tau 1.000, "greedy identical" (NaN scores argmax to one token), and export.
    out, _, target_dir = exported_for_vllm(peaked_wide_llama, dspark_head(peaked_wide_llama), tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["markov_head.markov_w2.weight"][0, :2] = float("nan")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeights, match=r"dspark checkpoint .*: markov_head.markov_w2.weight \(2 NaN, 0 inf"):
        import_head("dspark", out, tmp_path / "imported", str(target_dir))
    assert not (tmp_path / "imported").exists()


def test_confidence_tensors_a_checkpoint_says_it_has_none_of_are_refused_like_any_extra_tensor(
    peaked_wide_llama, tmp_path
):
    head = dspark_head(peaked_wide_llama)  # with a confidence head
    out, config, target_dir = exported_for_vllm(peaked_wide_llama, head, tmp_path)
    (out / "config.json").write_text(json.dumps(config | {"enable_confidence_head": False}))
    with pytest.raises(ValueError, match=r"unexpected .*confidence_head\.proj\.weight"):
        import_head("dspark", out, tmp_path / "imported", str(target_dir))
    assert not (tmp_path / "imported").exists()
    tensors = load_file(str(out / "model.safetensors"))  # and a config that has one, without its tensors
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing .*confidence_head\.proj\.weight"):
        import_head("dspark", out, tmp_path / "imported", str(target_dir))
