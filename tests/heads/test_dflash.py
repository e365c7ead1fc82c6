"""DFlash block drafters: the block attention, training blocks == served blocks, the loss and its metrics,
drafting through the verifier (greedy identity, lossless sampling), training with exact resume, export and
import in vLLM's layout."""

import io
import json
import logging
import os
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from headstart.decoding.methods import TreeSettings, build_proposer
from headstart.decoding.proposers_block import DFlash
from headstart.decoding.tree_config import comb_choices
from headstart.decoding.verify import Sampling, generate, probabilities
from headstart.heads import build_head, load_head
from headstart.heads.block_options import resolve_mask_token_id
from headstart.heads.sparse_attention import block_attention
from headstart.scripts.export.command import export_head
from headstart.scripts.export.command import main as export_main
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
from tests.helpers import TARGET, WIDE, greedy_reference, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def dflash_head(target, seed: int = 1, **options):
    torch.manual_seed(seed)
    return build_head({"type": "dflash", "layer_ids": [1, 3, 4], "block_size": 5, "num_layers": 2, **options}, target)


def test_block_attention_equals_dense_masked_attention():
    # N blocks of S slots over a context, 6 query heads on 2 key/value heads: what one SDPA call computes
    # with the dense [N*S, C + N*S] mask and each key/value head repeated for its group.
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, blocks, size, ctx, dim = 2, 6, 2, 4, 5, 9, 8
    q = torch.randn(batch, heads, blocks * size, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, blocks * size, dim, generator=gen) for _ in range(2))
    ck, cv = (torch.randn(batch, kv_heads, ctx, dim, generator=gen) for _ in range(2))
    anchors = torch.randint(0, ctx, (batch, blocks), generator=gen)
    visible = torch.arange(ctx) < anchors[..., None]  # [batch, N, C]: a block sees the context before its anchor
    keys, values = (torch.cat(pair, 2).repeat_interleave(3, dim=1) for pair in ((ck, k), (cv, v)))
    for causal in (False, True):
        own = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool)] * blocks)
        if causal:
            own &= torch.ones(blocks * size, blocks * size, dtype=torch.bool).tril()
        mask = torch.cat((visible.repeat_interleave(size, 1), own.expand(batch, -1, -1)), -1)[:, None]
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        torch.testing.assert_close(block_attention(q, k, v, ck, cv, visible, causal), dense, atol=1e-5, rtol=1e-5)
    one = block_attention(q[:, :, :size], k[:, :, :size], v[:, :, :size], ck, cv, None, False)  # served: sees all
    full = F.scaled_dot_product_attention(
        q[:, :, :size], *(torch.cat(p, 2) for p in ((ck, k[:, :, :size]), (cv, v[:, :, :size]))), enable_gqa=True
    )
    torch.testing.assert_close(one, full, atol=1e-5, rtol=1e-5)


def test_many_training_blocks_equal_one_served_block_each(peaked_wide_llama):
    # The training forward (every anchor's block in one pass, the context masked per block) gives each
    # block the logits drafting computes from a context cut at its anchor; the context's keys come from
    # the target's states at the context tokens' own positions.
    head = dflash_head(peaked_wide_llama).eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(2, V, (1, 24), generator=gen)
    aux, _ = features(peaked_wide_llama, ids, head.hidden_layers)
    anchors = torch.tensor([[0, 5, 11, 19]])
    size = head.config.options.block_size
    positions = anchors[..., None] + torch.arange(size)
    blocks = torch.full_like(positions, head.mask_token_id)
    blocks[..., 0] = ids[0, anchors]
    with torch.no_grad():
        context = head.context_kv(aux, torch.arange(24)[None])
        visible = torch.arange(24) < anchors[..., None]
        together = head.logits(head(blocks.flatten(1), positions.flatten(1), context, visible)).view(4, size, V)
        for n, a in enumerate(anchors[0].tolist()):
            alone = head.draft_block(ids[0, a], a, head.context_kv(aux[:, :a], torch.arange(a)[None]), size - 1)
            torch.testing.assert_close(together[n, 1:], alone, atol=1e-4, rtol=1e-4)
        # Bidirectional: slot 1 sees the later mask slots, so a shorter block drafts it differently.
        short = head.draft_block(ids[0, 11], 11, head.context_kv(aux[:, :11], torch.arange(11)[None]), 2)
        assert (short[0] - together[2, 1]).abs().max() > 1e-3


