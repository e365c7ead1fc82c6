"""Tree verification: tree layout, KV compaction, greedy speculative decoding == the target's greedy decoding."""

import pytest
import torch
from transformers import DynamicCache

from headstart.decoding.proposers import DraftModel, NGram, Vanilla
from headstart.decoding.proposers_eagle import Eagle, PEagle
from headstart.decoding.proposers_medusa import Medusa
from headstart.decoding.target_cache import CPU_QUERY_MULTIPLE, verify_queries
from headstart.decoding.tree import (
    MC_SIM_7B_63,
    SMALL_CHOICES,
    Tree,
    chain,
    dynamic_tree,
    empty_tree,
    static_tree,
    tree_batch_inputs,
)
from headstart.decoding.tree_config import comb_choices
from headstart.decoding.verify import Sampling, accept, generate, generate_batch, verify
from headstart.heads import KVCache, build_head
from tests.helpers import tiny_llama

V, NEW = 300, 16


@pytest.fixture(scope="module")
def four_layer_llama():
    return tiny_llama(0, num_hidden_layers=4)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    # A prompt of one token, a short one and one with a repeat (so prompt lookup finds matches).
    repeated = torch.randint(3, V, (6,), generator=gen)
    return [
        torch.tensor([[7]]),
        torch.randint(3, V, (1, 5), generator=gen),
        torch.cat((repeated, torch.randint(3, V, (4,), generator=gen), repeated))[None],
    ]


def reference(target, prompt, new=NEW):
    eos = target.config.eos_token_id
    return target.generate(prompt, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)


class Oracle:
    """Proposes the target's own greedy continuation as a chain of k: every proposal is right."""

    hidden_layers = ()

    def __init__(self, continuation: torch.Tensor, k: int):
        self.continuation, self.k = continuation.flatten(), k

    def reset(self, sampling, positions=None):
        pass

    def propose(self, tokens):
        return chain(self.continuation[len(tokens) : len(tokens) + self.k])

    def update(self, tokens, hidden):
        pass


def test_tree_mask_and_positions_match_hand_built_reference():
    # root -> a, b;  a -> c;  c -> d
    tree = Tree(
        torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]), torch.zeros(4)
    )
    allowed = torch.tensor(
        [  # prefix 0, 1 | root | a b c d
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1, 1],
        ]
    ).bool()
    # A second sequence in the batch: one node, and a hole in its cache (slot 1 was a rejected draft).
    other = chain(torch.tensor([20]))
    valid = torch.tensor([[True, True], [True, False]])
    ids, mask, positions = tree_batch_inputs(valid, [tree, other], torch.float32)
    assert mask.shape == (2, 1, 5, 7)
    assert torch.equal(mask[0, 0] == 0, allowed)
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()
    other_allowed = torch.tensor(
        [  # prefix 0, (hole) | root | node, padding x3
            [1, 0, 1, 0, 0, 0, 0],
            [1, 0, 1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
        ]
    ).bool()
    assert torch.equal(mask[1, 0] == 0, other_allowed)
    assert ids.tolist() == [[0, 10, 11, 12, 13], [0, 20, 0, 0, 0]]
    assert positions.tolist() == [[2, 3, 3, 4, 5], [1, 2, 1, 1, 1]]


def test_static_tree_shapes():
    candidates = torch.arange(40).view(4, 10)
    tree = static_tree(SMALL_CHOICES, candidates)
    # Sorted by depth then path: [0] [1] [0,0] [0,1] [1,0] [0,0,0] [0,0,0,0]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2, 5]
    assert tree.tokens.tolist() == [0, 1, 10, 11, 10, 20, 30]
    big = static_tree(MC_SIM_7B_63, candidates)
    assert len(big) == 63 and int(big.depths.max()) == 4
    assert (big.parents < torch.arange(63)).all()  # topological
    with pytest.raises(ValueError, match="parent"):
        static_tree([[0, 1]], candidates)


def test_dynamic_tree_keeps_best_nodes_with_ancestors():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 50, generator=gen).log_softmax(-1)  # log q(next | token)

    def expand(tokens, parent_slots, depth, visible):
        assert visible.shape == (len(tokens), visible.shape[1]) and visible[:, -len(tokens) :].diagonal().all()
        return table[tokens]

    tree = dynamic_tree(table[0], expand, top_k=3, depth=4, total_tokens=10)
    assert len(tree) == 10 and (tree.parents < torch.arange(10)).all()
    parent_depth = torch.where(tree.parents >= 0, tree.depths[tree.parents.clamp(min=0)], 0)
    assert torch.equal(tree.depths, parent_depth + 1)
    prev = torch.where(tree.parents >= 0, tree.tokens[tree.parents.clamp(min=0)], 0)
    assert torch.allclose(tree.draft_logprobs, table[prev, tree.tokens])
    # The three best first tokens are all kept (nothing below them scores higher), in rank order.
    assert tree.tokens[tree.depths == 1].tolist() == table[0].topk(3).indices.tolist()


