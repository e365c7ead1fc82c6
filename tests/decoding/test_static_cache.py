"""The static KV cache (``decoding.static_cache``): the same buffers, masks and query buckets a CUDA graph replays,
run eagerly on the CPU, decode token for token what the dynamic cache decodes, and accept as many tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_block import DFlash
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.proposers_medusa import Medusa
from headstart.decoding.static_cache import bucket, setup_static_cache, static_decoding
from headstart.decoding.verify import Sampling, generate, generate_batch
from headstart.heads import build_head
from tests.decoding.test_decoding import Oracle, reference
from tests.decoding.test_family_caches import mistral_config, qwen3_next_config
from tests.helpers import tiny_llama

NEW = 24


def proposer(name: str, target):
    torch.manual_seed(0)
    if name == "vanilla":
        return Vanilla()
    if name == "ngram":
        return NGram(k=4)
    if name == "eagle3_tree":
        head = build_head({"type": "eagle3", "layer_ids": [0, 1, 2], "draft_vocab_size": 200}, target)
        return Eagle(head, top_k=3, depth=3, total_tokens=10)
    if name == "medusa":
        return Medusa(build_head({"type": "medusa", "num_heads": 4}, target))
    head = build_head({"type": "dflash", "layer_ids": [1, 2, 3], "block_size": 4}, target)
    return DFlash(head)


def decode(target, name, prompt, sampling=None):
    torch.manual_seed(5)  # sampling draws from the global generator: the same draws both ways
    return generate(target, proposer(name, target), prompt, NEW, sampling, target.config.eos_token_id)


@pytest.mark.parametrize("name", ["vanilla", "ngram", "eagle3_tree", "medusa", "dflash"])
def test_static_cache_decodes_what_the_dynamic_cache_decodes(name):
    dynamic_target, static_target = tiny_llama(0, num_hidden_layers=4), tiny_llama(0, num_hidden_layers=4)
    setup_static_cache(static_target, capacity=96)
    gen = torch.Generator().manual_seed(3)
    repeated = torch.randint(3, 300, (5,), generator=gen)
    prompts = [torch.tensor([[7]]), torch.cat((repeated, torch.randint(3, 300, (4,), generator=gen), repeated))[None]]
    for prompt in prompts:
        expected, stats = decode(dynamic_target, name, prompt)
        assert torch.equal(expected, reference(dynamic_target, prompt, NEW))  # the target's own greedy output
        got, static_stats = decode(static_target, name, prompt)
        assert torch.equal(got, expected)
        assert static_stats.accepted_lengths == stats.accepted_lengths
    # Sampling draws the same tokens from the same generator state: the step's distributions are the same.
    sampled, _ = decode(dynamic_target, name, prompts[1], Sampling(temperature=0.8))
    assert torch.equal(decode(static_target, name, prompts[1], Sampling(temperature=0.8))[0], sampled)


def test_long_acceptance_writes_the_accepted_rows_where_the_next_step_reads_them():
    dynamic_target, static_target = tiny_llama(0, num_hidden_layers=4), tiny_llama(0, num_hidden_layers=4)
    engine = setup_static_cache(static_target, capacity=64)
    prompt = torch.tensor([[5, 9, 11]])
    expected = reference(dynamic_target, prompt, 40)
    for k in (1, 3, 6):  # every proposal right: chains of k accepted whole, queries bucketed to 2, 4 and 8
        out, stats = generate(static_target, Oracle(expected, k), prompt, 40)
        assert torch.equal(out, expected[:, : out.shape[1]]) and out.shape[1] == 43
        assert max(stats.accepted_lengths) == k + 1  # the chain and the bonus token
    # The cache holds the prompt and every committed token but the last (the next step's root), past the 40 kept.
    assert engine.layers[0].length == prompt.shape[1] + sum(stats.accepted_lengths) - 1 >= 42


def test_a_sliding_window_target_decodes_the_same_with_a_static_cache():
    torch.manual_seed(0)
    dynamic_target = AutoModelForCausalLM.from_config(mistral_config()).eval()  # windows of 8, shorter than context
    static_target = AutoModelForCausalLM.from_config(mistral_config()).eval()
    static_target.load_state_dict(dynamic_target.state_dict())
    setup_static_cache(static_target, capacity=80)
    prompt = torch.arange(3, 23)[None]
    expected, stats = generate(dynamic_target, NGram(k=3), prompt, 32)
    got, static_stats = generate(static_target, NGram(k=3), prompt, 32)
    assert torch.equal(got, expected) and static_stats.accepted_lengths == stats.accepted_lengths


def test_what_the_static_cache_refuses_or_leaves_to_the_dynamic_one():
    target = tiny_llama(0, num_hidden_layers=2)
    setup_static_cache(target, capacity=16)
    with pytest.raises(ValueError, match="holds 16 positions and this forward needs 20"):  # the prompt less its last
        generate(target, Vanilla(), torch.arange(3, 24)[None], 4)
    # Several sequences decode with the dynamic cache (each bucket's graph is for one sequence).
    outs, _ = generate_batch(target, [Vanilla(), Vanilla()], [torch.tensor([[4, 5]]), torch.tensor([[6]])], 30)
    assert [o.shape[1] for o in outs] == [32, 31]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA target"):
        setup_static_cache(target, capacity=16, graphs=True)
    recurrent = AutoModelForCausalLM.from_config(qwen3_next_config()).eval()
    with pytest.raises(ValueError, match="recurrent state"):
        setup_static_cache(recurrent, capacity=16)
    assert static_decoding(recurrent) is None
    assert [bucket(n) for n in (1, 3, 4, 5, 65, 200)] == [1, 4, 4, 8, 128, 200]