def test_mask_token_and_layer_ids():
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    config = AutoModelForCausalLM.from_pretrained(TARGET).config
    # The bundled tokenizer fills all 8192 rows: its pad token (3) is the mask.
    assert len(tokenizer) == config.vocab_size and resolve_mask_token_id(config, tokenizer) == tokenizer.pad_token_id
    config.vocab_size = 8200  # a table with rows no text uses: the first of them
    assert resolve_mask_token_id(config, tokenizer) == 8192
    target = tiny_llama(**WIDE)
    assert build_head({"type": "dflash", "layer_ids": [2, 3]}, target).mask_token_id == 0  # the config's pad
    with pytest.raises(ValueError, match=r"DFlash layer_ids \[0\] out of range: the target's layers 1..5"):
        build_head({"type": "dflash", "layer_ids": [0, 2]}, target)
    with pytest.raises(ValueError, match="mask_token_id 300 is not a row of the target's 300 embeddings"):
        build_head({"type": "dflash", "layer_ids": [2, 3], "mask_token_id": 300}, target)


def test_loss_is_the_weighted_soft_cross_entropy_of_every_block(peaked_wide_llama):
    # With at least as many anchors as positions every candidate is an anchor: the loss and its metrics,
    # recomputed block by block through the drafting path.
    head = dflash_head(peaked_wide_llama, num_anchors=64, loss_gamma=2.0)
    batch = block_batch(peaked_wide_llama, head, gap=False)
    loss_mask, last = batch["loss_mask"], batch["last_hidden"]
    # Fit these blocks a little, so that acceptance chains get long enough to count.
    _, (loss, metrics) = trained_on(head, batch, 150)

    size, weights = head.config.options.block_size, torch.exp(-torch.arange(4) / 2.0)
    ce_sum, counts, tried, hits = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    with torch.no_grad():
        for b, a, hidden in served_blocks(head, batch, size - 1):  # an anchor needs a label right after it
            logp = head.logits(hidden).log_softmax(-1)
            target_logp = peaked_wide_llama.lm_head(last[b, a : a + size - 1]).log_softmax(-1)
            chain = True
            for k in range(len(hidden)):
                if not loss_mask[b, a + 1 + k]:
                    break
                ce_sum[k] -= (target_logp[k].exp() * logp[k]).sum()
                counts[k] += 1
                if chain:
                    tried[k] += 1
                    chain = bool(logp[k].argmax() == target_logp[k].argmax())
                    hits[k] += chain
    expected = (weights * ce_sum / counts).sum() / weights.sum()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    assert hits.min() > 0, (tried, hits)  # the chains reach every slot
    torch.testing.assert_close(torch.stack([metrics[f"acc_{k}"] for k in range(4)]), hits / tried)
    slot_losses = torch.stack([metrics[f"loss_{k}"] for k in range(4)])
    torch.testing.assert_close(slot_losses, ce_sum / counts, atol=1e-4, rtol=1e-4)
    assert counts.tolist() == [17, 15, 13, 11] and sorted(metrics) == sorted(
        [f"acc_{k}" for k in range(4)] + [f"loss_{k}" for k in range(4)]
    )
    loss.backward()  # gradients reach the draft, never the frozen target
    assert head.fc.weight.grad is not None and peaked_wide_llama.lm_head.weight.grad is None


def test_the_tree_holds_each_depths_candidates_from_one_block(peaked_wide_llama):
    head = dflash_head(peaked_wide_llama)
    proposer = DFlash(head, choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tokens = prompts()[2][0]
    tree, aux = first_tree(peaked_wide_llama, proposer)
    with torch.no_grad():
        top = head.draft_block(tokens[-1], len(tokens) - 1, head.context_kv(aux, torch.arange(11)[None]), 4).topk(2)
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 3] and tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    ranks = [0, 1, 0, 1, 0, 0]
    assert tree.tokens.tolist() == [int(top.indices[d - 1, r]) for d, r in zip(tree.depths.tolist(), ranks)]
    with pytest.raises(ValueError, match="tree depth 5 needs more than the block's 4 drafting slots"):
        proposer.choices = comb_choices(5, 2)


@pytest.mark.parametrize("choices", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]], ids=["chain", "tree"])
def test_greedy_output_equals_target_greedy(peaked_wide_llama, choices):
    head = dflash_head(peaked_wide_llama)
    runs = assert_decodes_as_target_greedy(peaked_wide_llama, DFlash(head, choices), lambda: DFlash(head, choices))
    assert all(stats.target_forwards == len(stats.accepted_lengths) for stats in runs)


