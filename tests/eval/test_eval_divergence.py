"""Greedy mismatches are located and explained: first differing token and the target's logit gap there."""

import copy

import torch

from headstart.data_recipes.bench import BenchItem
from headstart.data_recipes.prompts import render
from headstart.eval.run import divergence


def _greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def test_divergence_names_the_token_and_the_target_logit_gap(demo_target, one_thread):
    demo_target, tokenizer = demo_target
    item = BenchItem(id="q1", category="math", turns=["What is 12 plus 30?"])
    prompt = render(tokenizer, [{"role": "user", "content": item.turns[0]}])
    ref = _greedy(demo_target, prompt, 8)
    with torch.no_grad():
        logits = demo_target(torch.cat((prompt[0], torch.tensor(ref[:3])))[None]).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    out = ref[:3] + [second] + ref[4:]

    d = divergence(demo_target, tokenizer, item, [ref], [out])

    assert (d["prompt"], d["turn"], d["token"]) == ("q1", 0, 3)
    assert (d["vanilla_token"], d["method_token"]) == (ref[3], second)
    assert abs(d["logit_gap"] - float(logits[ref[3]] - logits[second])) < 1e-4
    assert d["logit_gap"] > 0  # vanilla's token is the argmax
    assert d["logit_gap"] > 1e-3 and d["near_tie"] is False  # the runner-up of a fp32 model: a real choice


def test_divergence_of_an_exact_tie_is_a_near_tie(demo_target, one_thread):
    """Give the runner-up token the argmax's lm_head row: their logits tie exactly, so the swap is a tie."""
    demo_target, tokenizer = demo_target
    item = BenchItem(id="q3", category="math", turns=["What is 7 plus 5?"])
    prompt = render(tokenizer, [{"role": "user", "content": item.turns[0]}])
    ref = _greedy(demo_target, prompt, 4)
    with torch.no_grad():
        logits = demo_target(torch.cat((prompt[0], torch.tensor(ref[:1])))[None]).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    tied = copy.deepcopy(demo_target)
    with torch.no_grad():
        tied.lm_head.weight[second] = tied.lm_head.weight[ref[1]]

    d = divergence(tied, tokenizer, item, [ref], [ref[:1] + [second] + ref[2:]])

    assert d["token"] == 1 and d["logit_gap"] == 0.0 and d["near_tie"] is True


def test_divergence_of_an_early_stop_is_no_token_choice(demo_target, one_thread):
    demo_target, tokenizer = demo_target
    item = BenchItem(id="q2", category="math", turns=["Hi", "And then?"])
    ref = [[5, 6, 7], [8, 9, 10]]
    d = divergence(demo_target, tokenizer, item, ref, [[5, 6, 7], [8, 9]])
    assert (d["turn"], d["token"], d["logit_gap"], d["near_tie"]) == (1, 2, None, False)
