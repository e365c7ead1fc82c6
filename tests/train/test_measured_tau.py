"""Acceptance measured while training (train/measured.py): it is what eval.acceptance measures, and keep_best keeps
the best head across a resume."""

import json

import pytest
import yaml

from headstart.eval import acceptance
from headstart.heads import read_head_config
from headstart.scripts.export.command import export_head
from headstart.train import eagle
from headstart.train.measured import forget_best_after, sample_prompt, write_best
from tests.helpers import head_weights, records, run_here

pytestmark = pytest.mark.usefixtures("one_thread")

MEASURED = {"eval_prompts": 3, "eval_new_tokens": 12}
DFLASH = {"type": "dflash", "block_size": 4, "num_anchors": 8, "num_layers": 1}


def _with_head(config, head):
    cfg = yaml.safe_load(config.read_text())
    cfg["head"] = head
    config.write_text(yaml.safe_dump(cfg))


def test_a_samples_prompt_is_what_comes_before_its_loss_or_a_texts_first_half():
    assert sample_prompt([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]) == [5, 6]  # a chat: up to the assistant's first token
    assert sample_prompt([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]) == [5, 6]  # a text: its first half (2 of 5 tokens)
    assert sample_prompt([5], [1]) == [5]


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["eagle3", "dflash"])
def test_measured_tau_during_training_is_what_eval_acceptance_measures(head_type, make_config, tmp_path, monkeypatch):
    config, out = make_config("eagle3", **MEASURED)
    if head_type == "dflash":
        _with_head(config, DFLASH)
    run_here(monkeypatch, eagle, config)

    measured = records(out, "measured")
    assert [r["step"] for r in measured] == [3, 6]  # at every held-out evaluation
    last = measured[-1]
    assert last["prompts"] == 3 and 0 < last["new_tokens"] <= 3 * 12 and last["tau"] >= 1
    prompts = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 3 and all(p["category"] == "heldout" and p["input_ids"] for p in prompts)

    # The saved head on the same prompts, the same chain, through eval.acceptance: the same numbers, exactly.
    config_json = read_head_config(out / "head")
    depth = config_json.trained_depth
    report = acceptance.main(
        ["--target", yaml.safe_load(config.read_text())["target"]["path"], "--head", str(out / "head")]
        + ["--method", head_type, "--bench", str(out / "eval_prompts.jsonl"), "--max-new-tokens", "12"]
        + ["--tree", "static", "--depth", str(depth), "--out", str(tmp_path / "eval")]
    )
    entry = report["methods"][head_type]
    assert entry["tau"] == last["tau"]
    assert entry["target_forwards"] == last["target_forwards"] and entry["new_tokens"] == last["new_tokens"]
    assert [a for a in entry["acceptance_by_depth"] if a is not None] == [
        last[f"acc_depth_{d}"] for d in range(1, depth + 1) if f"acc_depth_{d}" in last
    ]

    # The head records both taus, its README states them and the command, and the plot is drawn.
    training = config_json.training
    assert training["step"] == 6 and training["measured_tau"] == last["tau"]
    assert training["predicted_tau"] == records(out, "heldout")[-1]["predicted_tau"]
    readme = (out / "head" / "README.md").read_text()
    assert f"measured tau {last['tau']:.3f}" in readme and f"predicted tau {training['predicted_tau']:.3f}" in readme
    assert "python -m eval.acceptance" in readme and "eval_prompts.jsonl" in readme
    assert (out / "acceptance.png").stat().st_size > 10_000
    card = (export_head(out / "head", "vllm", tmp_path / "export") / "README.md").read_text()
    assert f"| measured tau (training) | {last['tau']:.3f} at step 6" in card
    assert f"| predicted tau (training) | {training['predicted_tau']:.3f} at step 6 |" in card


@pytest.mark.slow
def test_keep_best_exports_the_best_measured_head_and_a_resume_keeps_the_record(make_config, monkeypatch):
    config, out = make_config("eagle3", **MEASURED, eval_every=1, save_every=2, keep_best="measured_tau", max_steps=4)
    run_here(monkeypatch, eagle, config)
    first = {r["step"]: r["tau"] for r in records(out, "measured")}
    best = json.loads((out / "best.json").read_text())
    assert best["measured_tau"] == max(first.values()) and first[best["step"]] == best["measured_tau"]

    # Training goes on from step 4 to 6: the record made before the resume point is still the one to beat.
    run_here(monkeypatch, eagle, config, "train.max_steps=6", "train.resume=true")
    taus = {r["step"]: r["tau"] for r in records(out, "measured")}
    assert sorted(taus) == [1, 2, 3, 4, 5, 6] and {s: taus[s] for s in first} == first
    best = json.loads((out / "best.json").read_text())
    top = max(taus.values())
    # best.json also binds the head it names (files: a digest of each, as checkpoints are bound)
    assert {k: best[k] for k in ("step", "measured_tau")} == {
        "step": min(s for s, t in taus.items() if t == top),
        "measured_tau": top,
    }
    # The exported head is the best one, carrying its own step's record.
    best_weights = head_weights(out / "best")
    for name, weight in head_weights(out).items():
        assert weight.equal(best_weights[name]), name
    assert read_head_config(out / "head").training["step"] == best["step"]


def test_a_resumed_run_forgets_a_best_recorded_after_its_checkpoint(tmp_path):
    (tmp_path / "best" / "head").mkdir(parents=True)
    write_best(tmp_path, {"step": 8, "measured_tau": 2.5})
    assert forget_best_after(tmp_path, 8) == {"step": 8, "measured_tau": 2.5}
    assert forget_best_after(tmp_path, 6) is None  # step 8 is redone: measured again
    assert not (tmp_path / "best.json").exists() and not (tmp_path / "best").exists()


def test_keep_best_without_measurement_and_too_many_prompts_are_refused(make_config):
    from headstart.core.config_files import ConfigError, load_config
    from headstart.train.train_config import resolve_config

    config, _ = make_config("eagle3", keep_best="measured_tau")
    with pytest.raises(ConfigError, match="keep_best: measured_tau needs train.eval_prompts"):
        resolve_config(load_config(config, []), "eagle")
    with pytest.raises(ConfigError, match=r"train.eval_prompts \(9\) exceeds train.heldout_samples \(4\)"):
        resolve_config(load_config(config, ["train.eval_prompts=9", "train.keep_best=last"]), "eagle")


@pytest.mark.parametrize("text", ["{not json", '{"step": "8"}', "[]"])
def test_a_damaged_best_record_is_named(tmp_path, text):
    (tmp_path / "best.json").write_text(text)
    with pytest.raises(ValueError, match="best.json is not"):
        forget_best_after(tmp_path, 4)
