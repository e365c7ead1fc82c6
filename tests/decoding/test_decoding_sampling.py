"""Speculative sampling is lossless: the first two generated tokens follow the target's exact distribution.

The models are bigram lookup tables (logits depend only on the current token) behind the slice of the HF
interface the loop uses, so the exact two-token distribution is a V x V enumeration and a thousand
seeded runs, batched through ``generate_batch``, take a second. Attention and the KV cache are covered by
the greedy tests in test_decoding.py. Each test is a chi-square goodness-of-fit test at significance 0.001
(fixed seeds: deterministic).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from headstart.decoding.proposers import DraftModel, NGram
from headstart.decoding.proposers_eagle import PEagle
from headstart.decoding.tree import pick_children, static_tree
from headstart.decoding.verify import Sampling, accept, generate_batch, probabilities
from headstart.heads import build_head
from tests.helpers import assert_matches, exact_two_tokens_of, tiny_llama

V = 4
PROMPT = torch.tensor([[1, 2, 3, 2]])  # ends in 2; NGram finds "2" earlier and proposes [3, 2]


class Bigram(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table, self.dtype = table, table.dtype
        self.config = LlamaConfig(vocab_size=V, hidden_size=4, num_attention_heads=1, num_hidden_layers=1)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def forward(self, input_ids, past_key_values, attention_mask=None, position_ids=None, **_):
        rows = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1)
        past_key_values.update(rows, rows, 0)  # keeps the cache length honest for crop / commit
        return SimpleNamespace(logits=self.table[input_ids])


def tables():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(V, V, generator=gen) * 0.7
    draft = torch.randn(V, V, generator=gen) * 1.5  # deliberately different
    return target, draft


def exact_two_tokens(table: torch.Tensor, last: int, sampling: Sampling) -> torch.Tensor:
    """P(x1, x2) as a [V * V] vector: p(x1 | last) * p(x2 | x1)."""
    p = probabilities(table, sampling)
    return (p[last][:, None] * p).flatten()


def sample_pairs(target, make_proposer, sampling, runs, batch=100, schedule=None):
    """``runs`` independent two-token samples, ``batch`` sequences per verification forward."""
    counts = torch.zeros(V * V)
    for _ in range(runs // batch):
        proposers = [make_proposer() for _ in range(batch)]
        outputs, _ = generate_batch(target, proposers, [PROMPT] * batch, 2, sampling, schedule=schedule)
        for out in outputs:
            counts[out[0, -2] * V + out[0, -1]] += 1
    return counts


def run_loop_test(proposer_for, runs=1000, schedule=None):
    torch.manual_seed(0)
    target_table, draft_table = tables()
    sampling = Sampling(temperature=1.0)
    draft = Bigram(draft_table)
    counts = sample_pairs(Bigram(target_table), lambda: proposer_for(draft), sampling, runs, schedule=schedule)
    wrong = exact_two_tokens(draft_table, 2, sampling)
    assert_matches(counts, exact_two_tokens(target_table, 2, sampling), wrong)


def test_sampled_chain_is_lossless():
    run_loop_test(lambda draft: DraftModel(draft, k=2))


def test_sampled_dynamic_tree_with_siblings_is_lossless():
    # 3 sampled children per node, 2 levels, pruned to 5 of 12 nodes by the stochastic-beam keys.
    run_loop_test(lambda draft: DraftModel(draft, k=2, top_k=3, total_tokens=5))


def test_sampled_fixed_shape_is_lossless():
    # A tuned-tree shape: the second-drawn child of the root gets children, the first does not.
    run_loop_test(lambda draft: DraftModel(draft, choices=[[0], [1], [1, 0], [1, 1], [2]]))


def test_sampled_adaptive_depth_is_lossless():
    # Drafting stops below a first token the draft gave less than 0.3, so the tree's depth depends on the draw
    # (both happen: the draft's q after the prompt's last token straddles 0.3).
    q = probabilities(tables()[1], Sampling(temperature=1.0))[2]
    assert (q < 0.3).any() and (q >= 0.3).any()
    run_loop_test(lambda draft: DraftModel(draft, k=2, min_confidence=0.3))
    run_loop_test(lambda draft: DraftModel(draft, k=2, top_k=3, total_tokens=5, min_confidence=0.3))


def test_sampled_trees_cut_by_a_batch_schedule_are_lossless():
    # 100 sequences verified together: the schedule cuts every drafted tree to depth 1, whatever was drawn.
    run_loop_test(lambda draft: DraftModel(draft, choices=[[0], [1], [1, 0], [1, 1], [2]]), schedule=[[1, 100, 1]])


def test_fixed_proposals_are_lossless():
    # Prompt lookup proposes the same chain every time: point-mass drafts.
    run_loop_test(lambda draft: NGram(k=2))


def test_static_tree_with_shared_per_depth_draws_is_lossless():
    # Medusa-shaped: depth-d candidates drawn once (without replacement) from one q per depth and
    # shared by every parent; verified straight through ``accept`` with top-k and temperature applied.
    torch.manual_seed(1)
    target_table, draft_table = tables()
    sampling = Sampling(temperature=0.8, top_k=3)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]]
    q = probabilities(draft_table[[2, 0]], Sampling(temperature=1.0))  # per-depth draft distributions
    p = probabilities(target_table, sampling)
    counts = torch.zeros(V * V)
    for _ in range(3000):
        candidates, _ = pick_children(torch.zeros(2), q.log(), 3, True)
        tree = static_tree(choices, candidates, q)
        logits = target_table[torch.cat((torch.tensor([2]), tree.tokens))]
        path, bonus = accept(tree, logits, sampling)
        tokens = torch.cat((tree.tokens[path], bonus))
        if len(tokens) == 1:  # the next step's first token, itself drawn from the target
            tokens = torch.cat((tokens, torch.multinomial(p[tokens[0]], 1)))
        counts[tokens[0] * V + tokens[1]] += 1
    exact = exact_two_tokens(target_table, 2, sampling)
    support = exact > 0  # top-k leaves cells with probability 0: they must stay empty
    assert counts[~support].sum() == 0
    wrong = (q[0][:, None] * q[1][None]).flatten()[support]
    assert_matches(counts[support], exact[support], wrong / wrong.sum())


def peagle_setup():
    """A V-token Llama target with peaked distributions and a P-EAGLE head that disagrees with it."""
    target = tiny_llama(2, vocab_size=V, num_hidden_layers=3)
    target.lm_head.weight.data *= 4
    head = build_head(
        {"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": V, "parallel_drafting": True}, target
    )
    head.lm_head.weight.data *= 8
    return target, head


@pytest.mark.parametrize("choices", [[[0], [0, 0]], [[0], [1], [2], [0, 0], [0, 1], [1, 0]]])
@pytest.mark.usefixtures("one_thread")
def test_sampled_peagle_chain_and_tree_are_lossless(choices):
    # Depth d's tokens are drawn from the head's depth-d q of its one forward, without replacement, and every
    # parent shares them; the verifier gets those q. The counts must follow the target's own distribution.
    target, head = peagle_setup()
    sampling = Sampling(temperature=1.0)
    torch.manual_seed(0)
    counts = sample_pairs(target, lambda: PEagle(head, choices=choices), sampling, 1000)
    proposer = PEagle(head, choices=choices)
    proposer.reset(sampling)
    with torch.no_grad():
        states = target(PROMPT[:, :-1], output_hidden_states=True).hidden_states
        proposer.update(PROMPT[0], torch.cat([states[i][0] for i in head.hidden_layers], -1))
    q = probabilities(proposer.logp, sampling)
    wrong = (q[0][:, None] * q[1][None]).flatten()  # what handing out the drafts unverified would give
    assert_matches(counts, exact_two_tokens_of(target, PROMPT, sampling), wrong)
