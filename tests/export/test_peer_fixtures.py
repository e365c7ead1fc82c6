"""Drafts written by the peers' own published code (tests/fixtures/peers/, scripts/dev/make_peer_fixtures.py): the
EAGLE repo's EAGLE-1 (eagle-llm 1.2.1), Model-Optimizer's EAGLE-3 export (nvidia-modelopt 0.47.0) and SpecForge's
EAGLE-3 draft (specforge 0.2.0). Each imports with ``import_head --from <format>`` to the very tensors the peer
wrote, decodes greedy-identically to its target (rebuilt here from the seed the fixtures were written with), and
exports back to the peer's tensors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.verify import generate
from headstart.export.common import read_checkpoint
from headstart.heads import load_head
from headstart.scripts.dev.make_peer_fixtures import TARGET, tiny_target
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import main as import_main
from tests.helpers import REPO, greedy_reference

FIXTURES = REPO / "tests" / "fixtures" / "peers"
TOLERANCE = 1e-4  # max |logit difference| from the peer's own model: fp32 both, only summation order differs
# peer -> (import_head --from, the layout it exports back to, what the import reads of its config: options)
PEERS = {
    # The EAGLE repo's Model has an fc bias (vLLM's EAGLE-1 has none: SGLang serves it) and a copy of the target's
    # embedding, which the import drops (vLLM and SGLang share the target's).
    "eagle": ("eagle", "sglang", {"fc_bias": True}),
    # Model-Optimizer writes the layer ids only under eagle_config in SGLang's spelling (our ids - 1), no d2t for a
    # draft over the whole vocabulary, the target's lm_head, and a YaRN rope_scaling for serving (its
    # eagle_export_rope_scaling default) that vLLM applies to the draft, and so does the import.
    "modelopt": ("eagle3", "vllm", {"layer_ids": [2, 4, 5], "draft_vocab_size": 256, "rope_type": "yarn"}),
    # SpecForge's config names no layer ids (the engines' default, (2, L // 2, L - 3)); its d2t maps 128 draft ids.
    "specforge": ("eagle3", "sglang", {"layer_ids": [2, 4, 5], "draft_vocab_size": 128, "rope_type": "default"}),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(the fixtures' target, its folder)."""
    model = tiny_target()
    folder = tmp_path_factory.mktemp("peer-target")
    model.save_pretrained(folder)
    return model, str(folder)


def theirs_as_ours(
    theirs: dict[str, torch.Tensor], kind: str, target_embedding: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The peer's tensors under our head's names: the EAGLE-3 layer is ``midlayer`` (EAGLE-1's stays ``layers.0``);
    a copy of the target's embedding is no tensor of the head's."""
    assert "embed_tokens.weight" not in theirs or torch.equal(theirs["embed_tokens.weight"], target_embedding)
    layer = "midlayer." if kind == "eagle3" else "layers.0."
    return {k.replace("layers.0.", layer, 1): v for k, v in theirs.items() if k != "embed_tokens.weight"}


def same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    missing = sorted(theirs.keys() - ours.keys())
    assert not missing, missing
    different = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not different, different


@pytest.mark.parametrize("peer", PEERS)
def test_a_draft_the_peers_own_code_wrote_imports_decodes_and_exports_back(target, tmp_path, peer):
    model, folder = target
    kind, layout, read = PEERS[peer]
    written = FIXTURES / peer
    assert (written / "PROVENANCE.md").is_file()
    head_dir = tmp_path / "head"
    import_main(["--from", kind, str(written), "--out", str(head_dir), "--target", folder])

    head = load_head(head_dir, model).eval()
    saved = json.loads((head_dir / "config.json").read_text())
    assert {k: saved["arch"]["rope"]["rope_type"] if k == "rope_type" else saved[k] for k in read} == read
    assert head.config.arch.intermediate_size == 96 != TARGET["intermediate_size"]  # the draft's own MLP width
    embedding = model.model.embed_tokens.weight.detach()
    theirs = theirs_as_ours(read_checkpoint(written), kind, embedding)
    ours = load_file(str(head_dir / "model.safetensors"))
    same(ours, theirs)
    if "d2t" not in theirs and "d2t" in ours:  # a draft over the whole vocabulary: no offsets
        assert not ours["d2t"].any() and ours["t2d"].all()

    # The peer's own model's step-0 logits (reference.safetensors, written beside the draft by its code) on the same
    # inputs: position i pairs feature i with token i + 1.
    reference = load_file(str(written / "reference.safetensors"))
    with torch.no_grad():
        features = reference["features"][:, :-1]
        features = head.first_features(features) if kind == "eagle3" else features
        logits = head(reference["input_ids"][:, 1:], features)[0]
    assert logits.shape == reference["logits"].shape and (logits - reference["logits"]).abs().max() <= TOLERANCE

    proposer = head_proposer(head.config).served_chain(head, 3)
    prompt = torch.randint(0, TARGET["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(0))
    out, stats = generate(model, proposer, prompt, 16, eos_token_id=model.config.eos_token_id)
    assert torch.equal(out, greedy_reference(model, prompt)) and stats.target_forwards > 0

    back = export_head(head_dir, layout, tmp_path / "export", folder)
    exported = theirs_as_ours(load_file(str(back / "model.safetensors")), kind, embedding)
    same(exported, theirs)
    assert set(exported) == set(theirs)  # nothing more than the peer wrote


def test_every_fixture_is_small_and_says_where_it_came_from():
    for peer in PEERS:
        folder: Path = FIXTURES / peer
        provenance = (folder / "PROVENANCE.md").read_text()
        assert "scripts/dev/make_peer_fixtures.py" in provenance and "Licence" in provenance
        assert sum(f.stat().st_size for f in folder.iterdir()) < 400_000
