"""Domino block drafters: the loss against a per-block reference with a GRU written out gate by gate, the
curriculum, the GRU's walk through the verifier (greedy identity for chains and trees, lossless sampling), training
with exact resume, export in vLLM's DFlash layout with projector_type domino and import."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from headstart.decoding.proposers_block import DFlash, Domino
from headstart.decoding.verify import Sampling, probabilities
from headstart.heads import build_head, load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
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

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = {"type": "domino", "layer_ids": [1, 3, 4], "block_size": 4, "num_layers": 2, "gru_hidden_dim": 12}
# The public drafts' block (the anchor's slot drafts, the first draft uncorrected), DFlash's block with every draft
# corrected (the heads saved before these keys), and the shifted block with every draft corrected.
LAYOUTS = {
    "shifted": {"shift_label": True, "pure_draft_prefix_len": 1},
    "dflash-block": {"shift_label": False, "pure_draft_prefix_len": 0},
    "shifted-all-corrected": {"shift_label": True, "pure_draft_prefix_len": 0},
}
layouts = pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())


def domino_head(target, seed: int = 1, **options):
    torch.manual_seed(seed)
    head = build_head(SETTINGS | {"emb_dim": 8} | options, target)
    with torch.no_grad():  # a correction that matters, as after training (it starts at std 0.02)
        head.embed_proj[2].weight.normal_(0, 1.0)
    return head


def gru_by_hand(head, tokens):
    """The GRU state [G] after ``tokens`` from zeros, torch's equations written out (no biases)."""
    w_ih, w_hh = head.prefix_gru.weight_ih_l0, head.prefix_gru.weight_hh_l0
    state = torch.zeros(w_hh.shape[1])
    for x in head.target.embed(tokens):
        r_i, z_i, n_i = (w_ih @ x).chunk(3)
        r_h, z_h, n_h = (w_hh @ state).chunk(3)
        r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
        state = (1 - z) * torch.tanh(n_i + r * n_h) + z * state
    return state


def corrected_by_hand(head, hidden, state, draft: int = 1):
    """The logits of the block's draft ``draft`` (0: the first): the target lm_head's, plus embed_proj's two layers on
    [output, state] past the first pure_draft_prefix_len drafts."""
    base = head.target.lm_head(hidden)
    if draft < head.config.options.pure_draft_prefix_len:
        return base
    first, last = head.embed_proj[0].weight, head.embed_proj[2].weight
    return base + last @ F.silu(first @ torch.cat((hidden, state)))


# Training scores the shifted block's last slot too (the public trainers' loss); drafting is unchanged.
LOSS_LAYOUTS = LAYOUTS | {"shifted-last-slot-trained": LAYOUTS["shifted"] | {"train_last_slot": True}}


