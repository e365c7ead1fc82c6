"""Speculative sampling with an image prompt is lossless: the first two tokens a tiny Qwen2.5-VL (mrope) target
samples through the one verification core, a random EAGLE-3 head drafting, follow the target's own distribution
given the image (a chi-square goodness-of-fit test at significance 0.001, as in test_decoding_sampling.py)."""

import copy

import torch

from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import Sampling, generate, probabilities
from headstart.heads import build_head
from tests.helpers import assert_matches, one_image_prompt

SAMPLING = Sampling(temperature=1.0, top_k=2)  # two candidates a token: four outcomes for two tokens
RUNS = 80


def next_token_probs(target, ids, vision) -> torch.Tensor:
    """The target's sampling distribution [V] of the token after ``ids`` (its image read when ``vision`` has it;
    the per-token flags padded for the tokens after the prompt)."""
    flags = vision.get("mm_token_type_ids")
    if flags is not None:
        vision = vision | {"mm_token_type_ids": torch.nn.functional.pad(flags, (0, ids.shape[1] - flags.shape[1]))}
    return probabilities(target(ids, **vision).logits[0, -1], SAMPLING)


def two_token_probs(target, ids, vision, outcomes) -> torch.Tensor:
    """P(x1, x2 | the prompt) of each (x1, x2) of ``outcomes``."""
    first = next_token_probs(target, ids, vision)
    after = {a: next_token_probs(target, torch.cat((ids, torch.tensor([[a]])), 1), vision) for a, _ in outcomes}
    return torch.stack([first[a] * after[a][b] for a, b in outcomes])


@torch.no_grad()
def test_sampling_an_image_prompt_follows_the_targets_distribution(tiny_qwen_vl, one_thread):
    target, _, processor = tiny_qwen_vl
    target = copy.deepcopy(target)
    target.lm_head.weight.data *= 40  # peaked: a random target's tokens are near-uniform, the image barely counts
    ids, vision = one_image_prompt(processor, "shape-01.png", "Which bar is the tallest?")
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, target)
    for p in head.parameters():  # a draft unlike the target: rejections resample from the residual
        p.data.normal_(0, 0.1)
    outcomes = [
        (a, b)
        for a in next_token_probs(target, ids, vision).topk(2).indices.tolist()
        for b in next_token_probs(target, torch.cat((ids, torch.tensor([[a]])), 1), vision).topk(2).indices.tolist()
    ]
    counts = torch.zeros(len(outcomes))
    torch.manual_seed(0)
    for _ in range(RUNS):
        out, _ = generate(target, Eagle(head, top_k=2, depth=2, total_tokens=4), ids, 2, SAMPLING, vision=vision)
        counts[outcomes.index(tuple(out[0, -2:].tolist()))] += 1
    # Power: the target without the image, what a sampler that lost it would follow, fails by far.
    assert_matches(counts, two_token_probs(target, ids, vision, outcomes), two_token_probs(target, ids, {}, outcomes))
