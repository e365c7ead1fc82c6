"""Suffix decoding, lookahead decoding and self-speculative (early-exit) drafting: exact drafts on hand-made
token sequences, greedy output identical to the target's on the tiny and the bundled target, drafts accepted
where the text repeats, and lossless sampling for self_spec (chi-square, as test_decoding_sampling.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.data_recipes.bench import load_bench
from headstart.data_recipes.prompts import render
from headstart.decoding.methods import TreeSettings, build_proposer
from headstart.decoding.proposers import DraftModel, SelfSpec, early_exit
from headstart.decoding.proposers_lookup import Lookahead, Suffix, SuffixIndex
from headstart.decoding.tree import Tree
from headstart.decoding.verify import Sampling, generate, generate_batch, probabilities
from tests.helpers import TARGET, chi_square_critical, greedy_reference, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16
GSM8K_TEST = TARGET.parent / "data" / "gsm8k_test.jsonl"


def paths(tree: Tree) -> list[list[int]]:
    """Every root-to-node token path of ``tree``, in node order."""
    anc = tree.ancestors()
    return [tree.tokens[anc[i]].tolist() for i in range(len(tree))]


# ---------------------------------------------------------------------------------------------- suffix


def test_suffix_index_counts_every_bounded_substring_and_matches_the_longest_earlier_suffix():
    index = SuffixIndex(depth=3)
    index.extend([1, 2, 3, 1, 2])
    assert index.root.children[1].count == 2 and index.root.children[3].count == 1
    assert index.root.children[1].children[2].count == 2  # "1 2" twice
    assert index.root.children[1].children[2].children[3].count == 1  # "1 2 3"
    assert index.root.children[2].children[3].children[1].count == 1  # "2 3 1": 3 tokens, the depth
    assert index.root.children[1].children[2].children[3].children == {}  # cut at depth 3: no "1 2 3 1"
    node, length = index.match(max_length=5)
    assert length == 2 and list(node.children) == [3]  # "1 2" was followed by 3
    index.extend([9])
    assert index.match(max_length=5) is None  # 9 never occurred before


def test_suffix_drafts_the_continuations_of_the_longest_match_ranked_by_frequency():
    proposer = Suffix(k=4, max_match=4, min_prob=0.2, spec_factor=2)
    proposer.reset(Sampling())
    # "5 6" was followed by "7 8" twice and by "9" once; the context ends in "5 6".
    context = torch.tensor([5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6, 9, 3, 5, 6])
    tree = proposer.propose(context)
    # Best first: 7 (2/3), 7 8 (2/3), 9 (1/3), then 7 8 1 and 7 8 2 (1/3 each): the budget of 4 keeps the first.
    assert paths(tree) == [[7], [7, 8], [9], [7, 8, 1]]
    assert tree.parents.tolist() == [-1, 0, -1, 1]
    # A match of one token drafts at most one (spec_factor 1: a short match is weak evidence).
    proposer = Suffix(k=4)
    proposer.reset(Sampling())
    assert paths(proposer.propose(torch.tensor([4, 1, 2, 4]))) == [[1]]
    # min_prob: below it nothing is drafted.
    proposer = Suffix(k=4, min_prob=0.6)
    proposer.reset(Sampling())
    assert paths(proposer.propose(torch.tensor([1, 2, 1, 3, 1]))) == []


# ---------------------------------------------------------------------------------------------- lookahead


def test_lookahead_window_rides_in_the_tree_and_its_outputs_fill_the_pool():
    proposer = Lookahead(window=3, ngram=3, guesses=2)
    proposer.reset(Sampling())
    tree = proposer.propose(torch.tensor([4, 5, 4, 6, 8]))
    # The context's 3-grams are pooled ("4 5 4", "5 4 6", "4 6 8"); none starts with the root 8, so the tree is
    # the window's first level: a chain of the context's last 3 tokens.
    assert proposer.pool == {4: {(5, 4): None, (6, 8): None}, 5: {(4, 6): None}}
    assert (
        tree.tokens.tolist() == [4, 6, 8] and tree.parents.tolist() == [-1, 0, 1] and tree.on_target_argmax is not None
    )
    tree.on_target_argmax(torch.tensor([0, 11, 12, 13]))  # the target's argmax at [root, nodes...]
    proposer.update(torch.tensor([4, 5, 4, 6, 8, 0]), None)
    assert proposer.levels == [[4, 6, 8], [11, 12, 13]]  # level 1: the outputs at level 0
    tree = proposer.propose(torch.tensor([4, 5, 4, 6, 8, 0]))
    # Level 1's column i hangs below level 0's column i: depth i + 1 + 1, seeing one token per level.
    assert tree.tokens.tolist() == [4, 6, 8, 11, 12, 13]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 1, 2] and tree.depths.tolist() == [1, 2, 3, 2, 3, 4]
    tree.on_target_argmax(torch.tensor([0, 1, 2, 3, 21, 22, 23]))
    proposer.update(torch.tensor([4, 5, 4, 6, 8, 0, 7]), None)
    # The window was full (ngram - 1 = 2 levels): column i's n-gram is (level 0, level 1, output at level 1);
    # the oldest level is dropped and the outputs become the newest.
    assert proposer.levels == [[11, 12, 13], [21, 22, 23]]
    assert proposer.pool[4] == {(6, 8): None, (11, 21): None}  # at most 2 per key, the latest kept
    # The committed text's n-grams join as they complete ("6 8 0").
    assert proposer.pool[6] == {(8, 0): None, (12, 22): None} and proposer.pool[8] == {(13, 23): None}
    # Drafts: the pool's n-grams starting with the root (latest first, shared heads merged), then the window.
    proposer.add_ngram([7, 1, 2])
    proposer.add_ngram([7, 1, 3])
    tree = proposer.propose(torch.tensor([4, 5, 4, 6, 8, 0, 7]))
    assert tree.tokens.tolist()[:3] == [1, 3, 2] and tree.parents.tolist()[:3] == [-1, 0, 0]
    assert tree.tokens.tolist()[3:] == [11, 12, 13, 21, 22, 23]


# ---------------------------------------------------------------------------------------------- self_spec


def test_early_exit_is_the_targets_first_layers_with_its_norm_and_head_sharing_its_weights():
    target = tiny_llama(num_hidden_layers=4)
    draft = early_exit(target, 2)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        expected = target.lm_head(target.model.norm(states[2]))
        torch.testing.assert_close(draft(ids).logits, expected)
    assert target.config.num_hidden_layers == 4 and draft.config.num_hidden_layers == 2  # the target is untouched
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    with pytest.raises(ValueError, match="exit layer must be in 1..3 for a target of 4 layers, got 4"):
        early_exit(target, 4)


# ---------------------------------------------------------------------------------------------- greedy identity


def new_proposers(target, trees: bool = True):
    proposers = {
        "suffix": Suffix(k=4),
        "lookahead": Lookahead(window=3, ngram=3, guesses=3),
        "self_spec": SelfSpec(target, k=3),
    }
    if trees:
        proposers["self_spec_tree"] = SelfSpec(target, exit_layer=1, k=3, top_k=2, total_tokens=6)
    return proposers


@pytest.fixture(scope="module")
def bundled():
    """The bundled target in fp32 (greedy identity is exact there) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TARGET)


