"""Speculation that adapts to load: the depth by batch size (tree.json schedules, ``generate_batch``) and the
per-sequence adaptive depth (``decoding.tree.confident``, fitted by ``eval.speedup.fit_confidence``). Sampled
runs of both are checked for losslessness in test_decoding_sampling.py."""

import json
import math

import pytest
import torch

from headstart.decoding.proposers import DraftModel, Vanilla
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.tree import Tree, capped
from headstart.decoding.tree_config import (
    TreeSpec,
    chain_choices,
    load_tree_config,
    schedule_ranges,
    scheduled_depth,
)
from headstart.decoding.verify import Sampling, generate_batch
from headstart.eval.speedup import ConfidenceStep, Costs, adaptive_rate, best_cap, fit_confidence
from headstart.eval.tune_runs import chain_logq
from headstart.heads import build_head

CHAIN4 = TreeSpec.static(chain_choices(4))


def test_schedule_ranges_merge_neighbours_and_read_like_vllm():
    assert schedule_ranges({1: 4, 2: 4, 4: 2, 8: 0}) == [[1, 3, 4], [4, 7, 2], [8, 8, 0]]
    assert schedule_ranges({2: 3}) == [[1, 2, 3]]  # vLLM needs a range from batch size 1 on
    schedule = [[1, 3, 4], [4, 7, 2], [8, 8, 0]]
    assert [scheduled_depth(schedule, b) for b in (1, 3, 4, 7, 8, 64)] == [4, 4, 2, 2, 0, 0]
    # vLLM's own example (vllm/v1/spec_decode/dynamic/utils.py): batch sizes 17-31 keep the 3 before the gap.
    gap = [[1, 16, 3], [32, 128, 2]]
    assert [scheduled_depth(gap, b) for b in (16, 17, 31, 32, 500)] == [3, 3, 3, 2, 2]


