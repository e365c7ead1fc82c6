"""Issue #40 items 7, 10 and 15: the keep-best record is checked and bound to its head, a train.eval_bench file is
checked by eval's own rule before training, and eval_prompts is only held to heldout_samples when something will
be measured."""

import json

import pytest
import yaml
from safetensors.torch import load_file, save_file

from headstart.core.config_files import ConfigError, load_config
from headstart.train import eagle
from headstart.train.loop import runs_target
from headstart.train.measured import export_best, forget_best_after, write_best
from headstart.train.train_config import resolve_config
from tests.helpers import head_weights, run_here

pytestmark = pytest.mark.usefixtures("one_thread")

MEASURED = {"eval_prompts": 2, "eval_new_tokens": 4}


def _best(out, step=2, tau=1.5):
    """A best head (two small files) and the record training writes for it."""
    head = out / "best" / "head"
    head.mkdir(parents=True)
    (head / "config.json").write_text('{"type": "eagle3"}\n')
    (head / "model.safetensors").write_bytes(b"weights of the best step")
    write_best(out, {"step": step, "measured_tau": tau})


# ---- item 7: the keep-best record


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"measured_tau": float("inf")}, r"measured_tau is inf"),
        ({"measured_tau": float("nan")}, r"measured_tau is nan"),
        ({"measured_tau": 0.5}, r"measured_tau is 0\.5"),
        ({"measured_tau": 9.0}, r"measured_tau is 9\.0.*at most 4"),
        ({"step": True}, r"step is True"),
        ({"step": 0}, r"step is 0"),
    ],
)
def test_a_best_record_out_of_range_is_refused_naming_file_key_and_value(tmp_path, edit, message):
    _best(tmp_path)
    path = tmp_path / "best.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))  # json writes inf/nan as Infinity/NaN
    with pytest.raises(ValueError, match=rf"best\.json.*{message}"):
        forget_best_after(tmp_path, 4, depth=3)


def test_a_best_head_swapped_for_another_is_refused_naming_the_file(tmp_path):
    _best(tmp_path)
    (tmp_path / "best" / "head" / "model.safetensors").write_bytes(b"another head's weights")
    with pytest.raises(ValueError, match=r"best/head/model\.safetensors .*does not match its sha256 in .*best\.json"):
        forget_best_after(tmp_path, 4)
    with pytest.raises(ValueError, match=r"model\.safetensors .*does not match"):
        export_best(tmp_path)  # never copied to <out_dir>/head
    assert not (tmp_path / "head").exists()


def test_a_valid_best_record_without_its_head_is_refused_when_the_run_resumes(tmp_path):
    _best(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "best" / "head" / name).unlink()
    with pytest.raises(ValueError, match=r"best/head/model\.safetensors is missing"):
        forget_best_after(tmp_path, 4)


@pytest.mark.slow
def test_a_tampered_best_is_refused_at_resume_before_any_step_and_never_exported(make_config, monkeypatch):
    config, out = make_config(
        "eagle3", **MEASURED, eval_every=1, save_every=2, keep_best="measured_tau", max_steps=2, heldout_samples=2
    )
    run_here(monkeypatch, eagle, config)
    exported = head_weights(out)
    # Another head's weights in best/head and a tau no measurement can beat: the tampering issue #40 item 7 names.
    weights = out / "best" / "head" / "model.safetensors"
    save_file({k: v.zero_() for k, v in load_file(str(weights)).items()}, str(weights))
    record = json.loads((out / "best.json").read_text())
    (out / "best.json").write_text(json.dumps(record | {"measured_tau": float("inf")}))
    lines = (out / "metrics.jsonl").read_text()

    with pytest.raises(ValueError, match=r"best\.json.*measured_tau is inf"):
        run_here(monkeypatch, eagle, config, "train.max_steps=3", "train.resume=true")
    assert (out / "metrics.jsonl").read_text() == lines  # refused before step 3
    assert all(w.equal(exported[k]) for k, w in head_weights(out).items())


# ---- item 10: train.eval_bench checked by eval.acceptance's rule, before training


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([5, 10**6, 7], r"token id 1000000 is past the target tokenizer's"),
        (list(range(5, 300)) * 8, r"past the target's \d+ positions.*train\.eval_new_tokens=4"),
    ],
)
def test_an_eval_bench_eval_acceptance_refuses_is_refused_before_training(make_config, monkeypatch, ids, message):
    config, out = make_config("eagle3", **MEASURED)
    bench = out.parent / "bench.jsonl"
    bench.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"input_ids": ids}) + "\n")
    with pytest.raises(ValueError, match=rf"train\.eval_bench {bench}: bench item {bench}:2 .*{message}"):
        run_here(monkeypatch, eagle, config, f"train.eval_bench={bench}")
    assert not (out / "metrics.jsonl").exists()  # not one step trained


# ---- item 15: eval_prompts against heldout_samples only where something is measured


def test_eval_prompts_past_heldout_samples_is_refused_only_when_measured(make_config):
    config, _ = make_config("eagle3", eval_prompts=8)
    nothing_held_out = ["train.heldout_samples=0", "train.eval_every=0"]
    cfg = resolve_config(load_config(config, nothing_held_out), "eagle")  # the short override run: no eval at all
    assert not runs_target(cfg)  # nothing measured: the borrowed tensors do
    # Measured at the last step's evaluation: 2 held-out prompts are not 8.
    with pytest.raises(ConfigError, match=r"train\.eval_prompts \(8\) exceeds train\.heldout_samples \(2\)"):
        resolve_config(load_config(config, ["train.heldout_samples=2", "train.eval_every=0"]), "eagle")
    unmeasured = (
        r"train\.keep_best: measured_tau needs train\.eval_prompts > 0 \(now 8\).*\(now 0\).*nothing is measured"
    )
    with pytest.raises(ConfigError, match=unmeasured):
        resolve_config(load_config(config, [*nothing_held_out, "train.keep_best=measured_tau"]), "eagle")


@pytest.mark.slow
def test_a_short_run_with_nothing_held_out_trains_and_measures_nothing(make_config, monkeypatch):
    config, out = make_config("eagle3", eval_prompts=8, heldout_samples=0, eval_every=0, max_steps=1)
    run_here(monkeypatch, eagle, config)
    assert (out / "head" / "model.safetensors").is_file()
    assert not (out / "eval_prompts.jsonl").exists()
    assert [json.loads(line)["split"] for line in (out / "metrics.jsonl").read_text().splitlines()] == ["train"]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["eval_prompts"] == 8