def test_greedy_output_equals_the_bundled_targets_own():
    # The bundled 22M Llama and a fresh DFlash head on its EAGLE-3 layers: drafts are mostly rejected,
    # the output must still be the target's greedy tokens, token for token.
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    torch.manual_seed(0)
    head = build_head({"type": "dflash", "block_size": 8}, model, tokenizer)
    assert head.hidden_layers == (2, 5, 7) and head.mask_token_id == tokenizer.pad_token_id  # the defaults
    question = [{"role": "user", "content": "Tom has 3 boxes of 12 pencils. He gives away 7. How many are left?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = prompt["input_ids"]
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    for choices in (None, [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]):
        out, stats = generate(model, DFlash(head, choices=choices), prompt, 24)
        assert torch.equal(out, expected[:, : out.shape[1]]) and out.shape[1] == expected.shape[1]


def test_sampled_block_tree_is_lossless():
    # A tree whose depth-1 siblings are drawn without replacement from the first mask slot's q.
    target = five_token_target()
    head = dflash_head(target, seed=4)
    sampling = Sampling(temperature=1.0)
    prompt = SAMPLED_PROMPT
    with torch.no_grad():
        aux, _ = features(target, prompt[:, :-1], head.hidden_layers)
        context = head.context_kv(aux, torch.arange(6)[None])
        q = probabilities(head.draft_block(prompt[0, -1], 6, context, 4), sampling)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert_samples_as_the_target(
        target, lambda: DFlash(head, choices), sampling, (q[0][:, None] * q[1][None]).flatten()
    )


def test_export_for_vllm_and_import_back(peaked_wide_llama, tmp_path):
    head = dflash_head(peaked_wide_llama, mask_embedding=True, causal=True)
    with torch.no_grad():
        head.mask_embedding.normal_()  # a learned vector, not the row it started from
    out, config, target_dir = exported_for_vllm(peaked_wide_llama, head, tmp_path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 2, 3], "causal": True}
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config  # they would win
    assert (config["num_hidden_layers"], config["head_dim"], config["block_size"]) == (2, 16, 5)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(head.state_dict()) - {"mask_embedding"}
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in tensors)  # vLLM shares the target's
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == 0 and torch.equal(mask["embedding"], head.mask_embedding.detach())
    assert (
        '"method": "dflash"' in (out / "README.md").read_text()
        and '"num_speculative_tokens": 4' in (out / "README.md").read_text()
    )

    imported = load_head(import_head("dflash", out, tmp_path / "imported", str(target_dir)), peaked_wide_llama)
    assert_same_head(imported, head)
    assert imported.config.arch == head.config.arch

    # What the head cannot be is refused by name, not half-imported.
    config["dflash_config"]["use_swa"] = True
    config["vocab_size"] = 100
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="uses sliding-window attention, an embedding table of 100 rows"):
        import_head("dflash", out, tmp_path / "refused", str(target_dir))
    sglang = r"cannot export a dflash head as 'sglang': SGLang 0.5.23 serves DFlash-family drafts \(.*DFLASH\)"
    with pytest.raises(ValueError, match=sglang):
        export_head(tmp_path / "head", "sglang", tmp_path / "sglang", str(target_dir))


