"""EAGLE-3.1 (issue #41): an EAGLE-3 head with one RMSNorm per fused target layer before fc (``fc_norm``) and the
post-norm output fed to the next step (``norm_output``), as vLLM's llama_eagle3.py computes them; trained, decoded
greedy-identically (chains and trees), exported under vLLM's names and imported back to the same tensors."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.decoding.proposers_eagle import Eagle, PEagle
from headstart.decoding.verify import generate
from headstart.heads import WEIGHTS_NAME, build_head, load_head
from headstart.heads.layers import RMSNorm
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from headstart.train import eagle
from tests.helpers import LAYER_IDS, records, run_here, save_tiny_llama, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
NORMS = {"fc_norm": True, "norm_output": True}


def randomised(head):
    with torch.no_grad():
        for p in head.parameters():  # norms start at 1: randomise all, so a norm left out shows
            p.normal_(0, 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    return head.eval()


def test_the_norms_are_vllms():
    # combine_hidden_states: input_norm over the whole (norm_before_fc), then fc_norm per layer chunk, then fc; the
    # next step reads norm(out) (norm_output) where EAGLE-3 reads out.
    target = tiny_llama()
    head = randomised(build_head({"type": "eagle3", "layer_ids": LAYER_IDS, "norm_before_fc": True, **NORMS}, target))
    assert [n for n, _ in head.named_parameters() if "norm" in n and "midlayer" not in n] == [
        "input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight",
    ]  # fmt: skip
    aux = torch.randn(1, 5, 3 * target.config.hidden_size)
    normed = head.input_norm(aux)
    chunks = normed.chunk(3, dim=-1)
    expected = head.fc(torch.cat([head.fc_norm[i](chunks[i]) for i in range(3)], dim=-1))
    torch.testing.assert_close(head.first_features(aux), expected)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        logits, fed = head(ids, expected)
        out = head.midlayer(head.embed(ids), expected, *head.rotary(torch.arange(5)[None], expected.dtype))
    torch.testing.assert_close(fed, head.norm(out))
    torch.testing.assert_close(logits, head.lm_head(head.norm(out)))
    assert isinstance(head.fc_norm[0], RMSNorm) and head.fc_norm[0].weight.shape == (target.config.hidden_size,)


def test_an_eagle31_head_trains_decodes_greedily_and_exports_under_vllms_names(make_config, monkeypatch, tmp_path):
    config, out = make_config("eagle3", name="eagle31", max_steps=3, eval_every=3)
    cfg = yaml.safe_load(config.read_text())
    cfg["head"] |= NORMS
    config.write_text(yaml.safe_dump(cfg))
    run_here(monkeypatch, eagle, config)
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    target_dir = cfg["target"]["path"]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    head = load_head(out / "head", target)
    assert head.config.options.fc_norm and head.config.options.norm_output
    prompt = AutoTokenizer.from_pretrained(target_dir)("Ann has 3 apples.", return_tensors="pt").input_ids
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)
    for proposer in (Eagle(head, top_k=1, depth=3, total_tokens=3), Eagle(head, top_k=3, depth=3, total_tokens=8)):
        got, _ = generate(target, proposer, prompt, 12)
        assert torch.equal(got, expected)
    for fmt in ("vllm", "speculators"):
        exported = export_head(out / "head", fmt, tmp_path / fmt, target_dir)
        engine = json.loads((exported / "config.json").read_text())
        assert (engine["fc_norm"], engine["norm_output"], engine["norm_before_fc"]) == (True, True, False)
        tensors = load_file(str(exported / "model.safetensors"))
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= tensors.keys()
        again = load_file(str(import_head(fmt if fmt == "speculators" else "eagle3", exported, tmp_path / f"in-{fmt}",
                                          target_dir) / WEIGHTS_NAME))  # fmt: skip
        ours = head.state_dict()
        assert again.keys() == ours.keys() and all(torch.equal(again[k], v) for k, v in ours.items())
    card = (tmp_path / "vllm" / "README.md").read_text()
    assert "`fc_norm`, `norm_output`" in card


def test_peagle_mask_slots_go_through_the_same_norms(tmp_path):
    # vLLM projects mask_hidden through combine_hidden_states: the norms apply to it as to the target's states.
    target = tiny_llama()
    options = {"type": "eagle3", "layer_ids": LAYER_IDS, "parallel_drafting": True, "norm_before_fc": True, **NORMS}
    head = randomised(build_head(options, target))
    _, features = head.mask_slots(1, 2)
    torch.testing.assert_close(features[0, 0], head.first_features(head.mask_hidden)[0])
    save_tiny_llama(tmp_path / "target")
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=0)
    got, _ = generate(target, PEagle(head, depth=3), prompt, 8)
    assert torch.equal(got, expected)
