"""MTP heads (heads/mtp.py) on tiny random targets of each MTP family, their checkpoints holding a random MTP layer
under the family's names (scripts/dev/tiny_mtp_targets.py): the head is that layer, it trains FastMTP-style, and it
drafts chains and trees that give the target's own greedy output and, sampled, its own distribution."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import Sampling, generate
from headstart.heads import build_head
from headstart.heads.mtp import MTP_FAMILIES
from headstart.scripts.dev.tiny_mtp_targets import save_tiny_mtp_target
from tests.decoding.test_decoding_sampling import sample_pairs
from tests.helpers import assert_matches, exact_two_tokens_of

FAMILIES = sorted(MTP_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_target(request, tmp_path_factory):
    """(family, folder, model) of a tiny target whose lm_head is scaled up: peaked distributions to learn."""
    folder = save_tiny_mtp_target(tmp_path_factory.mktemp(request.param) / "target", request.param)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.lm_head.weight.data *= 8
    return request.param, folder, model


def batch_of(target, seed: int, batch: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    """Random ids continued by the target's own greedy tokens (what regenerated data is), with its states."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, target.config.vocab_size, (batch, 4), generator=gen)
    with torch.no_grad():
        ids = target.generate(prompt, do_sample=False, max_new_tokens=seq - 4, min_new_tokens=seq - 4, pad_token_id=0)
        last = target(ids, output_hidden_states=True).hidden_states[-1]
    ones = torch.ones(ids.shape)
    return {"input_ids": ids, "loss_mask": ones, "attention_mask": ones.long(), "last_hidden": last}


def test_the_head_is_the_checkpoints_mtp_layer_which_transformers_leaves_out(tiny_target):
    family, folder, target = tiny_target
    head = build_head({"type": "mtp"}, target)
    stored = load_file(f"{folder}/model.safetensors")
    names = head.checkpoint_names()
    assert head.config.options.family == family
    assert all(torch.equal(tensor, stored[names[name]]) for name, tensor in head.state_dict().items())
    assert not any(name in dict(target.named_parameters()) for name in names.values())
    fresh = build_head({"type": "mtp", "init": "random"}, target)
    assert not torch.equal(fresh.eh_proj.weight, head.eh_proj.weight)


def test_fastmtp_training_raises_every_steps_agreement(tiny_target):
    # The recursion trains: every step's loss falls and its agreement with the target rises on the data it fits.
    _, _, target = tiny_target
    head = build_head({"type": "mtp", "steps": 3}, target)
    torch.manual_seed(0)
    batch = batch_of(target, 0)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    with torch.no_grad():
        _, before = head.loss(batch)
    for _ in range(15):
        loss, _ = head.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        _, after = head.loss(batch)
    for j in range(3):
        assert after[f"loss_{j}"] < before[f"loss_{j}"] - 0.5
        assert after[f"acc_{j}"] > before[f"acc_{j}"] + 0.3


def test_step_weights_decay_and_sum_to_one(tiny_target):
    _, _, target = tiny_target
    head = build_head({"type": "mtp", "steps": 3, "step_decay": 0.5}, target)
    loss, metrics = head.loss(batch_of(target, 2))
    expected = sum(w * metrics[f"loss_{j}"] for j, w in enumerate((4 / 7, 2 / 7, 1 / 7)))
    torch.testing.assert_close(loss.detach(), expected)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_drafting_gives_the_targets_own_output(tiny_target, shape):
    _, _, target = tiny_target
    head = build_head({"type": "mtp"}, target)
    proposer = Eagle.served_chain(head, 3) if shape == "chain" else Eagle(head, top_k=3, depth=3, total_tokens=8)
    prompt = torch.randint(2, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    out, stats = generate(target, proposer, prompt, 12, eos_token_id=1)
    assert torch.equal(out, expected)
    assert stats.target_forwards == len(stats.accepted_lengths)


@pytest.mark.usefixtures("one_thread")
def test_sampled_mtp_chain_and_tree_are_lossless(tmp_path):
    # A 4-token target: two sampled tokens have 16 outcomes, counted against the target's own probabilities. One
    # family: the families differ in the layer, which the greedy tests cover each; sampling is the one core's.
    folder = save_tiny_mtp_target(tmp_path / "target", "mimo", vocab_size=4)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    target.lm_head.weight.data *= 4
    head = build_head({"type": "mtp"}, target)
    head.eh_proj.weight.data *= 8  # a draft that disagrees with the target
    prompt = torch.tensor([[1, 2, 3, 2]])
    sampling = Sampling(temperature=1.0)
    exact = exact_two_tokens_of(target, prompt, sampling)
    for proposer in (lambda: Eagle.served_chain(head, 2), lambda: Eagle(head, top_k=2, depth=2, total_tokens=4)):
        torch.manual_seed(0)
        counts = sample_pairs(target, proposer, sampling, 1000)
        assert_matches(counts, exact, torch.full_like(exact, 1 / 16))
