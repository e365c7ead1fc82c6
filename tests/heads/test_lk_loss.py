"""The LK losses (arXiv 2602.23881, ``head.loss: lk``): the acceptance rate's exact gradient, the hybrid's
schedule, and every head type training its acceptance up with it."""

import pytest
import torch

from headstart.heads import build_head
from headstart.heads.losses import acceptance_rate, draft_vocab_mass, lk_loss, soft_cross_entropy
from tests.helpers import LAYER_IDS, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_acceptance_rate_is_one_minus_the_total_variation_distance():
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen).softmax(-1)
    tv = (logits.softmax(-1) - target).abs().sum(-1) / 2
    assert torch.allclose(acceptance_rate(logits, target), 1 - tv, atol=1e-6)
    assert torch.allclose(acceptance_rate(target.log(), target), torch.ones(5), atol=1e-6)  # q = p: always accepted


def test_the_lk_gradient_is_exact_against_finite_differences():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randn(4, 9, generator=gen, dtype=torch.float64).softmax(-1)
    mean_acceptance = torch.tensor(0.4, dtype=torch.float64)  # the schedule's input: a constant of the step

    def loss(x):
        return lk_loss(soft_cross_entropy(x, target), acceptance_rate(x, target), mean_acceptance)

    assert loss(logits).dtype == torch.float64  # no rounding to fp32 inside: the check is exact to O(eps^2)
    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)
    # The acceptance's own gradient, written out: d/dq sum_v min(p_v, q_v) is 1 where q_v < p_v, through softmax.
    q = logits.softmax(-1)
    below = (q < target).double()
    expected = q * (below - (q * below).sum(-1, keepdim=True))
    (grad,) = torch.autograd.grad(acceptance_rate(logits, target).sum(), logits)
    assert torch.allclose(grad, expected, atol=1e-12)


def test_the_hybrids_kl_weight_falls_as_acceptance_rises_and_is_not_trained():
    ce, acceptance = torch.tensor([2.0, 1.0]), torch.tensor([0.2, 0.6], requires_grad=True)
    for mean in (0.0, 0.5, 1.0):
        weight = torch.exp(torch.tensor(-mean))
        expected = weight * ce + (1 - weight) * (1 - acceptance)
        assert torch.allclose(lk_loss(ce, acceptance, torch.tensor(mean)), expected)
    assert lk_loss(ce, acceptance, torch.tensor(0.0)).sum().item() == pytest.approx(3.0)  # acceptance 0: the KL only
    lk_loss(ce, acceptance, acceptance.mean()).sum().backward()
    assert torch.allclose(acceptance.grad, -(1 - torch.exp(-acceptance.mean().detach())).expand(2))


def test_the_draft_vocab_mass_gives_the_targets_own_probabilities_of_the_draft_tokens():
    logits = torch.randn(3, 10)
    ids = torch.tensor([1, 4, 5, 8])
    renormalised = logits[:, ids].softmax(-1)
    assert torch.allclose(renormalised * draft_vocab_mass(logits, logits[:, ids]), logits.softmax(-1)[:, ids])


HEADS = {
    "eagle": {"type": "eagle"},
    "eagle3.1": {"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 2, "fc_norm": True, "norm_output": True},
    "eagle3-reduced-vocab": {"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 2, "draft_vocab_size": 200},
    "medusa": {"type": "medusa", "num_heads": 2},
    "dflash": {"type": "dflash", "layer_ids": LAYER_IDS, "block_size": 4, "num_anchors": 8, "draft_vocab_size": 200},
    "dspark": {"type": "dspark", "layer_ids": LAYER_IDS, "block_size": 3, "num_anchors": 8, "markov_rank": 8},
    "dflash2": {"type": "dflash2", "layer_ids": LAYER_IDS, "block_size": 4, "num_anchors": 8, "selector_rank": 8},
}


def mean_acceptance(metrics: dict[str, torch.Tensor]) -> float:
    """The mean of a head's reported acceptance rates (``acceptance``, or one per step: ``acceptance_j``)."""
    rates = [v.item() for k, v in metrics.items() if k.startswith("acceptance")]
    assert rates, f"no acceptance metric in {sorted(metrics)}"
    return sum(rates) / len(rates)


@pytest.mark.parametrize("name", HEADS)
def test_every_head_type_trains_its_acceptance_up_with_lk(peaked_tiny_llama, name):
    torch.manual_seed(0)
    head = build_head(HEADS[name] | {"loss": "lk"}, peaked_tiny_llama)
    if head.config.options.draft_vocab() is not None and name.startswith("eagle3"):
        head.set_vocab_mapping(torch.arange(peaked_tiny_llama.config.vocab_size, dtype=torch.float))
    batch = make_batch(peaked_tiny_llama, seq=16)
    head.eval()  # fixed anchors: the same blocks before and after
    with torch.no_grad():
        loss_before, before = head.loss(batch)
    head.train()
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(25):
        optimizer.zero_grad()
        head.loss(batch)[0].backward()
        optimizer.step()
    head.eval()
    with torch.no_grad():
        loss_after, after = head.loss(batch)
    assert loss_after < loss_before
    assert mean_acceptance(after) > mean_acceptance(before) + 0.1, (mean_acceptance(before), mean_acceptance(after))


def test_a_head_saved_without_a_loss_option_reads_and_writes_the_same_config(peaked_tiny_llama, tmp_path):
    head = build_head(HEADS["dflash"], peaked_tiny_llama)
    head.save_pretrained(tmp_path / "plain")
    assert '"loss"' not in (tmp_path / "plain" / "config.json").read_text()
    lk = build_head(HEADS["dflash"] | {"loss": "lk"}, peaked_tiny_llama)
    lk.save_pretrained(tmp_path / "lk")
    assert '"loss": "lk"' in (tmp_path / "lk" / "config.json").read_text()
