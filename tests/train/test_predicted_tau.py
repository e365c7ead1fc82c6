"""Predicted acceptance length from held-out per-position top-1 accuracies (docs/TRAINING.md)."""

import pytest

from headstart.train.metrics import heldout_top1, predicted_tau, training_summary


def test_predicted_tau_is_the_chain_sum_of_running_products():
    assert predicted_tau([]) == 1.0
    assert predicted_tau([1.0, 1.0, 1.0]) == 4.0  # every draft accepted, plus the target's own token
    assert predicted_tau([0.0, 0.9]) == 1.0  # nothing after a certain rejection counts
    assert predicted_tau([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_heldout_top1_reads_positions_in_order():
    eagle3 = {"step": 6, "split": "heldout", "loss": 2.0, "acc_10": 0.1, "acc_2": 0.3, "acc_0": 0.7, "acc_1": 0.5}
    eagle3.update({f"acc_{j}": 0.2 for j in range(3, 10)})
    assert heldout_top1(eagle3)[:3] == [0.7, 0.5, 0.3] and heldout_top1(eagle3)[-1] == 0.1
    assert heldout_top1({"step": 1, "acc": 0.6, "vloss": 0.1}) == [0.6]
    summary = training_summary({"step": 40, "acc_0": 0.5, "acc_1": 0.5, "loss_0": 1.0})
    assert summary == {"heldout_top1": [0.5, 0.5], "predicted_tau": 1.75, "step": 40}