def repeating_prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    """One token, a short random prompt, and one whose text repeats (so lookups find matches)."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(4, vocab, (6,), generator=gen)
    return [
        torch.tensor([[7]]),
        torch.randint(4, vocab, (1, 5), generator=gen),
        torch.cat((phrase, torch.randint(4, vocab, (3,), generator=gen), phrase, phrase[:3]))[None],
    ]


def test_greedy_output_equals_the_targets_greedy_decoding_on_the_tiny_target(tiny_target_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    eos = target.config.eos_token_id
    prompts = repeating_prompts(target.config.vocab_size, seed=1)
    expected = [greedy_reference(target, p) for p in prompts]
    for name, proposer in new_proposers(target).items():
        for prompt, reference in zip(prompts, expected):
            out, _ = generate(target, proposer, prompt, NEW, eos_token_id=eos)
            assert torch.equal(out, reference), name
    for name in ("suffix", "lookahead"):  # batched, a proposer per sequence: each keeps its own greedy output
        proposers = [new_proposers(target, trees=False)[name] for _ in prompts]
        outputs, _ = generate_batch(target, proposers, prompts, NEW, eos_token_id=eos)
        for out, reference in zip(outputs, expected):
            assert torch.equal(out, reference), name


def test_greedy_output_equals_the_targets_greedy_decoding_on_the_bundled_target(bundled):
    target, _ = bundled
    prompts = repeating_prompts(target.config.vocab_size, seed=1)[1:]
    for prompt in prompts:
        expected = greedy_reference(target, prompt)
        for name, proposer in new_proposers(target, trees=False).items():
            out, _ = generate(target, proposer, prompt, NEW, eos_token_id=target.config.eos_token_id)
            assert torch.equal(out, expected), name


def test_lookups_get_drafts_accepted_where_the_text_repeats(bundled):
    # The bundled target's GSM8K answers repeat themselves ("16 * 2 = <<16*2=...", one line after another):
    # a proposer that never drafted, or never got a draft accepted, would have tau 1.
    model, tokenizer = bundled
    item = load_bench(GSM8K_TEST, 1)[0]
    prompt = render(tokenizer, [{"role": "user", "content": item.turns[0]}])
    expected = greedy_reference(model, prompt, new=48)
    for proposer in (Suffix(), Lookahead()):
        out, stats = generate(model, proposer, prompt, 48, eos_token_id=model.config.eos_token_id)
        assert torch.equal(out, expected)
        assert stats.tau > 1.3, type(proposer).__name__


def test_build_proposer_maps_the_new_methods():
    target = tiny_llama(num_hidden_layers=4)
    flags = TreeSettings(depth=3, exit_layer=1).tree_spec()
    assert isinstance(build_proposer("suffix", flags), Suffix) and build_proposer("suffix", flags).k == 3
    assert isinstance(build_proposer("lookahead", flags), Lookahead)
    chain = build_proposer("self_spec", flags, target=target)
    assert isinstance(chain, SelfSpec) and (chain.exit_layer, chain.k, chain.top_k) == (1, 3, 1)
    assert chain.model.config.num_hidden_layers == 1
    tree = build_proposer(
        "self_spec", TreeSettings(tree="dynamic", top_k_draft=2, depth=3, total_tokens=5).tree_spec(), target=target
    )
    assert (tree.exit_layer, tree.top_k, tree.total_tokens) == (2, 2, 5)  # half of the 4 layers


# ---------------------------------------------------------------------------------------------- sampling


V = 6
PROMPT = torch.tensor([[1, 2, 3, 2]])


def two_token_distribution(model, prompt: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """P(x1, x2) as a [V * V] vector: p(x1 | prompt) * p(x2 | prompt, x1)."""
    with torch.no_grad():
        first = probabilities(model(prompt).logits[0, -1], sampling)
        nexts = torch.cat((prompt.expand(V, -1), torch.arange(V)[:, None]), 1)
        second = probabilities(model(nexts).logits[:, -1], sampling)
    return (first[:, None] * second).flatten()


def test_sampled_self_spec_is_lossless():
    # A V-token target with peaked distributions whose first layer drafts differently from the whole stack.
    target = tiny_llama(vocab_size=V, num_hidden_layers=4)
    target.lm_head.weight.data *= 6
    sampling = Sampling(temperature=1.0)
    exact = two_token_distribution(target, PROMPT, sampling)
    wrong = two_token_distribution(early_exit(target, 1), PROMPT, sampling)  # the drafts, unverified
    counts, runs, batch = torch.zeros(V * V), 600, 200
    for _ in range(runs // batch):
        proposers = [SelfSpec(target, exit_layer=1, k=2) for _ in range(batch)]
        outputs, stats = generate_batch(target, proposers, [PROMPT] * batch, 2, sampling)
        for out in outputs:
            counts[out[0, -2] * V + out[0, -1]] += 1
    assert sum(s.accepted_lengths[0] for s in stats) > batch  # drafts were accepted, not only bonus tokens
    support = exact * runs >= 5  # cells rare enough to be empty are pooled into one
    observed = torch.cat((counts[support], counts[~support].sum()[None]))
    expected = runs * torch.cat((exact[support], exact[~support].sum()[None]))
    critical = chi_square_critical(len(observed) - 1)
    assert float(((observed - expected) ** 2 / expected).sum()) < critical
    # The test has power: the early-exit drafts handed out unverified would fail it by far.
    wrong = runs * torch.cat((wrong[support], wrong[~support].sum()[None]))
    assert float(((wrong - expected) ** 2 / expected).sum()) > 3 * critical


def test_self_spec_is_a_draft_model_over_the_early_exit_stack():
    target = tiny_llama(num_hidden_layers=4)
    proposer = SelfSpec(target, exit_layer=3, k=2)
    assert isinstance(proposer, DraftModel) and proposer.model.config.num_hidden_layers == 3
    assert proposer.model.model.layers is target.model.layers  # shared, not copied