@pytest.mark.parametrize(
    "schedule, error",
    [
        ([[2, 4, 3]], "the first range must start at batch size 1, not 2"),
        ([[1, 4, 3], [4, 8, 2]], r"range \[4, 8\] overlaps the one before it"),
        ([[1, 4, -1]], r"\[1, 4, -1\] is not \[first, last, depth\] of non-negative integers"),
        ([], "expected a non-empty list"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_file_and_key(tmp_path, schedule, error):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(CHAIN4.config() | {"num_speculative_tokens_per_batch_size": schedule}))
    with pytest.raises(ValueError, match=f"tree.json: num_speculative_tokens_per_batch_size: {error}"):
        load_tree_config(path)


def test_capped_tree_keeps_the_shallow_nodes_with_their_parents_and_draft_rows():
    #      root
    #     /    \
    #    a(0)   b(1)      depth 1, drawn from row 0
    #    |  \
    #   c(2) d(3)         depth 2, drawn from row 1
    #    |
    #   e(4)              depth 3, drawn from row 2
    dists = torch.softmax(torch.randn(3, 10), -1)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    tree = Tree(
        tokens,
        torch.tensor([-1, -1, 0, 0, 2]),
        torch.tensor([1, 1, 2, 2, 3]),
        torch.zeros(5),
        dists,
        torch.tensor([0, 0, 1, 1, 2]),
    )
    cut = capped(tree, 2)
    assert cut.tokens.tolist() == [5, 6, 7, 8] and cut.parents.tolist() == [-1, -1, 0, 0]
    assert cut.dist_index.tolist() == [0, 0, 1, 1] and cut.dists is dists
    assert capped(tree, 1).tokens.tolist() == [5, 6] and capped(tree, 3) is tree


def synthetic_costs(batch_slope: float) -> Costs:
    """Verify 17 ms + 0.1 ms per node, and per extra sequence ``batch_slope`` ms per query row."""
    nodes = list(range(0, 65, 4))
    verify = {b: [17 + 0.1 * n + batch_slope * (b - 1) * (n + 1) for n in nodes] for b in (1, 8)}
    return Costs(nodes, verify, [1, 8], [2.0, 2.0], base_ms=1.5)


def test_the_depth_to_verify_falls_as_the_batch_grows():
    probs = [[0.8], [0.7], [0.6], [0.5]]
    dear = synthetic_costs(2.0)
    depth, rate = best_cap(dear, probs, CHAIN4, 8)
    # By hand at batch 8: vanilla 8e3 / (17 + 2*7) = 258.1 tokens/s; depth 1 verifies 2 rows per sequence and
    # still drafts the whole chain: 8e3 * 1.8 / (17.1 + 2*7*2 + 8*(1.5 + 3*2)) = 137.7. Plain decoding wins.
    assert depth == 0 and rate == pytest.approx(8e3 / 31)
    # At batch 1 the extra rows cost nothing: depth 4, tau 1 + .8 + .56 + .336 + .168 over 17.4 + 7.5 ms.
    assert best_cap(dear, probs, CHAIN4, 1) == (4, pytest.approx(1e3 * 2.864 / 24.9))


def greedy_batch(target, proposers, prompts, schedule=None):
    outputs, stats = generate_batch(target, proposers, prompts, 24, Sampling(), schedule=schedule)
    return [o.tolist() for o in outputs], stats


def test_generate_batch_cuts_the_trees_the_schedule_says_and_stays_greedy_identical(demo_target, demo_draft):
    model, tokenizer = demo_target
    texts = ["Natalia sold clips to 48 of her friends", "A robe takes 2 bolts of blue fiber"]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    expected, _ = greedy_batch(model, [Vanilla() for _ in prompts], prompts)

    def run(schedule):
        return greedy_batch(model, [DraftModel(demo_draft[0], k=4) for _ in prompts], prompts, schedule)

    full, full_stats = run(None)
    assert full == expected and max(max(s.accepted_lengths) for s in full_stats) == 5
    # Two sequences: chains cut at 2 (at most 2 drafts + the bonus a step); alone: plain decoding.
    cut, cut_stats = run([[1, 1, 0], [2, 2, 2]])
    assert cut == expected
    first_done = min(s.target_forwards for s in cut_stats)
    survivor = max(cut_stats, key=lambda s: s.target_forwards)
    together, alone = survivor.accepted_lengths[:first_done], survivor.accepted_lengths[first_done:]
    assert max(together) == 3 and alone and set(alone) == {1}
    # Depth 0 for both: nobody drafts, one token per forward, the draft model never called.
    idle, idle_stats = run([[1, 8, 0]])
    assert idle == expected and all(set(s.accepted_lengths) == {1} for s in idle_stats)


def test_a_head_skips_its_reading_while_nobody_drafts_and_catches_up_after(demo_target):
    # Two sequences: not drafting together (depth 0), drafting alone. One stops early at an end token (a token
    # of its own greedy text the other never writes). The EAGLE heads read no row while the pair decodes
    # plainly; the survivor's reads every row it missed, in one call, when it drafts again.
    model, tokenizer = demo_target
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, model).eval()
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in ("Janet has ducks", "A robe takes 2 bolts")]
    plain = [o[0][p.shape[1] :] for o, p in zip(greedy_batch(model, [Vanilla(), Vanilla()], prompts)[0], prompts)]
    stop = next(t for k, t in enumerate(plain[0]) if k >= 3 and t not in plain[0][:k] and t not in plain[1])
    reads: list[list[int]] = [[], []]

    class Counting(Eagle):
        def __init__(self, index):
            super().__init__(head, choices=chain_choices(2))
            self.index = index

        def update(self, tokens, hidden):
            reads[self.index].append(len(hidden))
            super().update(tokens, hidden)

    def run(proposers, schedule=None):
        outputs, stats = generate_batch(model, proposers, prompts, 24, Sampling(), stop, schedule)
        return [o.tolist() for o in outputs], stats

    expected, _ = run([Vanilla(), Vanilla()])
    outputs, stats = run([Counting(0), Counting(1)], [[1, 1, 2], [2, 2, 0]])
    assert outputs == expected and len(expected[0][0]) < len(expected[1][0])  # the first stopped early
    together = stats[0].target_forwards  # plain steps of the pair, the first one's last among them
    assert reads[0] == [] and reads[1][0] == prompts[1].shape[1] - 1 + together
    # From then on the survivor reads every step (the root and the accepted rows) and drafts again.
    assert sum(reads[1]) == len(expected[1][0]) - 1 - (stats[1].accepted_lengths[-1])


