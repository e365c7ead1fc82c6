"""scripts/dev/gpu_check.py: it refuses clearly without CUDA, its checks and report say which step failed and why,
and with --allow-cpu one step runs for real (the whole CPU run takes ~100 s on 2 cores: too long for the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from headstart.scripts.dev import gpu_check, steps
from tests.helpers import REPO


def test_without_cuda_it_refuses_and_says_what_it_needs(tmp_path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a GPU machine
    cmd = [sys.executable, "-m", "scripts.dev.gpu_check", "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "needs a CUDA GPU" in done.stderr and "torch.cuda.is_available() is False" in done.stderr
    assert "--allow-cpu" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before any step


def _eval_report(folder, methods: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"methods": methods}))


def _method(tau: float, identical: bool, divergences: list | None = None) -> dict:
    mismatched = [f"p{i}" for i in range(len(divergences or []))]
    entry = {"tau": tau, "target_forwards": 10, "new_tokens": 32, "greedy_identical": identical}
    # The rest of a report.json entry (eval.results.MethodResult), which the checks do not read.
    rest = {"acceptance_by_depth": [], "alpha": 0.0, "mean_accepted": tau - 1, "wall_s": 1.0, "tokens_per_s": 32.0}
    rest |= {"speedup_vs_vanilla": 1.0, "draft_depth": 0, "draft_cost_ratio": 0.0, "target_forward_ms": 1.0}
    rest |= {"predicted_speedup": 1.0, "peak_memory_mb": 1.0, "per_category": {}}
    return entry | rest | {"mismatched_prompts": mismatched, "divergences": divergences or []}


def test_the_checks_and_report_on_step_outputs(tmp_path) -> None:
    # Outputs as eval.acceptance writes them: fp32 identical, bf16 one near-tie and one real divergence, and a
    # split target whose n-gram tau differs from the whole one's.
    _eval_report(tmp_path / "fp32", {"vanilla": _method(1.0, True), "ngram": _method(1.5, True)})
    near, real = {"near_tie": True, "logit_gap": 0.001}, {"near_tie": False, "logit_gap": 2.0}
    _eval_report(tmp_path / "bf16", {"vanilla": _method(1.0, True), "ngram": _method(1.5, False, [near])})
    _eval_report(tmp_path / "bf16-bad", {"vanilla": _method(1.0, True), "ngram": _method(1.4, False, [near, real])})
    _eval_report(tmp_path / "tp2", {"vanilla": _method(1.0, True), "ngram": _method(1.25, True)})

    assert gpu_check.check_fp32(tmp_path / "fp32") == (True, {"greedy_identical": {"vanilla": True, "ngram": True}})
    passed, details = gpu_check.check_bf16(tmp_path / "bf16")
    assert passed and details["methods"]["ngram"]["near_ties"] == 1
    passed, details = gpu_check.check_bf16(tmp_path / "bf16-bad")
    assert not passed and details["methods"]["ngram"]["not_near_ties"] == [real]
    passed, details = gpu_check.check_eval_tp(tmp_path / "fp32", tmp_path / "tp2")
    assert not passed and details["differ [tp1, tp2]"] == {"ngram": {"tau": [1.5, 1.25]}}
    assert gpu_check.check_eval_tp(tmp_path / "fp32", tmp_path / "fp32")[0]
    assert not gpu_check.check_eval_tp(tmp_path / "missing", tmp_path / "tp2")[0]

    one_gpu = gpu_check.plan(gpu_check.Settings.for_device("cuda"), tmp_path, [], gpus=1)
    assert [s for s in one_gpu if isinstance(s, dict)] == [
        {"name": "capture-tp2", "skipped": "skipped: 1 GPU visible"},
        {"name": "eval-tp2", "skipped": "skipped: 1 GPU visible"},
    ]
    two_gpus = {s.name: s.commands for s in gpu_check.plan(gpu_check.Settings.for_device("cuda"), tmp_path, [], 2)}
    assert "--tp-size" in two_gpus["eval-tp2"][0] and "target.tp_size=2" in two_gpus["capture-tp2"][0]
    assert two_gpus["eval-graphs"][0][-2:] == ["--kv-cache", "static"]  # eval-fp32 through the CUDA graphs

    report = {"machine": "m", "device": "cuda", "gpus": 1, "torch": "t", "steps": []}
    report["steps"] = [
        {"name": "eval-fp32", "command": "python -m eval.acceptance", "wall_s": 1.0, "passed": True, "details": {}},
        {"name": "capture-tp2", "skipped": "skipped: 1 GPU visible"},
    ]
    gpu_check.write_report(report, tmp_path)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["passed"] is True
    report["steps"].append({"name": "eval-bf16", "command": "c | d", "wall_s": 2.0, "passed": False, "details": {}})
    gpu_check.write_report(report, tmp_path)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["passed"] is False
    text = (tmp_path / "gpu_check.md").read_text()
    assert text.startswith("# gpu-check: FAILED") and "| capture-tp2 | skipped: 1 GPU visible |" in text
    assert "| eval-bf16 | **FAIL** | 2.0 |" in text and "`c \\| d`" in text


def test_heads_bf16_trains_every_demo_recipe_in_bf16_then_evaluates_them_all(tmp_path) -> None:
    (capture, *trains, evaluate) = gpu_check.heads_bf16_commands(gpu_check.Settings.for_device("cuda"), tmp_path)
    assert "data_recipes.capture" in capture and "data.limit=64" in capture
    trainers = [next(a for a in command if a.startswith("train/")) for command in trains]
    assert trainers == [f"train/{t}.py" for t in ("eagle", "eagle", "eagle", "medusa", "eagle", "eagle", "eagle")]
    for recipe, command in zip(gpu_check.DEMO_RECIPES, trains):
        assert f"configs/{recipe}.yaml" in command and "train.dtype=bf16" in command
        assert f"capture.out_dir={tmp_path / 'capture'}" in command and "target.device=cuda" in command
    assert evaluate[evaluate.index("--dtype") + 1] == "bf16"
    assert evaluate[evaluate.index("--method") + 1] == "vanilla,eagle,eagle3,peagle,medusa,dflash,dspark,dflash2"
    assert evaluate[evaluate.index("--head") + 1].split(",")[-1] == str(tmp_path / "demo-dflash2" / "head")

    near = {"near_tie": True, "logit_gap": 0.001}
    _eval_report(tmp_path / "eval", {"vanilla": _method(1.0, True), "dspark": _method(2.0, False, [near])})
    for i, recipe in enumerate(gpu_check.DEMO_RECIPES):
        (tmp_path / recipe).mkdir()
        lines = [{"step": 1, "split": "train", "loss": 9.0}, {"step": 2, "split": "train", "loss": 5.0 + i}]
        lines.append({"step": 2, "split": "heldout", "loss": 1.0})
        (tmp_path / recipe / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    passed, details = gpu_check.check_heads_bf16(tmp_path)
    assert passed and details["last_train_loss"]["demo-eagle"] == 5.0 and details["methods"]["dspark"]["near_ties"] == 1
    (tmp_path / "demo-dspark" / "metrics.jsonl").write_text('{"step": 2, "split": "train", "loss": NaN}\n')
    assert gpu_check.check_heads_bf16(tmp_path)[0] is False


def test_allow_cpu_runs_the_step_and_records_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)  # the CPU path on any machine
    report = gpu_check.main(["--out", str(tmp_path), "--allow-cpu", "--steps", "eval-fp32"])
    (step,) = report["steps"]
    assert step["name"] == "eval-fp32" and step["returncode"] == 0 and step["passed"] is True and step["wall_s"] > 0
    assert "-m eval.acceptance" in step["command"] and "--device cpu --dtype fp32" in step["command"]
    assert step["details"] == {"greedy_identical": {"vanilla": True, "ngram": True}}
    assert report["passed"] is True and json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert json.loads((tmp_path / "eval-fp32" / "report.json").read_text())["device"] == "cpu"


def test_a_failed_steps_report_shows_the_traceback_not_torchruns_summary() -> None:
    log = "\n".join(
        [
            "$ python -m torch.distributed.run train/eagle.py",
            "train:   0%|",
            "[rank0]: Traceback (most recent call last):",
        ]
        + [f'[rank0]:   File "train/loop.py", line {n}, in train_step' for n in range(3)]
        + ["[rank0]: RuntimeError: No backend type associated with device type cpu", "E1128 failed (exitcode: 1)"]
        + ["Traceback (most recent call last):", '  File "torch/distributed/run.py", line 994', "ChildFailedError: "]
        + ["=" * 60, "train/eagle.py FAILED", "Root Cause (first observed failure):", "[0]:"]
    )
    tail = steps.failure_tail(log)
    # torchrun's own traceback is the last one and names ChildFailedError: the rank's, above it, is the cause.
    assert tail[0] == "[rank0]: Traceback (most recent call last):" and len(tail) == 6
    assert tail[-2:] == [
        "[rank0]: RuntimeError: No backend type associated with device type cpu",
        "E1128 failed (exitcode: 1)",
    ]
    assert steps.failure_tail("a\nb\nc", lines=2) == ["b", "c"]


def test_fused_ttt_step_compares_the_two_attention_paths_and_fails_on_a_gap(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    report = gpu_check.main(["--out", str(tmp_path), "--allow-cpu", "--steps", "fused-ttt"])
    (step,) = report["steps"]
    assert step["passed"] is True and "-m scripts.dev.fused_ttt --device cpu --seq-len 64" in step["command"]
    worst = step["details"]["worst"]
    assert worst["fp32_fused"] < 1e-5 and 0 < worst["bf16_fused"] < 2e-2  # bf16 rounds, fp32 does not
    written = json.loads((tmp_path / "fused-ttt" / "fused_ttt.json").read_text())
    written["steps"][0] |= {"bf16_fused": 0.5, "passed": False}
    written["passed"] = False
    (tmp_path / "fused-ttt" / "fused_ttt.json").write_text(json.dumps(written))
    assert gpu_check.check_fused_ttt(tmp_path / "fused-ttt") == (
        False,
        {"seq_len": 64, "worst": worst | {"bf16_fused": 0.5}},
    )
