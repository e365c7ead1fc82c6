"""MTP heads exported under the target checkpoint's names (export/mtp.py), imported back, and stitched into a copy of
the target (export/stitch.py, ``export --stitch``), for each MTP family's tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from headstart.heads import build_head
from headstart.heads.mtp import MTP_FAMILIES
from headstart.scripts.dev.tiny_mtp_targets import save_tiny_mtp_target
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from tests.helpers import make_head, tiny_llama


@pytest.fixture(scope="module", params=sorted(MTP_FAMILIES))
def tuned(request, tmp_path_factory):
    """(family, target folder, head folder): a head whose every weight differs from the checkpoint's layer."""
    root = tmp_path_factory.mktemp(request.param)
    folder = save_tiny_mtp_target(root / "target", request.param)
    head = build_head({"type": "mtp"}, AutoModelForCausalLM.from_pretrained(folder))
    for p in head.parameters():
        p.data.add_(0.01)
    head.save_pretrained(root / "head")
    return request.param, folder, root / "head"


def test_export_holds_the_layer_under_the_checkpoints_names_and_imports_back_identical(tuned, tmp_path):
    family, target, head_dir = tuned
    out = export_head(head_dir, "vllm", tmp_path / "export", target=target)
    exported = load_file(out / "model.safetensors")
    ours = load_file(head_dir / "model.safetensors")
    names = MTP_FAMILIES[family]
    assert all(torch.equal(exported[names.checkpoint_name(name)], t) for name, t in ours.items())
    stored = load_file(f"{target}/model.safetensors")
    for shared in ("model.embed_tokens.weight", "lm_head.weight"):  # what vLLM's MTP model loads beside the layer
        assert torch.equal(exported[shared], stored[shared])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == json.loads(Path(target, "config.json").read_text())["architectures"]
    assert config["num_nextn_predict_layers"] == 1
    back = load_file(import_head("mtp", out, tmp_path / "imported", target) / "model.safetensors")
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_the_stitched_target_loads_in_transformers_with_the_tuned_layer_in_its_checkpoint(tuned, tmp_path):
    family, target, head_dir = tuned
    out = export_head(head_dir, "vllm", tmp_path / "stitched", target=target, stitch=True)
    stitched, original = load_file(out / "model.safetensors"), load_file(f"{target}/model.safetensors")
    assert stitched.keys() == original.keys()
    ours = load_file(head_dir / "model.safetensors")
    layer = {MTP_FAMILIES[family].checkpoint_name(name): t for name, t in ours.items()}
    assert all(torch.equal(stitched[name], t) for name, t in layer.items())
    assert all(torch.equal(stitched[name], t) for name, t in original.items() if name not in layer)
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.tensor([[3, 5, 7, 9]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # The stitched copy's own layer, imported, is the tuned head; the original's is the untuned baseline.
    back = load_file(import_head("mtp", out, tmp_path / "back", target) / "model.safetensors")
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    baseline = load_file(import_head("mtp", target, tmp_path / "baseline", target) / "model.safetensors")
    assert not any(torch.equal(baseline[k], ours[k]) for k in ours if k.endswith("proj.weight"))


def test_a_head_that_is_not_part_of_the_target_is_not_stitched(tmp_path):
    target = tiny_llama()
    target.save_pretrained(tmp_path / "target")
    head = make_head(target, tmp_path, "eagle")
    with pytest.raises(ValueError, match="not tensors of .* only a head that is part of the target's checkpoint"):
        export_head(head, "vllm", tmp_path / "stitched", target=str(tmp_path / "target"), stitch=True)
    assert not (tmp_path / "stitched").exists()


def test_a_target_without_an_mtp_layer_is_refused_by_name(tmp_path):
    target = tiny_llama()
    with pytest.raises(ValueError, match="no MTP family for a llama target .* mimo .* ernie"):
        build_head({"type": "mtp"}, target)
