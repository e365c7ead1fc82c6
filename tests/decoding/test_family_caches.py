"""Verification on targets whose cache cannot simply be gathered and cropped (``decoding.target_cache``).

Tiny random targets from transformers' own config classes: Mistral whose every layer slides over a window of 8
(shorter than the context), Qwen3-Next (gated delta net linear attention mixed with full attention), Granite-4
and Nemotron-H (Mamba-2 mixed with attention). On each, speculative decoding with drafts that are partly right
and partly wrong (so steps accept, reject and, on recurrent targets, replay) is the target's own greedy
decoding token for token, and sampling is lossless (chi-square on the first two tokens).
"""

import logging

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GraniteMoeHybridConfig,
    MistralConfig,
    NemotronHConfig,
    Qwen2Config,
    Qwen3NextConfig,
)

from headstart.decoding.methods import TreeSettings, build_proposer
from headstart.decoding.proposers import NGram
from headstart.decoding.target_cache import new_cache, recurrent_target, sliding_window
from headstart.decoding.tree import Tree, chain, tree_from_parents
from headstart.decoding.verify import Sampling, generate, generate_batch, probabilities, verify_batch
from tests.helpers import assert_matches

pytestmark = pytest.mark.usefixtures("one_thread")

V, WINDOW, NEW = 96, 8, 32
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# Weights larger than the usual 0.02: spread-out logits, so greedy choices are not near-ties that kernels'
# rounding (a chunked scan in a verify forward, a recurrent step in one-token decoding) could flip.
SPREAD = dict(num_key_value_heads=2, initializer_range=0.2, pad_token_id=0)


def mistral_config(window: int = WINDOW) -> MistralConfig:
    return MistralConfig(**SIZES, **SPREAD, sliding_window=window)


def qwen2_config(window: int = WINDOW) -> Qwen2Config:
    """Qwen2 slides above ``max_window_layers`` only: a global layer then a sliding one (a mask per layer type)."""
    return Qwen2Config(**SIZES, **SPREAD, use_sliding_window=True, sliding_window=window, max_window_layers=1)


def qwen3_next_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        **{**SIZES, "num_hidden_layers": 3}, **SPREAD, head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip


def granite_config() -> GraniteMoeHybridConfig:
    return GraniteMoeHybridConfig(
        **{**SIZES, "num_hidden_layers": 3}, **SPREAD, layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=64,
    )  # fmt: skip


def nemotron_h_config() -> NemotronHConfig:
    """Mamba-2, attention and an attention-free MLP layer (a cache layer that holds nothing)."""
    return NemotronHConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8, **SPREAD,
        layers_block_type=["mamba", "attention", "mlp", "mamba"], mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, conv_kernel=4, expand=2,
    )  # fmt: skip


CONFIGS = {
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3_next": qwen3_next_config,
    "granitemoehybrid": granite_config,
    "nemotron_h": nemotron_h_config,
}
RECURRENT = ("qwen3_next", "granitemoehybrid", "nemotron_h")


def tiny(family: str, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](**overrides)).eval()
    model.generation_config.eos_token_id = None  # decode NEW tokens, an end-of-text id among them, as ours does
    return model


@pytest.fixture(scope="module")
def targets():
    return {family: tiny(family) for family in CONFIGS}


def prompt() -> torch.Tensor:
    return torch.randint(1, V, (1, 12), generator=torch.Generator().manual_seed(1))


def greedy(target, ids: torch.Tensor, new: int = NEW) -> torch.Tensor:
    """The target's own greedy decoding: transformers' generate, one token per forward."""
    return target.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=0)


