"""A published draft's own embedding: kept where vLLM would serve it (it differs from the target's), dropped where it
is the target's copy (``export.common.keep_own_embedding``), drafted with, and exported back."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.verify import generate
from headstart.heads import build_head, load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from tests.helpers import LAYER_IDS, TINY_LLAMA, greedy_reference, make_head


def with_embedding(exported, embedding: torch.Tensor, out):
    """The export folder ``exported`` copied to ``out`` with ``embedding`` as its ``embed_tokens.weight``, as
    speculators' checkpointer saves its draft (a copy of the target's table, or the one it trained)."""
    out.mkdir()
    (out / "config.json").write_text((exported / "config.json").read_text())
    tensors = load_file(str(exported / "model.safetensors")) | {"embed_tokens.weight": embedding}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def step0_logits(head, target) -> torch.Tensor:
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = head.first_features(torch.cat([states[i] for i in LAYER_IDS], dim=-1))
        return head(ids, features)[0]


@pytest.mark.parametrize("parallel", [False, True], ids=["eagle3", "peagle"])
def test_a_draft_embedding_of_its_own_is_kept_drafted_with_and_exported_back(
    tiny_llama_dir, tiny_llama_from_dir, tmp_path, parallel
):
    target = tiny_llama_from_dir
    options = {"parallel_drafting": {"mask_token_id": 5}, "ttt_steps": 3} if parallel else {}
    exported = export_head(make_head(target, tmp_path, "eagle3", **options), "speculators", tmp_path / "export")
    table = target.model.embed_tokens.weight.detach()
    trained = table + 0.05 * torch.randn(table.shape, generator=torch.Generator().manual_seed(1))
    copied = import_head(
        "speculators", with_embedding(exported, table.clone(), tmp_path / "copy"), tmp_path / "a", tiny_llama_dir
    )
    own = import_head(
        "speculators", with_embedding(exported, trained, tmp_path / "own"), tmp_path / "b", tiny_llama_dir
    )

    shared_head, own_head = load_head(copied, target).eval(), load_head(own, target).eval()
    assert shared_head.config.options.own_embedding is None and shared_head.embed_tokens is None
    assert "own_embedding" not in json.loads((copied / "config.json").read_text())
    assert own_head.config.options.own_embedding is True and torch.equal(own_head.embed_tokens.weight, trained)
    shared, drafted = step0_logits(shared_head, target), step0_logits(own_head, target)
    assert (shared - drafted).abs().max() > 1e-2  # the own table is what it drafts with
    with torch.no_grad():
        own_head.embed_tokens.weight.copy_(table)  # the same head with the target's rows drafts as the shared one
        assert torch.allclose(step0_logits(own_head, target), shared, atol=1e-6)
    own_head = load_head(own, target).eval()

    proposer = head_proposer(own_head.config).served_chain(own_head, 3)
    prompt = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
    out, _ = generate(target, proposer, prompt, 16, eos_token_id=target.config.eos_token_id)
    assert torch.equal(out, greedy_reference(target, prompt))

    for fmt in ("speculators", "vllm"):
        back = load_file(str(export_head(own, fmt, tmp_path / f"back-{fmt}") / "model.safetensors"))
        assert torch.equal(back["embed_tokens.weight"], trained)
    assert "embed_tokens.weight" not in load_file(
        str(export_head(copied, "vllm", tmp_path / "c") / "model.safetensors")
    )
    if not parallel:
        with pytest.raises(ValueError, match="own embedding.*SGLang 0.5.23 replaces"):
            export_head(own, "sglang", tmp_path / "sglang")


def test_an_eagle1_checkpoint_keeps_an_embedding_that_differs_from_the_targets(
    tiny_llama_dir, tiny_llama_from_dir, tmp_path
):
    exported = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle"), "vllm", tmp_path / "export")
    trained = torch.randn(
        TINY_LLAMA["vocab_size"], TINY_LLAMA["hidden_size"], generator=torch.Generator().manual_seed(3)
    )
    head_dir = import_head(
        "eagle", with_embedding(exported, trained, tmp_path / "own"), tmp_path / "imported", tiny_llama_dir
    )
    assert torch.equal(load_head(head_dir, tiny_llama_from_dir).embed_tokens.weight, trained)
    back = export_head(head_dir, "vllm", tmp_path / "back")
    assert torch.equal(load_file(str(back / "model.safetensors"))["embed_tokens.weight"], trained)


def test_a_head_built_with_its_own_embedding_starts_from_the_targets_and_trains_it(tiny_llama_from_dir):
    target = tiny_llama_from_dir
    head = build_head({"type": "eagle3", "layer_ids": LAYER_IDS, "own_embedding": True, "ttt_steps": 2}, target)
    assert torch.equal(head.embed_tokens.weight, target.model.embed_tokens.weight)
    assert "embed_tokens.weight" in head.state_dict() and head.embed_tokens.weight.requires_grad