def test_kv_compaction_equals_recomputing_the_accepted_prefix(four_layer_llama):
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, V, (1, 6), generator=gen)
    greedy = reference(four_layer_llama, prompt, new=3)[0, 6:]
    # Tree: a junk first child, then the true chain greedy[0] -> greedy[1] with a junk sibling, then junk.
    tokens = torch.tensor([int(greedy[0]) + 1, int(greedy[0]), 5, int(greedy[1]), 9])
    tree = Tree(tokens, torch.tensor([-1, -1, 1, 1, 3]), torch.tensor([1, 1, 2, 2, 3]), torch.zeros(5))
    cache = DynamicCache(config=four_layer_llama.config)
    with torch.no_grad():
        four_layer_llama(prompt[:, :-1], past_key_values=cache, use_cache=True)
        verdict = verify(four_layer_llama, cache, prompt[0, -1:], tree, Sampling())
        path, bonus = verdict.path, verdict.bonus
        assert path.tolist() == [1, 3] and int(bonus) == int(greedy[2])
        fresh = DynamicCache(config=four_layer_llama.config)
        committed = torch.cat((prompt[0], tokens[path]))
        four_layer_llama(committed[None], past_key_values=fresh, use_cache=True)
    assert cache.get_seq_length() == fresh.get_seq_length() == 8
    for mine, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def test_a_short_cpu_verify_runs_four_queries_and_keeps_only_the_accepted_rows(four_layer_llama):
    """A chain of 2 is verified as 4 queries on a CPU (``CPU_QUERY_MULTIPLE``); the padding query changes
    neither the acceptance nor the committed cache, which equals recomputing the accepted prefix."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, V, (1, 6), generator=gen)
    greedy = reference(four_layer_llama, prompt, new=3)[0, 6:]
    tree = chain(torch.tensor([int(greedy[0]), int(greedy[1]) + 1]))  # the first right, the second wrong
    cpu = torch.device("cpu")
    assert CPU_QUERY_MULTIPLE == 4 and verify_queries(cpu, [tree]) == 4
    assert verify_queries(cpu, [empty_tree(cpu)]) == 1  # plain decoding: one query
    assert verify_queries(cpu, [tree, chain(torch.arange(4))]) == 8  # the larger tree's 5 queries, rounded up
    assert verify_queries(cpu, [chain(torch.arange(7))]) == 8
    assert verify_queries(torch.device("cuda"), [tree]) == 3
    seen = []
    hook = four_layer_llama.model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape)
    )
    cache = DynamicCache(config=four_layer_llama.config)
    try:
        with torch.no_grad():
            four_layer_llama(prompt[:, :-1], past_key_values=cache, use_cache=True)
            verdict = verify(four_layer_llama, cache, prompt[0, -1:], tree, Sampling())
            path, bonus = verdict.path, verdict.bonus
            fresh = DynamicCache(config=four_layer_llama.config)
            four_layer_llama(torch.cat((prompt[0], greedy[:1]))[None], past_key_values=fresh, use_cache=True)
    finally:
        hook.remove()
    assert seen[1] == (1, 4)  # root, 2 drafts, 1 padding query
    assert path.tolist() == [0] and int(bonus) == int(greedy[1])
    assert cache.get_seq_length() == fresh.get_seq_length() == 7
    for mine, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def proposers(target):
    return {
        "vanilla": Vanilla(),
        "ngram": NGram(k=4),
        "draft_model": DraftModel(tiny_llama(1, num_hidden_layers=2), k=3),
        "draft_model_tree": DraftModel(tiny_llama(1, num_hidden_layers=2), k=3, top_k=3, total_tokens=8),
        "eagle": Eagle(build_head({"type": "eagle"}, target), top_k=3, depth=3, total_tokens=10),
        "eagle3": Eagle(
            build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, target),
            top_k=3,
            depth=3,
            total_tokens=10,
        ),
        "medusa": Medusa(build_head({"type": "medusa", "num_heads": 4}, target)),
        "peagle": PEagle(peagle_head(target), depth=3),
        "peagle_tree": PEagle(peagle_head(target), choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    }


def peagle_head(target):
    return build_head(
        {"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200, "parallel_drafting": True}, target
    )


@pytest.fixture(scope="module")
def references(four_layer_llama, prompts):
    return [reference(four_layer_llama, prompt) for prompt in prompts]


@pytest.mark.parametrize(
    "name",
    ["vanilla", "ngram", "draft_model", "draft_model_tree", "eagle", "eagle3", "medusa", "peagle", "peagle_tree"],
)
def test_greedy_output_equals_target_greedy(four_layer_llama, prompts, references, name):
    proposer = proposers(four_layer_llama)[name]
    for prompt, expected in zip(prompts, references):
        out, stats = generate(
            four_layer_llama, proposer, prompt, NEW, eos_token_id=four_layer_llama.config.eos_token_id
        )
        assert torch.equal(out, expected)
        assert sum(stats.accepted_lengths) >= out.shape[1] - prompt.shape[1]
        assert stats.target_forwards == len(stats.accepted_lengths)
    if name == "vanilla":
        assert stats.tau == 1.0


def test_correct_proposals_give_long_acceptance_and_the_same_output(four_layer_llama, prompts):
    prompt = prompts[1]
    expected = reference(four_layer_llama, prompt)
    # (proposer, fewest drafts it must get accepted per step). A chain of the target's own choices is
    # accepted whole. An EAGLE-2 tree drafted by the target itself expands both depth-1 nodes, so the
    # right depth-2 token is always there; deeper, the frontier follows the draft's cumulative
    # probability, which need not be the greedy path.
    cases = [
        (Oracle(expected, 4), 4),
        (DraftModel(four_layer_llama, k=3), 3),
        (DraftModel(four_layer_llama, 3, top_k=2, total_tokens=10), 2),
    ]
    for proposer, fewest in cases:
        out, stats = generate(four_layer_llama, proposer, prompt, NEW)
        assert torch.equal(out, expected)
        # Every step but the last (cut by max_new_tokens) commits >= fewest drafts + the bonus.
        assert min(stats.accepted_lengths[:-1]) >= fewest + 1
        assert stats.tau > 2 and stats.depth_accepts[1] >= stats.target_forwards - 1


def test_eagle_tree_drafts_what_a_chain_of_head_steps_computes(four_layer_llama, prompts):
    # Each node's draft log-prob equals running the head down that node's path one step at a time.
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, four_layer_llama)
    proposer = Eagle(head, top_k=3, depth=3, total_tokens=8)
    tokens = prompts[2][0]
    proposer.reset(Sampling())
    with torch.no_grad():
        states = four_layer_llama(tokens[None, :-1], output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in proposer.hidden_layers], -1)
        proposer.update(tokens, hidden)
        tree = proposer.propose(tokens)
        anc = tree.ancestors()
        for node in range(len(tree)):
            cache, n = KVCache(), len(tokens) - 1
            features = head.first_features(hidden)[None]
            logp, out = head.draft_step(tokens[None, 1:], features, torch.arange(n)[None], cache)
            logp, out = logp[0, -1], out[:, -1:]
            for step, ancestor in enumerate(anc[node].nonzero().flatten().tolist()):
                if ancestor == node:
                    break
                logp, out = head.draft_step(tree.tokens[ancestor].view(1, 1), out, torch.tensor([[n + step]]), cache)
                logp = logp[0, -1]
            torch.testing.assert_close(tree.draft_logprobs[node], logp[tree.tokens[node]], atol=1e-4, rtol=1e-4)


def test_typical_acceptance_keeps_plausible_paths():
    # Medusa's lossy rule: accept x when p(x) > min(threshold, alpha * exp(-entropy(p))).
    tree = chain(torch.tensor([0, 1, 2]))
    logits = torch.full((4, 5), -10.0)
    logits[0, 0] = logits[1, 1] = 10.0  # root is sure of 0, node 0 sure of 1
    logits[2, 3] = 10.0  # node 1 is sure of 3, so 2 is implausible
    path, bonus = accept(tree, logits, Sampling(temperature=1.0, acceptance="typical"))
    assert path.tolist() == [0, 1] and bonus.tolist() == [3]
    with pytest.raises(ValueError, match="acceptance"):
        Sampling(acceptance="lossy")


def test_batched_verification_gives_each_sequence_its_own_greedy_output(four_layer_llama, prompts, references):
    # Eight sequences of different prompt lengths (one of a single token), verified together: each accepts
    # its own number of drafts per step, leaving holes in the shared cache, and must still decode exactly
    # as it does alone (the target's greedy output).
    gen = torch.Generator().manual_seed(3)
    more = [torch.randint(3, V, (1, n), generator=gen) for n in (2, 9, 4, 7, 12)]
    batch = prompts + more
    expected = references + [reference(four_layer_llama, p) for p in more]
    # Right proposals of different lengths (Oracle chains) beside mostly wrong ones (a random draft
    # model's trees); then EAGLE-3 heads, which read each sequence's own hidden rows back.
    mixed = [
        Oracle(ref, 2 + i % 3) if i % 2 else DraftModel(tiny_llama(1, num_hidden_layers=2), 3, 2, 6)
        for i, ref in enumerate(expected)
    ]
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, four_layer_llama)
    heads = [Eagle(head, choices=[[0], [1], [0, 0], [0, 0, 0]]) for _ in batch]
    runs = [generate_batch(four_layer_llama, proposers_, batch, NEW, eos_token_id=2) for proposers_ in (mixed, heads)]
    for outputs, _ in runs:
        for out, ref in zip(outputs, expected):
            assert torch.equal(out, ref)
    # Acceptance was per sequence: the oracles' chains were accepted whole, the draft model's were not.
    stats = runs[0][1]
    assert [s.accepted_lengths[0] for s in stats[1::2]] == [4, 3, 5, 4]  # chains of 3, 2, 4, 3 + the bonus
    assert max(s.accepted_lengths[0] for s in stats[::2]) < 4


def test_shaped_tree_drafts_what_the_dynamic_tree_drafts_for_the_same_shape(four_layer_llama, prompts):
    # top_k 2, depth 2, 6 nodes: the dynamic tree expands both children of the root and keeps all four
    # grandchildren, i.e. the shape [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]].
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, four_layer_llama)
    tokens = prompts[2][0]
    trees = []
    for proposer in (
        Eagle(head, top_k=2, depth=2, total_tokens=6),
        Eagle(head, choices=comb_choices(2, 2) + [[1, 0], [1, 1]]),
    ):
        proposer.reset(Sampling())
        with torch.no_grad():
            states = four_layer_llama(tokens[None, :-1], output_hidden_states=True).hidden_states
            proposer.update(tokens, torch.cat([states[i][0] for i in proposer.hidden_layers], -1))
            trees.append(proposer.propose(tokens))
    dynamic, shaped = trees
    assert torch.equal(dynamic.tokens, shaped.tokens) and torch.equal(dynamic.parents, shaped.parents)
    torch.testing.assert_close(dynamic.draft_logprobs, shaped.draft_logprobs)


def test_peagle_drafts_every_depth_in_one_forward_as_training_computes_them(four_layer_llama, prompts):
    # The proposer's one forward (committed pairs, then mask slots) gives, at depth d, the head's training
    # step d - 1 at the pending root's index; after a second commit the first forward's mask slots are gone
    # from its cache, so the drafts are still the training path's, now at the new root's index.
    head = peagle_head(four_layer_llama)
    proposer = PEagle(head, depth=4)
    tokens = prompts[2][0]
    with torch.no_grad():
        states = four_layer_llama(tokens[None], output_hidden_states=True).hidden_states  # causal: row i is token i's
        hidden = torch.cat([states[i][0] for i in proposer.hidden_layers], -1)
        steps = list(head.ttt_features(head.first_features(hidden)[None], tokens[None], 4))
        trained = torch.stack([head.to_target_vocab(head.lm_head(head.norm(s[0])).log_softmax(-1)) for s in steps], 1)
        proposer.reset(Sampling())
        for end in (7, len(tokens)):  # the prompt up to a pending root, then the rest committed
            proposer.update(tokens[:end], hidden[proposer.committed : end - 1])
            torch.testing.assert_close(proposer.logp, trained[end - 2], atol=1e-5, rtol=1e-5)
            tree = proposer.propose(tokens[:end])
            assert tree.tokens.tolist() == trained[end - 2].argmax(-1).tolist()
            assert tree.parents.tolist() == [-1, 0, 1, 2]
    shaped = PEagle(head, choices=[[0], [1], [0, 0], [1, 0], [1, 1]])
    shaped.reset(Sampling())
    with torch.no_grad():
        shaped.update(tokens, hidden[:-1])
    tree, top2 = shaped.propose(tokens), trained[len(tokens) - 2, :2].topk(2).indices
    # Sorted by depth then path: [0] [1] [0,0] [1,0] [1,1]; a depth's candidates are the same under every parent.
    assert tree.tokens.tolist() == [top2[0, 0], top2[0, 1], top2[1, 0], top2[1, 0], top2[1, 1]]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1]
    with pytest.raises(ValueError, match="needs an EAGLE-3 head trained with parallel_drafting; this is a eagle3"):
        PEagle(build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, four_layer_llama))


def test_a_head_proposer_refuses_another_kind_of_head(four_layer_llama):
    medusa = build_head({"type": "medusa", "num_heads": 2}, four_layer_llama)
    with pytest.raises(ValueError, match="EAGLE drafting needs an eagle, eagle3 or mtp head, not a medusa head"):
        Eagle(medusa)
    with pytest.raises(ValueError, match="Medusa drafting needs a medusa head, not a eagle head"):
        Medusa(build_head({"type": "eagle"}, four_layer_llama))