class Oracle:
    """Drafts the target's own greedy continuation ``reference`` with wrong tokens on purpose: step by step a chain
    of 3 that is all right, wrong at depth 2, wrong at depth 1; with ``trees``, a wrong sibling drawn before the
    right one at depth 1 and a wrong branch beside the right path below it."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, reference: torch.Tensor, trees: bool = False) -> None:
        self.reference, self.trees, self.step = reference.flatten(), trees, 0

    def reset(self, sampling: Sampling, positions=None) -> None:
        self.step = 0

    def propose(self, tokens: torch.Tensor) -> Tree:
        right = self.reference[len(tokens) : len(tokens) + 3].tolist()
        self.step += 1
        if len(right) < 3:
            return chain(torch.tensor(right, dtype=torch.long))
        wrong = [(t + 1) % V for t in right]
        if self.trees:  # nodes: wrong1, right1, right2 (below right1), wrong3 (below right2), wrong2 (below right1)
            tokens_, parents = [wrong[0], right[0], right[1], wrong[2], wrong[1]], [-1, -1, 1, 2, 1]
            if self.step % 2:
                tokens_[3] = right[2]
            return tree_from_parents(tokens_, parents, torch.device("cpu"))
        drafted = [right, [right[0], wrong[1], right[2]], [wrong[0], *right[1:]]][self.step % 3]
        return chain(torch.tensor(drafted, dtype=torch.long))

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        pass


def test_layouts_are_read_from_transformers_configs(targets):
    for family in ("mistral", "qwen2"):
        assert sliding_window(targets[family]) == WINDOW and not recurrent_target(targets[family])
    for family in RECURRENT:
        assert recurrent_target(targets[family]) and sliding_window(targets[family]) is None
    # transformers' cache would keep only the window; ours keeps every position of every attention layer.
    cache = new_cache(targets["mistral"])
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer", "DynamicLayer"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_speculation_is_the_targets_greedy_decoding(family, targets):
    target, ids = targets[family], prompt()
    expected = greedy(target, ids)
    assert len(set(expected[0, ids.shape[1] :].tolist())) > 4
    got, stats = generate(target, Oracle(expected), ids, NEW)
    assert torch.equal(got, expected)
    assert 1 in stats.accepted_lengths and max(stats.accepted_lengths) == 4  # rejected at depth 1 and all accepted
    assert 2 in stats.accepted_lengths  # rejected at depth 2
    # A recurrent target replays the accepted rows of each step that rejected a draft; tau counts verifications only.
    short = sum(length < 4 for length in stats.accepted_lengths)  # rejections, and the last steps' short chains
    assert (0 < stats.replay_forwards <= short) if family in RECURRENT else stats.replay_forwards == 0
    got, _ = generate(target, NGram(k=3), ids, NEW)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_trees_match_greedy_decoding_past_the_window(family, targets):
    target, ids = targets[family], prompt()
    expected = greedy(target, ids)
    assert ids.shape[1] + NEW > 4 * WINDOW
    # The window matters: a target that sees the whole context decodes otherwise.
    assert not torch.equal(greedy(tiny(family, window=4096), ids), expected)
    got, stats = generate(target, Oracle(expected, trees=True), ids, NEW)
    assert torch.equal(got, expected) and max(stats.accepted_lengths) == 4 and 3 in stats.accepted_lengths
    # Batched: sequences of other lengths right-padded, the window by positions, not cache slots.
    prompts = [ids[0], ids[0, 3:]]
    outputs, _ = generate_batch(target, [Oracle(greedy(target, p[None]), trees=True) for p in prompts], prompts, NEW)
    assert all(torch.equal(out, greedy(target, p[None])) for out, p in zip(outputs, prompts))


class Sampled:
    """Drafts a chain of 2 tokens, each drawn from the fixed distribution ``q`` (kept with the tree)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q

    def reset(self, sampling: Sampling, positions=None) -> None:
        pass

    def propose(self, tokens: torch.Tensor) -> Tree:
        dists = self.q.expand(2, -1)
        return chain(torch.multinomial(dists, 1).flatten(), dists)

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        pass


@pytest.mark.parametrize("family", ["mistral", "qwen3_next"])
def test_sampling_is_lossless(family, targets):
    target, ids, sampling, runs = targets[family], prompt(), Sampling(temperature=1.0, top_k=4), 640
    with torch.no_grad():
        first = probabilities(target(ids).logits[0, -1], sampling)
        support = first.nonzero().flatten()
        ids2 = torch.cat((ids.expand(len(support), -1), support[:, None]), 1)
        second = probabilities(target(ids2).logits[:, -1], sampling)
    cells = second.nonzero()  # (row of support, token): the 16 pairs of positive probability
    exact = first[support][cells[:, 0]] * second[cells[:, 0], cells[:, 1]]
    # A sampler blind to its first token (state not rolled back to it) would draw the second from another row.
    wrong = first[support][cells[:, 0]] * second.roll(1, 0)[cells[:, 0], cells[:, 1]]
    q = torch.full((V,), 0.5 / V)
    q[support] += 0.5 / len(support)  # half the drafts within the target's top 4: both accepts and rejections
    torch.manual_seed(0)
    counts = torch.zeros(len(cells))
    index = {(int(support[r]), int(t)): i for i, (r, t) in enumerate(cells.tolist())}
    batch = 1 if recurrent_target(target) else 64
    for _ in range(runs // batch):
        outputs, _ = generate_batch(target, [Sampled(q) for _ in range(batch)], [ids] * batch, 2, sampling)
        for out in outputs:
            pair = int(out[0, -2]), int(out[0, -1])
            assert pair in index, f"sampled {pair}, which the target never samples"
            counts[index[pair]] += 1
    assert_matches(counts, exact, wrong)


def test_recurrent_targets_refuse_trees_and_batches_and_draft_chains(targets, caplog):
    target, ids = targets["qwen3_next"], prompt()
    cache = new_cache(target)
    valid = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    target(ids[:, :-1], past_key_values=cache, use_cache=True)
    tree = tree_from_parents([5, 6, 7], [-1, -1, 0], torch.device("cpu"))
    with pytest.raises(ValueError, match="not a chain: qwen3_next targets carry recurrent state"):
        verify_batch(target, cache, valid, ids[:, -1], [tree], Sampling())
    with pytest.raises(ValueError, match="2 sequences together: granitemoehybrid targets carry recurrent state"):
        generate_batch(targets["granitemoehybrid"], [NGram(), NGram()], [ids, ids], 4)
    with pytest.raises(ValueError, match="self_spec drafts .* crops their cache, but qwen3_next"):
        build_proposer("self_spec", TreeSettings().tree_spec(), target=target)
    with pytest.raises(ValueError, match="draft_model crops its draft's cache, but granitemoehybrid"):
        build_proposer(
            "draft_model", TreeSettings().tree_spec(), draft=targets["granitemoehybrid"], target=targets["mistral"]
        )
    # Methods that draw their own trees draft chains here (logged), and decode the target's greedy output.
    with caplog.at_level(logging.WARNING):
        suffix = build_proposer("suffix", TreeSettings(depth=4).tree_spec(), target=target)
    assert "suffix drafts chains of 4" in caplog.text and "qwen3_next targets carry recurrent state" in caplog.text
    expected = greedy(target, ids)
    repeated = torch.cat((ids, expected[:, ids.shape[1] :], ids), 1)  # repeats: the suffix tree has candidates
    got, _ = generate(target, suffix, repeated, 16)
    assert torch.equal(got, greedy(target, repeated, 16))