@pytest.mark.parametrize("layout", LOSS_LAYOUTS.values(), ids=LOSS_LAYOUTS.keys())
def test_loss_mixes_the_corrected_and_the_backbones_soft_cross_entropy_over_every_block(peaked_wide_llama, layout):
    settings = {"num_anchors": 64, "loss_gamma": 2.0, "lambda_base_start": 0.8, "lambda_base_decay": 0.5} | layout
    head = domino_head(peaked_wide_llama, **settings)
    head.training_progress = 0.25  # lambda = 0.8 x (1 - 0.25 / 0.5)
    batch = block_batch(peaked_wide_llama, head)
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    loss, metrics = head.loss(batch)
    assert head.eval().block_states(batch).label_at.shape[-1] == 3  # held out: the served chain's 3 drafts
    drafts = 3  # a block of 4: the shifted one's last slot is scored in training only with train_last_slot
    if layout.get("train_last_slot"):
        drafts, head.spare_slots = 4, 0  # the training block: [anchor, 3 masks], every slot drafting
    slot_sums, counts, base_hits = torch.zeros(drafts), torch.zeros(drafts), 0
    with torch.no_grad():
        for b, a, hidden in served_blocks(head, batch, drafts):
            for k in range(len(hidden)):
                if not loss_mask[b, a + 1 + k]:
                    continue
                base = peaked_wide_llama.lm_head(hidden[k])
                final = corrected_by_hand(head, hidden[k], gru_by_hand(head, ids[b, a : a + k + 1]), k)
                p_target = peaked_wide_llama.lm_head(batch["last_hidden"][b, a + k]).softmax(-1)
                ce_base = -(p_target * base.log_softmax(-1)).sum()
                slot_sums[k] += 0.6 * -(p_target * final.log_softmax(-1)).sum() + 0.4 * ce_base
                counts[k] += 1
                base_hits += int(base.argmax() == p_target.argmax())
    weights = torch.exp(-torch.arange(drafts) / 2.0)
    torch.testing.assert_close(loss, (weights * slot_sums / counts).sum() / weights.sum(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(metrics["base_hit"], torch.tensor(base_hits / counts.sum().item()))
    assert metrics["final_ce"] != metrics["base_ce"]
    loss.backward()  # every part learns: the GRU, both correction layers, the backbone; the target does not
    for name in ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "fc.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name
    assert peaked_wide_llama.lm_head.weight.grad is None


def test_the_backbones_share_falls_linearly_to_zero(peaked_wide_llama):
    head = build_head(SETTINGS | {"lambda_base_start": 0.8, "lambda_base_decay": 0.5}, peaked_wide_llama)
    shares = []
    for progress in (0.0, 0.25, 0.5, 0.9):
        head.training_progress = progress
        shares.append(head.lambda_base())
    assert shares == pytest.approx([0.8, 0.4, 0.0, 0.0])


def test_an_untrained_correction_is_small_and_its_gru_learns_from_the_first_step(peaked_wide_llama):
    torch.manual_seed(0)
    head = build_head(SETTINGS | {"num_anchors": 64, "emb_dim": 32}, peaked_wide_llama)
    for layer in (head.embed_proj[0], head.embed_proj[2]):  # the public trainers' normal(0, 0.02)
        assert layer.weight.std().item() == pytest.approx(0.02, rel=0.1) and abs(layer.weight.mean().item()) < 2e-3
    hidden, state = torch.randn(3, 64), torch.randn(3, 12)
    shift = head.corrected_logits(hidden, state) - head.logits(hidden)
    assert 0 < shift.abs().max() < 0.1  # it drafts nearly as its DFlash
    head.training_progress = 0.1  # the backbone's share still 0.9: a zero last layer would leave the GRU no gradient
    head.loss(block_batch(peaked_wide_llama, head))[0].backward()
    assert head.prefix_gru.weight_ih_l0.grad.abs().sum() > 0 and head.embed_proj[0].weight.grad.abs().sum() > 0


def test_training_raises_the_corrected_chain_accuracy_above_the_backbones(peaked_wide_llama):
    torch.manual_seed(1)
    head = build_head(SETTINGS | {"num_anchors": 64, "emb_dim": 8}, peaked_wide_llama)  # as training starts it
    batch = block_batch(peaked_wide_llama, head)
    first, (loss, metrics) = trained_on(head, batch, 80)  # lambda 0: the corrected logits only
    assert loss < 0.5 * first[0] and metrics["acc_2"] > first[1]["acc_2"] and metrics["acc_2"] > 0.5
    assert metrics["final_ce"] < metrics["base_ce"]


@layouts
def test_each_node_is_its_parents_best_under_the_gru_of_its_path(peaked_wide_llama, layout):
    head = domino_head(peaked_wide_llama, **layout)
    proposer = Domino(head, choices=[[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0]])
    tokens = prompts()[2][0]
    tree, aux = first_tree(peaked_wide_llama, proposer)
    with torch.no_grad():
        hidden = head.draft_hidden(tokens[-1], 11, head.context_kv(aux, torch.arange(11)[None]), 3)
        first = corrected_by_hand(head, hidden[0], gru_by_hand(head, tokens[-1:]), 0).topk(2).indices
        path = torch.cat((tokens[-1:], first[1:]))
        second = corrected_by_hand(head, hidden[1], gru_by_hand(head, path), 1).topk(2).indices
        third = corrected_by_hand(head, hidden[2], gru_by_hand(head, torch.cat((path, second[1:]))), 2).argmax()
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1, 4] and tree.tokens[:2].tolist() == first.tolist()
    assert tree.tokens[3:5].tolist() == second.tolist() and int(tree.tokens[5]) == int(third)


@layouts
@pytest.mark.parametrize("choices", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["chain", "tree"])
def test_greedy_output_equals_target_greedy(peaked_wide_llama, choices, layout):
    head = domino_head(peaked_wide_llama, **layout)
    assert_decodes_as_target_greedy(peaked_wide_llama, Domino(head, choices), lambda: Domino(head, choices))


@pytest.mark.parametrize("layout", [LAYOUTS["shifted"], LAYOUTS["dflash-block"]], ids=["shifted", "dflash-block"])
def test_sampled_tree_is_lossless(layout):
    target = five_token_target()
    head = domino_head(target, seed=4, emb_dim=4, **layout)
    sampling = Sampling(temperature=1.0)
    prompt = SAMPLED_PROMPT
    root = prompt[0, -1:]
    with torch.no_grad():
        aux, _ = features(target, prompt[:, :-1], head.hidden_layers)
        hidden = head.draft_hidden(root[0], 6, head.context_kv(aux, torch.arange(6)[None]), 2)
        q0 = probabilities(corrected_by_hand(head, hidden[0], gru_by_hand(head, root), 0), sampling)
        q1 = torch.stack(
            [probabilities(corrected_by_hand(head, hidden[1], gru_by_hand(head, torch.tensor([root[0], t]))), sampling)
             for t in range(5)]
        )  # fmt: skip
    choices = [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert_samples_as_the_target(target, lambda: Domino(head, choices), sampling, (q0[:, None] * q1).flatten())


def test_refusals(peaked_wide_llama):
    with pytest.raises(ValueError, match="DFlash drafting needs a dflash head, not a domino head"):
        DFlash(domino_head(peaked_wide_llama))
    with pytest.raises(ValueError, match="Domino's correction covers the target's whole vocabulary"):
        build_head(SETTINGS | {"draft_vocab_size": 100}, peaked_wide_llama)
    with pytest.raises(ValueError, match="train_last_slot needs shift_label: true"):
        build_head(SETTINGS | LAYOUTS["dflash-block"] | {"train_last_slot": True}, peaked_wide_llama)


def test_training_resumes_to_the_same_head(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    # train/eagle.py (the config's domino head) through DeepSpeed (a world of one, online capture), the backbone's
    # share falling over the 4 steps: 4 steps straight, then resumed from the step-2 checkpoint, the same head.
    head = {"type": "domino", "block_size": 3, "num_anchors": 8, "gru_hidden_dim": 8, "emb_dim": 8}
    straight, heldout, _ = block_drafter_resumes(monkeypatch, tmp_path, tiny_target_dir, gsm8k_file, head)
    assert {"final_ce", "base_ce", "base_hit", "acc_0", "acc_1"} <= heldout.keys()
    assert straight["embed_proj.2.weight"].abs().sum() > 0  # the correction learned once the share fell


def test_export_in_vllms_dflash_layout_with_the_domino_head_and_import_back(peaked_wide_llama, tmp_path):
    head = domino_head(peaked_wide_llama, mask_embedding=True)
    out, config, target_dir = exported_for_vllm(peaked_wide_llama, head, tmp_path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 0,
        "target_layer_ids": [0, 2, 3],
        "causal": False,
        "projector_type": "domino",
        "gru_hidden_dim": 12,
        "emb_dim": 8,
        "shift_label": True,
        "pure_draft_prefix_len": 1,
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(head.state_dict()) - {"mask_embedding"} and (out / "mask_embedding.pt").exists()
    # The names and shapes vLLM's DominoHead builds (nn.GRU(H, G, bias=False); embed_proj [H + G -> E -> V]).
    domino = {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(("prefix_gru.", "embed_proj."))}
    assert domino == {
        "prefix_gru.weight_ih_l0": (3 * 12, 64),
        "prefix_gru.weight_hh_l0": (3 * 12, 12),
        "embed_proj.0.weight": (8, 64 + 12),
        "embed_proj.2.weight": (V, 8),
    }
    readme = (out / "README.md").read_text()
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme and "predates Domino" in readme

    imported = load_head(import_head("domino", out, tmp_path / "imported", str(target_dir)), peaked_wide_llama)
    assert_same_head(imported, head)
    trees = [first_tree(peaked_wide_llama, Domino(one, [[0], [1], [0, 0], [0, 0, 0]]))[0] for one in (head, imported)]
    assert torch.equal(trees[0].tokens, trees[1].tokens)

    with pytest.raises(ValueError, match="a DFlash draft with a domino projector: import it --from domino"):
        import_head("dflash", out, tmp_path / "as-dflash", str(target_dir))

    def imported_as(name: str, change: dict, architecture: str = "DFlashDraftModel"):
        settings = {k: v for k, v in (config["dflash_config"] | change).items() if v is not None}
        edited = config | {"architectures": [architecture], "dflash_config": settings}
        (out / "config.json").write_text(json.dumps(edited))
        return import_head("domino", out, tmp_path / name, str(target_dir))

    # A config without the block's keys reads as its readers default them: DFlash's block. Then the architecture
    # name some public configs carry.
    no_keys = LAYOUTS["dflash-block"] | {"shift_label": None}
    unshifted = load_head(imported_as("readers-defaults", no_keys), peaked_wide_llama)
    assert unshifted.config.options.shift_label is False and unshifted.config.options.pure_draft_prefix_len == 0
    assert load_head(imported_as("named-domino", {}, "DominoDraftModel"), peaked_wide_llama).config.options.shift_label
    # Early SpecForge checkpoints: the GRU and the correction under a logit_head container.
    tensors = load_file(str(out / "model.safetensors"))
    nested = {
        ("logit_head." if k.startswith(("prefix_gru.", "embed_proj.")) else "") + k: v for k, v in tensors.items()
    }
    save_file(nested, str(out / "model.safetensors"))
    assert_same_head(load_head(imported_as("logit-head", {}), peaked_wide_llama), head)
    for change, why in (({"pure_draft_prefix_len": 3}, "pure_draft_prefix_len 3 leaves none of the block's 3 drafts"),
                        ({"emb_dim": None}, r"lacks \['emb_dim'\]")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            imported_as("refused", change)
    with pytest.raises(ValueError, match="cannot export a domino head as 'sglang': SGLang 0.5.23 serves DFlash-family"):
        export_head(tmp_path / "head", "sglang", tmp_path / "sglang", str(target_dir))


def test_a_head_saved_before_the_block_keys_reads_as_it_was_trained(peaked_wide_llama, tmp_path):
    """Heads saved before shift_label and pure_draft_prefix_len existed trained DFlash's block, every draft corrected:
    their config.json lacks both keys, and they load as that, not as today's defaults."""
    head = domino_head(peaked_wide_llama, **LAYOUTS["dflash-block"])
    head.save_pretrained(tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["shift_label"] is False and saved["pure_draft_prefix_len"] == 0
    old = {k: v for k, v in saved.items() if k not in LAYOUTS["dflash-block"]}
    (tmp_path / "head" / "config.json").write_text(json.dumps(old))
    loaded = load_head(tmp_path / "head", peaked_wide_llama)
    assert (loaded.first_drafting_slot, loaded.spare_slots) == (1, 0)
    trees = [first_tree(peaked_wide_llama, Domino(one, [[0], [0, 0], [0, 0, 0]]))[0] for one in (head, loaded)]
    assert torch.equal(trees[0].tokens, trees[1].tokens)
    assert build_head(SETTINGS, peaked_wide_llama).config.options.shift_label  # a new head: the public block
