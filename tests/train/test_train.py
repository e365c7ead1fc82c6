"""The torchrun recipes end to end on a tiny target: 2 processes equal 1, SIGKILL + resume is exact, NaN stops.

In-process runs call the recipe's ``main`` as a world of one (saves the ~7 s of imports a subprocess
pays); 2-process runs go through ``torchrun --nproc_per_node 2``, all on the CPU with ZeRO stage 2.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.core.fingerprint import tokenizer_hash
from headstart.heads import load_head
from headstart.train import eagle, medusa
from headstart.train.checkpoint import MARKER, complete_steps
from headstart.train.loop import NonFiniteLoss
from tests.helpers import (
    REPO,
    head_weights,
    records,
    run_here,
    run_torchrun,
    shards_with_a_nan,
    subprocess_env,
    wait_for,
)

TRAINERS = {"eagle": eagle, "eagle3": eagle, "medusa": medusa}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["eagle3", "eagle", "medusa"])
def test_two_processes_train_the_same_head_as_one(head_type, make_config, sharp_target_dir, monkeypatch):
    config, _ = make_config(head_type, eval_prompts=3, eval_new_tokens=12)  # measured acceptance too
    two, one = config.parent / "two", config.parent / "one"
    script = REPO / "train" / f"{TRAINERS[head_type].__name__.split('.')[-1]}.py"
    run_torchrun(script, config, f"train.out_dir={two}")
    run_here(monkeypatch, TRAINERS[head_type], config, f"train.out_dir={one}")

    # Same micro-batches, gradients averaged by all-reduce instead of accumulated: equal up to fp32
    # summation order (max |diff| ~2e-7 after 6 Adam steps here), asserted to atol 1e-5.
    for name, weight in head_weights(one).items():
        torch.testing.assert_close(head_weights(two)[name], weight, atol=1e-5, rtol=0, msg=name)
    steps = records(two)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert [r["tokens"] for r in steps] == [r["tokens"] for r in records(one)]
    # The soft losses cannot fall below the target's entropy: judge the drop, not a level.
    assert steps[-1]["loss"] < 0.9 * steps[0]["loss"], [r["loss"] for r in steps]
    expected = {"eagle": {"acc"}, "eagle3": {"acc_0", "acc_1", "acc_2"}, "medusa": {"acc_0", "acc_1"}}[head_type]
    assert {k for k in steps[0] if k.startswith("acc")} == expected
    heldout = records(two, "heldout")
    assert [r["step"] for r in heldout] == [3, 6] and heldout[-1]["loss"] < heldout[0]["loss"]
    # Each process decodes its share of the prompts; together they measure what one process does.
    measured = records(two, "measured")
    assert [(r["step"], r["prompts"]) for r in measured] == [(3, 3), (6, 3)]
    for got, alone in zip(measured, records(one, "measured"), strict=True):
        assert got["new_tokens"] == alone["new_tokens"] and got["tau"] == pytest.approx(alone["tau"], abs=0.05)
    head = load_head(two / "head", AutoModelForCausalLM.from_pretrained(sharp_target_dir))
    if head_type == "eagle3":  # the draft vocabulary came from the training tokens, not the default first ids
        assert head.t2d.sum() == 256 and head.d2t.any()
    assert yaml.safe_load((two / "config.yaml").read_text())["train"]["out_dir"] == str(two)


def test_medusa2_trains_lora_and_heads_together(make_config, monkeypatch):
    config, out = make_config("medusa", online_capture=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["lora"] = {"r": 4, "alpha": 8, "head_weight": 0.5, "head_weight_warmup": 2}
    config.write_text(yaml.safe_dump(cfg))
    run_here(monkeypatch, medusa, config)
    steps = records(out)
    # The total rises while the heads' weight warms up from 0: judge each part.
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"]  # the target itself trains (through LoRA)
    assert steps[-1]["loss_0"] < 0.9 * steps[0]["loss_0"], [r["loss_0"] for r in steps]
    # The last held-out evaluation (step 6) is kept in the head's config.json for the eval report.
    last = records(out, "heldout")[-1]
    training = json.loads((out / "head" / "config.json").read_text())["training"]
    top1 = [last["acc_0"], last["acc_1"]]
    assert training == {"heldout_top1": top1, "predicted_tau": last["predicted_tau"], "step": 6}
    assert last["predicted_tau"] == pytest.approx(1 + last["acc_0"] + last["acc_0"] * last["acc_1"])
    adapter = load_file(str(out / "lora" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert (out / "head" / "model.safetensors").is_file()


def test_resume_with_another_tokenizer_is_refused(make_config, sharp_target_dir, tmp_path, monkeypatch):
    config, out = make_config("eagle", online_capture=True, max_steps=2, save_every=1, eval_every=0)
    run_here(monkeypatch, eagle, config)
    tokenizer = AutoTokenizer.from_pretrained(sharp_target_dir)
    recorded = json.loads((out / "head" / "config.json").read_text())["tokenizer_hash"]
    assert recorded == tokenizer_hash(tokenizer)
    # The same target with another chat template (a comment: the same tokens, another tokenizer).
    other = tmp_path / "other-tokenizer"
    shutil.copytree(sharp_target_dir, other)
    tokenizer.chat_template += "{# another template #}"
    tokenizer.save_pretrained(other)
    mismatch = f"tokenizer hash {recorded} in the head, {tokenizer_hash(tokenizer)} in the target"
    with pytest.raises(ValueError, match=f"{out / 'head'}: .*{mismatch}.*train into a new train.out_dir"):
        run_here(monkeypatch, eagle, config, f"target.path={other}", "train.max_steps=4")


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_head(make_config, monkeypatch, capsys):
    settings = dict(max_steps=30, save_every=3, eval_every=0)
    config, out = make_config("eagle3", **settings)
    cmd = [sys.executable, str(REPO / "train" / "eagle.py"), "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_dir = out / "checkpoints"
    try:
        wait_for(lambda: complete_steps(ckpt_dir), proc, "the first checkpoint")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = complete_steps(ckpt_dir)
    assert killed_at and killed_at[-1] < 30, killed_at
    # What a kill during DeepSpeed's save leaves: a tag with some files, and `latest` already naming it.
    (ckpt_dir / "step-00000099").mkdir()
    (ckpt_dir / "step-00000099" / "mp_rank_00_model_states.pt").write_bytes(b"half a file")
    (ckpt_dir / "latest").write_text("step-00000099")

    run_here(monkeypatch, eagle, config)
    assert f"resumed from step {killed_at[-1]}" in capsys.readouterr().out
    reference_config, reference = make_config("eagle3", name="reference", **settings)
    run_here(monkeypatch, eagle, reference_config)

    # One thread, the same ops in the same order on the same data: bit for bit.
    resumed, uninterrupted = head_weights(out), head_weights(reference)
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert [r["step"] for r in records(out)] == list(range(1, 31))
    assert [r["loss"] for r in records(out)] == [r["loss"] for r in records(reference)]
    assert complete_steps(ckpt_dir) == [27, 30]
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-00000027", "step-00000030"]
    assert all((p / MARKER).is_file() for p in ckpt_dir.glob("step-*"))


def test_nan_loss_stops_at_its_step_and_keeps_the_last_good_state(make_config, shards, tmp_path, monkeypatch):
    # A real NaN in the data: one training sample's captured state, placed so it is the 8th sample of
    # the seeded order, i.e. the second micro-batch of step 2 (after the first one's backward).
    corrupt = shards_with_a_nan(shards, tmp_path / "shards", 7)

    config, out = make_config("eagle3", save_every=0)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(nan\) at step 2.*last good state .*step-00000001"):
        run_here(monkeypatch, eagle, config, f"capture.out_dir={corrupt}")
    assert complete_steps(out / "checkpoints") == [1]
    assert all(torch.isfinite(w).all() for w in head_weights(out).values())
    assert [r["step"] for r in records(out)] == [1]


@pytest.mark.slow
def test_peagle_trains_through_the_eagle3_recipe_and_resumes_exactly(
    make_config, sharp_target_dir, monkeypatch, capsys
):
    # P-EAGLE is an option of the EAGLE-3 recipe: the same shards, checkpoints, held-out metrics and resume.
    config, out = make_config("eagle3", save_every=3)
    peagle = "head.parallel_drafting=true"
    run_here(monkeypatch, eagle, config, peagle)
    shutil.rmtree(out / "checkpoints" / "step-00000006")  # as if killed after step 3's checkpoint
    shutil.rmtree(out / "head")
    capsys.readouterr()
    run_here(monkeypatch, eagle, config, peagle)
    assert "resumed from step 3" in capsys.readouterr().out
    reference_config, reference = make_config("eagle3", name="reference", save_every=3)
    run_here(monkeypatch, eagle, reference_config, peagle)
    resumed, uninterrupted = head_weights(out), head_weights(reference)
    assert "mask_hidden" in resumed and resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert [r["loss"] for r in records(out)] == [r["loss"] for r in records(reference)]
    heldout = records(out, "heldout")[-1]
    assert {k for k in heldout if k.startswith("acc")} == {"acc_0", "acc_1", "acc_2"} and heldout["predicted_tau"] > 1
    head = load_head(out / "head", AutoModelForCausalLM.from_pretrained(sharp_target_dir))
    pad = AutoTokenizer.from_pretrained(sharp_target_dir).pad_token_id
    assert pad is not None and head.config.options.parallel_drafting.mask_token_id == pad  # the default mask token
    assert head.config.training["predicted_tau"] == pytest.approx(heldout["predicted_tau"])
    # Online capture: the target runs inside each step instead of reading the shards.
    online_config, online = make_config("eagle3", name="online", online_capture=True)
    run_here(monkeypatch, eagle, online_config, peagle)
    steps = records(online)
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