def test_training_resumes_to_the_same_head(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    # train/eagle.py (the config's dflash head) through DeepSpeed (a world of one, online capture): 4 steps
    # straight, then the same run resumed from its step-2 checkpoint. The blocks of every step are drawn from the
    # generator the loop seeds per micro-batch, so the resumed run trains on the same blocks: the same head, bit for
    # bit.
    head = {"type": "dflash", "block_size": 4, "num_anchors": 8, "mask_embedding": True}
    straight, heldout, out = block_drafter_resumes(monkeypatch, tmp_path, tiny_target_dir, gsm8k_file, head)
    assert sorted(k for k in heldout if k.startswith("acc_")) == ["acc_0", "acc_1", "acc_2"]
    head_config = json.loads((out / "head" / "config.json").read_text())
    assert head_config["training"]["predicted_tau"] == heldout["predicted_tau"]
    assert head_config["layer_ids"] == [1, 3, 4]  # the capture's layers
    assert "mask_embedding" in straight


def test_autotune_picks_a_static_tree_within_the_block_that_acceptance_decodes(tiny_target_dir, gsm8k_file, tmp_path):
    from headstart.eval.acceptance import main as acceptance
    from headstart.eval.autotune import main as autotune

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    head = tmp_path / "head"
    torch.manual_seed(0)
    build_head({"type": "dflash", "layer_ids": [1, 3, 4], "block_size": 4}, target).save_pretrained(head)
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--bench", str(gsm8k_file), "--calibration", "1"]
    argv += ["--heldout", "1", "--max-new-tokens", "8", "--max-nodes", "6", "--max-depth", "8", "--comb-width", "2"]
    result = autotune(argv + ["--repeats", "1", "--batch-sizes", "1", "--out", str(tmp_path / "at"), "--write-head"])
    names = [row["name"] for row in result["grid"]]
    assert names[0] == "vanilla" and not any(name.startswith("dynamic") for name in names)
    assert all(row["greedy_identical"] for row in result["grid"]) and result["checks"]["beats_eagle_default"] is None
    tree = json.loads((head / "tree.json").read_text())
    assert tree["shape"] == "static" and tree["depth"] <= 3  # the block's 3 mask slots, not --max-depth 8
    argv = ["--target", str(tiny_target_dir), "--head", str(head), "--method", "dflash", "--bench", str(gsm8k_file)]
    report = acceptance(argv + ["--limit", "1", "--max-new-tokens", "6", "--out", str(tmp_path / "r")])
    entry = report["methods"]["dflash"]
    assert entry["tree_config"]["choices"] == tree["choices"] and entry["greedy_identical"]


def test_a_reduced_draft_vocabulary_drafts_the_target_rows_and_serves_as_d2t(peaked_wide_llama, tmp_path):
    # draft_vocab_size: the target lm_head's rows for the most frequent tokens (frozen), d2t offsets; the
    # logits over the target vocabulary are the full-vocabulary head's there and -inf elsewhere.
    full = dflash_head(peaked_wide_llama)
    head = dflash_head(peaked_wide_llama, draft_vocab_size=120)
    head.load_state_dict(full.state_dict(), strict=False)  # the same draft layers
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.arange(0, V, 2)] = torch.arange(150, 0, -1)  # the even ids, 0 the most frequent
    head.set_vocab_mapping(counts)
    kept = torch.arange(0, 240, 2)
    assert torch.equal(head.draft_ids(), kept) and torch.equal(
        head.lm_head.weight, peaked_wide_llama.lm_head.weight[kept]
    )
    assert not head.lm_head.weight.requires_grad  # the target's rows stay the target's
    tokens = prompts()[2][0]
    aux, _ = features(peaked_wide_llama, tokens[None, :-1], head.hidden_layers)
    with torch.no_grad():
        context = head.context_kv(aux, torch.arange(11)[None])
        mine, theirs = head.draft_block(tokens[-1], 11, context, 4), full.draft_block(tokens[-1], 11, context, 4)
    torch.testing.assert_close(mine[:, kept], theirs[:, kept])
    assert torch.isinf(mine[:, 1::2]).all()
    out, _ = generate(peaked_wide_llama, DFlash(head), prompts()[1], NEW)
    assert torch.equal(out, greedy_reference(peaked_wide_llama, prompts()[1]))

    target_dir = tmp_path / "target"
    peaked_wide_llama.save_pretrained(target_dir)
    head.save_pretrained(tmp_path / "head")
    export = export_head(tmp_path / "head", "vllm", tmp_path / "export", str(target_dir))
    config, tensors = json.loads((export / "config.json").read_text()), load_file(str(export / "model.safetensors"))
    assert config["draft_vocab_size"] == 120 and torch.equal(tensors["d2t"], kept - torch.arange(120))
    assert tensors["lm_head.weight"].shape == (120, 64) and "t2d" not in tensors  # vLLM skips t2d
    imported = load_head(import_head("dflash", export, tmp_path / "imported", str(target_dir)), peaked_wide_llama)
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in head.state_dict().items())


