"""scripts/bench/gpu.py (make gpu-bench): it refuses without CUDA unless --allow-cpu, a tiny CPU run writes every
figure beside its goal, the goals are computed from the stages' own numbers, and the datasheet table and the
weight-read bytes are the published ones."""

from __future__ import annotations

import json

import pytest
import torch

from headstart.scripts.bench import gpu as gpu_bench
from headstart.scripts.bench.devices import device_peak
from headstart.scripts.bench.scale_shapes import build_target


def test_without_cuda_it_refuses_and_names_allow_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_bench.torch.cuda, "is_available", lambda: False)  # the CPU path on any machine
    with pytest.raises(SystemExit) as refused:
        gpu_bench.main(["--out", str(tmp_path / "out")])
    assert "torch.cuda.is_available() is False" in str(refused.value.code) and "--allow-cpu" in str(refused.value.code)
    assert not (tmp_path / "out").exists()


def test_allow_cpu_writes_every_figure_and_goal(tmp_path) -> None:
    result = gpu_bench.main(["--out", str(tmp_path), "--allow-cpu"])
    written = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert (
        written["figures"].keys() == gpu_bench.GOALS.keys() and written["goals"]["verify_64_vs_one_token"] == "<= 1.3"
    )
    assert written["skipped"] == [] and written["device_peak"] is None  # a CPU has no datasheet row
    settings = gpu_bench.Settings.for_device(torch.device("cpu"))
    for head in gpu_bench.HEADS:
        for length in settings.lengths:
            row = written["heads"][head][str(length)]
            assert row["tokens_per_s"] > 0 and row["tflops_per_step"] > 0 and row["mfu"] is None
    # What a CPU can measure is measured; MFU and the floor need a GPU's datasheet.
    measured = {k for k, v in written["figures"].items() if v is not None}
    expected = {"capture_vs_forward", "eagle3_long_vs_short", "eagle3_fused_long_vs_short", "vanilla_vs_hf_best"}
    assert measured == expected | {"verify_64_vs_one_token", "vanilla_graphs_vs_hf_best"}
    assert result["graphs"]["greedy_identical"] is True and result["graphs"]["graphs"] is False  # eager on a CPU
    assert result["capture"]["shards"] == 2  # several shards: each written behind the next one's forward
    decoding = result["decoding"]
    assert decoding["floor_tokens_per_s"] is None and result["hf_static"]["compiled"] is False
    assert written["figures"]["vanilla_vs_hf_best"] == pytest.approx(
        decoding["ours_tokens_per_s"] / max(decoding["hf_default_tokens_per_s"], result["hf_static"]["tokens_per_s"])
    )
    assert written["figures"]["verify_64_vs_one_token"] == result["verify"]["relative"][-1]
    assert result["verify"]["ms"][0] == result["draft_step"]["one_token_ms"]
    report = (tmp_path / "gpu_bench.md").read_text()
    assert "| capture_vs_forward |" in report and "| dspark | 128 |" in report


def test_figures_and_verdicts_follow_the_goals() -> None:
    s = gpu_bench.Settings.for_device(torch.device("cuda"))  # its lengths only: nothing runs
    result = {
        "capture": {"capture_vs_forward": 0.95},
        "heads": {
            "eagle3": {
                "1024": {"tokens_per_s": 10000.0, "mfu": 0.2},
                "2048": {"tokens_per_s": 9000.0, "mfu": 0.4},
                "32768": {"tokens_per_s": 3000.0, "mfu": 0.1},
            }
        },  # fmt: skip
        "verify": {"relative": [1.0, 1.1, 1.4]},
        "decoding": {"ours_tokens_per_s": 150.0, "hf_default_tokens_per_s": 40.0, "floor_tokens_per_s": 300.0},
        "hf_static": {"error": "RuntimeError: compile failed"},  # a failed stage counts as not measured
    }
    figures = gpu_bench.figures(result, s)
    assert figures == {
        "capture_vs_forward": 0.95,
        "eagle3_long_vs_short": 0.3,
        "eagle3_mfu_at_2k": 0.4,
        "eagle3_fused_long_vs_short": None,  # no fused rows in this result
        "eagle3_fused_mfu_at_2k": None,
        "vanilla_vs_floor": 0.5,
        "vanilla_vs_hf_best": 3.75,
        "vanilla_graphs_vs_floor": None,  # no graphs stage in this result
        "vanilla_graphs_vs_hf_best": None,
        "verify_64_vs_one_token": 1.4,
    }
    verdicts = {name: gpu_bench.verdict(name, value) for name, value in figures.items()}
    assert verdicts == {
        "capture_vs_forward": "met",
        "eagle3_long_vs_short": "missed",
        "eagle3_mfu_at_2k": "met",
        "eagle3_fused_long_vs_short": "not measured",
        "eagle3_fused_mfu_at_2k": "not measured",
        "vanilla_vs_floor": "missed",
        "vanilla_vs_hf_best": "met",
        "vanilla_graphs_vs_floor": "not measured",
        "vanilla_graphs_vs_hf_best": "not measured",
        "verify_64_vs_one_token": "missed",
    }
    assert gpu_bench.verdict("capture_vs_forward", None) == "not measured"


def test_datasheet_rows_match_the_names_torch_reports() -> None:
    assert device_peak("NVIDIA H200").memory_bytes_per_s == 4.8e12
    assert device_peak("NVIDIA H100 80GB HBM3").memory_bytes_per_s == 3.35e12  # SXM
    assert device_peak("NVIDIA H100 PCIe").bf16_flops == 756.0e12  # not the SXM row
    assert device_peak("NVIDIA A100-SXM4-40GB").memory_bytes_per_s == 1.555e12
    assert device_peak("AMD EPYC 7B13") is None


def test_weight_read_bytes_leave_out_an_untied_input_embedding() -> None:
    eight_b = build_target("llama-3.1-8b", None, torch.device("meta"), torch.bfloat16)
    # 8,030,261,248 parameters less the 128,256 x 4,096 input embedding, 2 bytes each.
    assert gpu_bench.read_bytes(eight_b) == (8_030_261_248 - 128_256 * 4_096) * 2
    tied = build_target("llama-3.2-1b", None, torch.device("meta"), torch.bfloat16)
    assert gpu_bench.read_bytes(tied) == 1_235_814_400 * 2
