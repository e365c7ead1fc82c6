"""scripts/bench/peer_speculators.py's pure parts: the pre-norm state it recovers, the cache that lets a rerun with
one more variant retrain nothing else, and the bf16 rounding of headstart's head. The conversion read back by
speculators' own dataset class is in tests/export/test_peer_checkpoints.py (engines group)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from headstart.scripts.bench import peer_speculators as bench


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def test_prenorm_state_is_the_state_the_final_norm_read() -> None:
    torch.manual_seed(0)
    weight = torch.rand(64) + 0.5
    pre = torch.randn(6, 64) * torch.tensor([0.01, 0.03, 0.1, 0.3, 1.0, 3.0])[:, None]  # ms(x) against eps = 1e-4
    recovered = bench.prenorm_state(rms_norm(pre, weight, 1e-4), weight, 1e-4)
    # The scale is exact while eps is not lost against ms(x) in fp32; beyond, the norm no longer sees it.
    torch.testing.assert_close(recovered[:4], pre[:4], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(rms_norm(recovered, weight, 1e-4), rms_norm(pre, weight, 1e-4))


def test_cache_reuses_a_matching_stamp_and_empties_any_other_folder(tmp_path) -> None:
    made: list[int] = []

    def make(folder):
        made.append(len(made))
        (folder / "checkpoint").write_text(str(len(made)))
        return {"run": len(made)}

    folder = tmp_path / "leg"
    assert bench.cached(folder, {"steps": 4}, make) == {"run": 1}
    assert bench.cached(folder, {"steps": 4}, make) == {"run": 1} and made == [0]  # reused: nothing made
    assert bench.cached(folder, {"steps": 8}, make) == {"run": 2}  # another key: made again
    (folder / bench.STAMP).unlink()  # an interrupted run: its checkpoints must not be resumed from
    (folder / "stale").write_text("")
    assert bench.cached(folder, {"steps": 8}, make) == {"run": 3}
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint", bench.STAMP]


def test_rounded_head_keeps_its_files_metadata_and_integer_tensors(tmp_path) -> None:
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    weight = torch.tensor([1.0 + 2**-10, 3.0, -2.5 - 2**-12])
    save_file({"w": weight, "d2t": torch.arange(3)}, str(head / "model.safetensors"), metadata={"format": "pt"})
    out = bench.rounded_to_bf16(head, tmp_path / "bf16")
    state = load_file(str(out / "model.safetensors"))
    assert state["w"].dtype == torch.float32 and state["w"].tolist() == [1.0, 3.0, -2.5]
    assert torch.equal(state["d2t"], torch.arange(3)) and (out / "config.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        assert written.metadata() == {"format": "pt"}


def test_variants_are_named_from_the_table() -> None:
    assert bench.chosen("all") == [*bench.VARIANTS, *bench.AFTER_ADAMW]
    assert bench.chosen("baseline,adamw") == ["baseline", "adamw"]
    with pytest.raises(SystemExit, match="unknown variants sgd"):
        bench.chosen("baseline,sgd")
    with pytest.raises(SystemExit, match="unknown variants sgd"):
        bench.chosen("adamw+sgd")


def test_variants_joined_by_plus_flip_together() -> None:
    joined = bench.variant_of("adamw+cosine+flat-ttt+bf16-head")
    assert joined.speculators_flags == "--optimizer adamw --scheduler-type cosine --scheduler-warmup-steps 10"
    assert joined.headstart_overrides == ("head.ttt_decay=1.0",)
    assert joined.bf16_head
    assert bench.variant_of("adamw") == bench.VARIANTS["adamw"]


def test_each_trainers_head_is_cached_by_the_parts_that_change_its_run() -> None:
    def headstart(name: str) -> str:
        return bench.trainer_folder("headstart", name, lambda part: part.headstart_overrides)

    def speculators(name: str) -> str:
        return bench.trainer_folder("speculators", name, lambda part: part.speculators_flags)

    assert headstart("adamw+seed-1") == headstart("seed-1") == "headstart-seed-1"
    assert headstart("adamw+cosine") == "headstart" and speculators("flat-ttt") == "speculators"
    assert speculators("adamw+flat-ttt+ttt-decay") == "speculators-adamw+ttt-decay"


def test_held_out_figures_of_each_trainer(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    records = [
        '{"step": 20, "split": "train", "loss": 12.0}',
        '{"step": 20, "split": "heldout", "acc_0": 0.42, "acc_1": 0.36, "predicted_tau": 1.57}',
    ]
    metrics.write_text("\n".join(records) + "\n")
    assert bench.headstart_heldout(metrics) == {"heldout_top1": 0.42, "heldout_tau": 1.57}
    # speculators' trainer logs through rich, wrapped as here (its last epoch's validation).
    log = tmp_path / "train.log"
    lines = ["[15:07:50] INFO     val/loss_0_epoch=4.235,                       trainer.py:671"]
    lines += [
        f"                    val/full_acc_{j}_epoch={a},  val/cond_acc_{j}_epoch=0.3,"
        for j, a in enumerate(["0.151", "0.045", "2.00e-03"])
    ]
    log.write_text("\n".join(lines) + "\n")
    figures = bench.speculators_heldout(log)
    assert figures["heldout_top1"] == 0.151 and figures["heldout_tau"] == pytest.approx(1.198)


def test_each_row_is_recorded_beside_the_rows_other_runs_wrote(tmp_path) -> None:
    path = tmp_path / "report.json"
    at_80 = argparse.Namespace(steps=80, capture="runs/demo/capture-eagle3")
    bench.recorded(path, at_80, "baseline", {"tau": 1.0})
    bench.recorded(path, at_80, "adamw", {"tau": 2.0})  # as another run would, between two of the first one's rows
    assert json.loads(path.read_text())["variants"] == {"baseline": {"tau": 1.0}, "adamw": {"tau": 2.0}}
    bench.recorded(path, argparse.Namespace(steps=20, capture="c"), "adamw", {"tau": 3.0})
    assert json.loads(path.read_text()) == {"steps": 20, "capture": "c", "variants": {"adamw": {"tau": 3.0}}}


def test_a_recipe_change_is_a_new_cache_key_and_headstart_trains_the_studied_optimizer(tmp_path, monkeypatch) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((Path(bench.HEAD_CONFIG)).read_text())
    monkeypatch.setattr(bench, "HEAD_CONFIG", str(recipe))
    before = bench.recipe_digest()
    assert bench.recipe_digest() == before  # the same recipe: its heads are reused
    recipe.write_text(recipe.read_text().replace("lr: 1.0e-3", "lr: 2.0e-3", 1))
    assert bench.recipe_digest() != before
    # The attribution study's figures are AdamW's on headstart's side; the "muon" variant overrides it after.
    assert bench.STUDIED_OPTIMIZER == "train.optimizer=adamw"
    assert bench.variant_of("muon").headstart_overrides == ("train.optimizer=muon",)