def edit_config(head_dir, **edit):
    path = head_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # vLLM's target_layer_ids would be [-1, 2, 3]: the embeddings have no DFlash name.
        ({"layer_ids": [0, 3, 4]}, r"DFlash layer_ids \[0\] out of range: the target's layers 1\.\.5 can be fused"),
        ({"mask_token_id": 99999}, r"head\.mask_token_id 99999 is not a row of the target's 300 embeddings"),
    ],
)
def test_a_config_the_build_refuses_is_refused_by_loading_and_export_too(
    peaked_wide_llama, tmp_path, capsys, edit, message
):
    target_dir = tmp_path / "target"
    peaked_wide_llama.save_pretrained(target_dir)
    dflash_head(peaked_wide_llama).save_pretrained(tmp_path / "head")
    edit_config(tmp_path / "head", **edit)
    where = re.escape(str(tmp_path / "head" / "config.json"))
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        load_head(tmp_path / "head", peaked_wide_llama)  # as eval.acceptance loads it
    argv = ["--head", str(tmp_path / "head"), "--format", "vllm", "--out", str(tmp_path / "export")]
    with pytest.raises(SystemExit) as exit_info:
        export_main([*argv, "--target", str(target_dir)])
    assert exit_info.value.code == 2 and re.search(f"{where}: {message}", capsys.readouterr().err)
    assert not (tmp_path / "export").exists()


def test_weights_that_do_not_fit_the_config_name_the_folder_the_key_and_the_shapes(peaked_wide_llama, tmp_path):
    dflash_head(peaked_wide_llama, draft_vocab_size=100).save_pretrained(tmp_path / "head")
    edit_config(tmp_path / "head", num_layers=3)
    weights, config = (re.escape(str(tmp_path / "head" / name)) for name in ("model.safetensors", "config.json"))
    settings = r"target_hidden_size 64, vocab_size 300, arch\.intermediate_size 96, layer_ids \[1, 3, 4\]"
    with pytest.raises(
        ValueError, match=rf"{weights} does not fit {config} \({settings}, num_layers 3,.*missing layers\.2\."
    ):
        load_head(tmp_path / "head", peaked_wide_llama)
    edit_config(tmp_path / "head", num_layers=2, draft_vocab_size=50)
    with pytest.raises(
        ValueError, match=r"draft_vocab_size 50\): d2t has shape \(100,\), expected \(50,\); lm_head\.weight has shape "
    ):
        load_head(tmp_path / "head", peaked_wide_llama)
    edit_config(tmp_path / "head", draft_vocab_size=400)  # the documented check: not larger than the target's
    with pytest.raises(ValueError, match=f"{config}: .*draft_vocab_size 400 vs vocab size 300: the draft vocabulary"):
        load_head(tmp_path / "head", peaked_wide_llama)


class Crafted:
    """Unpickling it would run code (create a folder): what weights_only=True refuses."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_mask_embedding_that_is_not_a_tensor_file_is_refused_naming_it(peaked_wide_llama, tmp_path):
    target_dir = tmp_path / "target"
    peaked_wide_llama.save_pretrained(target_dir)
    dflash_head(peaked_wide_llama, mask_embedding=True).save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", "vllm", tmp_path / "export", str(target_dir))
    mask_file, marker = out / "mask_embedding.pt", tmp_path / "ran"
    for name, data in [("crafted", pickle.dumps(Crafted(marker))), ("garbage", os.urandom(64)), ("empty", b"")]:
        mask_file.write_bytes(data)
        with pytest.raises(
            ValueError,
            match=rf"{re.escape(str(mask_file))} is not a tensor file loadable with torch\.load\(weights_only=True\)",
        ):
            import_head("dflash", out, tmp_path / name, str(target_dir))
    assert not marker.exists()  # nothing in it ran
    buffer = io.BytesIO()
    torch.save({"embedding": [1.0, 2.0], "mask_token_id": 0}, buffer)  # loadable, but holds no tensor
    mask_file.write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match=rf"{re.escape(str(mask_file))} holds no mask vector: .*got list"):
        import_head("dflash", out, tmp_path / "list", str(target_dir))


def test_a_depth_past_the_block_is_cut_to_its_slots_and_said_once(peaked_wide_llama, caplog):
    """A block of 5 drafts 4 tokens a step: --tree static --depth 8 drafts chains of 4, and the log says so."""
    heads = {"dflash": dflash_head(peaked_wide_llama)}
    with caplog.at_level(logging.WARNING):
        proposer = build_proposer("dflash", TreeSettings(tree="static", depth=8).tree_spec(), heads=heads)
    assert max(len(c) for c in proposer.choices) == 4
    said = "dflash drafts at most 4 tokens a step (its head's limit): depth 8 is cut to it"
    assert caplog.text.count(said) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_proposer("dflash", TreeSettings(tree="static", depth=4).tree_spec(), heads=heads)
    assert "cut to it" not in caplog.text