def test_adaptive_depth_stops_drafting_below_an_unlikely_level(demo_target):
    model, tokenizer = demo_target
    head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, model).eval()
    tokens = tokenizer("Weng earns $12 an hour for babysitting", return_tensors="pt").input_ids[0]
    with torch.no_grad():
        states = model(tokens[None, :-1], output_hidden_states=True).hidden_states

    def draft(min_confidence: float, choices=None) -> tuple[Tree, int]:
        proposer = Eagle(head, choices=choices or chain_choices(4), min_confidence=min_confidence)
        proposer.reset(Sampling())
        proposer.update(tokens, torch.cat([states[i][0] for i in proposer.hidden_layers], -1))
        calls, expand = [], proposer._expand
        proposer._expand = lambda *args: calls.append(1) or expand(*args)
        with torch.no_grad():
            tree = proposer.propose(tokens)
        return tree, len(calls)

    full, full_calls = draft(0.0)
    confidences = [math.exp(v) for v in chain_logq(full)]
    assert len(full) == 4 and full_calls == 3
    # Drafting below depth d needs depth d's confidence: between depth 2's and depth 3's, depth 3 is drafted
    # (one call per level below the first) and depth 4 is not.
    threshold = math.sqrt(confidences[1] * confidences[2])
    cut, cut_calls = draft(threshold)
    assert cut.tokens.tolist() == full.tokens[:3].tolist() and cut_calls == 2
    single, single_calls = draft(confidences[0] * 1.01)
    assert len(single) == 1 and single_calls == 0
    # A tree: the likeliest node of the level decides, so a confident sibling keeps the level going.
    wide = [[0], [1], [0, 0], [1, 0]]
    tree, _ = draft(0.0, wide)
    level1 = tree.draft_logprobs[:2].exp().tolist()
    kept, calls = draft(min(level1) * 1.01, wide)
    assert len(kept) == 4 and calls == 1
    dropped, calls = draft(max(level1) * 1.01, wide)
    assert len(dropped) == 2 and calls == 0


def test_fit_confidence_replays_the_recorded_steps():
    # Verify 10 ms + 5 per node; drafting 1 ms + 4 per level below the first.
    costs = Costs([0, 8], {1: [10.0, 50.0]}, [1, 8], [4.0, 4.0], base_ms=1.0)
    tree = TreeSpec.static(chain_choices(3))
    sure = ConfidenceStep([math.log(0.9), math.log(0.8), math.log(0.7)], [0, 0, 0])
    unsure = ConfidenceStep([math.log(0.2), math.log(0.05), math.log(0.01)], [])
    steps = [sure, unsure]
    # Fixed depth: 4 + 1 tokens over two steps of 25 + 9 ms.
    assert adaptive_rate(costs, tree, steps, 0.0) == pytest.approx(1e3 * 5 / 68)
    threshold, rate, fixed = fit_confidence(costs, tree, steps)
    # Thresholds tried: geometric means of 0.05, 0.2, 0.8, 0.9. At 0.4 the unsure step drafts depth 1 only
    # (15 + 1 ms) and the sure one everything: 5 tokens in 50 ms. At 0.85 the sure step loses depth 3.
    assert threshold == pytest.approx(0.4) and rate == pytest.approx(100.0) and fixed == pytest.approx(1e3 * 5 / 68)
    assert adaptive_rate(costs, tree, steps, 0.85) == pytest.approx(1e3 * 4 / (25 + 16))
    # Every step accepts the whole chain and a node costs 1 ms: 4 tokens in 22 ms beat 3 in 17, fixed depth stays.
    cheap_nodes = Costs([0, 8], {1: [10.0, 18.0]}, [1, 8], [4.0, 4.0], base_ms=1.0)
    assert fit_confidence(cheap_nodes, tree, [sure, sure]) == (
        0.0,
        pytest.approx(1e3 * 4 / 22),
        pytest.approx(1e3 * 4 / 22),
    )
