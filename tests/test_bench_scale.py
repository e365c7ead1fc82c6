"""scripts/bench_scale.py: the real shapes it builds, and one whole run at a tiny shape (seconds, seeded)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from headstart.scripts import bench_scale


@pytest.mark.parametrize(
    ("shape", "parameters"),
    # The published parameter counts (the models' hub cards: Llama-3.2-1B ties its embeddings).
    [("llama-3.1-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360), ("llama-3.2-1b", 1_235_814_400)],
)
def test_real_shapes_have_the_published_parameter_count(shape: str, parameters: int) -> None:
    # On the meta device: the shapes without the memory.
    model = bench_scale.build_target(shape, None, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model.dtype == torch.bfloat16 and not any(p.requires_grad for p in model.parameters())
    reduced = bench_scale.build_target(shape, 4, torch.device("meta"), torch.bfloat16)
    assert reduced.config.num_hidden_layers == 4 and reduced.config.hidden_size == model.config.hidden_size


def test_fused_layers_are_eagle3_defaults_or_three_spread_ones() -> None:
    assert bench_scale.fused_layers(32) == [2, 16, 29]
    assert bench_scale.fused_layers(4) == [1, 2, 3]
    with pytest.raises(ValueError, match="at least 4"):
        bench_scale.fused_layers(3)


def test_tiny_run_measures_every_path(tmp_path) -> None:
    # At this size fixed costs (a shard's fsync, a scheduler hiccup on a loaded machine) swing each timing
    # many-fold, so the ratios are checked against the rates they come from, not against a range.
    argv = ["--shape", "tiny", "--layers", "5", "--device", "cpu", "--dtype", "fp32", "--out", str(tmp_path)]
    argv += ["--seq-len", "32", "--capture-samples", "2", "--draft-vocab", "256", "--ttt-steps", "2"]
    argv += ["--head-steps", "1", "--kv-length", "16", "--max-nodes", "8", "--repeats", "2"]
    result = bench_scale.main([*argv, "--compare-generate", "4"])

    assert json.loads((tmp_path / "bench_scale.json").read_text()) == result
    target = result["target"]
    assert (target["hidden_size"], target["num_hidden_layers"], target["num_attention_heads"]) == (64, 5, 4)
    assert (target["num_key_value_heads"], target["vocab_size"]) == (2, 512)

    cap = result["capture"]
    assert cap["tokens"] == 2 * 32 and cap["aux_layers"] == [1, 2, 4]
    assert cap["capture_vs_forward"] == pytest.approx(cap["capture_tokens_per_s"] / cap["forward_tokens_per_s"])
    assert cap["capture_vs_decoder"] == pytest.approx(cap["capture_tokens_per_s"] / cap["decoder_tokens_per_s"])

    assert set(result["heads"]) == {"eagle3", "dflash"}
    assert result["heads"]["eagle3"]["ttt_steps"] == 2
    for head in result["heads"].values():
        assert head["draft_vocab_size"] == 256 and head["batch"] == [1, 32] and head["trained_parameters"] > 0

    verify = result["verify"]
    assert verify["nodes"] == [0, 1, 2, 3, 4, 6, 8] and verify["kv_length"] == 16
    assert verify["relative"][0] == 1.0 and len(verify["ms"]) == len(verify["relative"]) == 7
    assert verify["relative"] == pytest.approx([ms / verify["ms"][0] for ms in verify["ms"]])

    generate = result["generate"]
    assert generate["new_tokens"] == 4
    assert generate["ours_vs_hf"] == pytest.approx(generate["ours_tokens_per_s"] / generate["hf_generate_tokens_per_s"])

    measured = [cap[f"{side}_tokens_per_s"] for side in ("forward", "decoder", "capture")] + [cap["peak_memory_mb"]]
    measured += [head[key] for head in result["heads"].values() for key in ("tokens_per_s", "peak_memory_mb")]
    measured += verify["ms"] + [cap["capture_vs_forward"], cap["capture_vs_decoder"], generate["ours_vs_hf"]]
    measured += [generate["ours_tokens_per_s"], generate["hf_generate_tokens_per_s"]]
    assert all(math.isfinite(n) and n > 0 for n in measured)
    report = (tmp_path / "bench_scale.md").read_text()
    assert "capture / forward" in report and "eagle3" in report and "dflash" in report and "HF generate" in report


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--head-steps", "0"], "--head-steps must be >= 1, got 0"),
        (["--kv-length", "-1"], "--kv-length must be >= 1, got -1"),
        (["--head-batch", "4", "--capture-samples", "2"], "--head-batch 4 needs as many samples"),
    ],
)
def test_flags_that_would_divide_by_zero_are_refused_by_name(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench_scale.parse_args(["--out", "unused", *flags])
    assert message in capsys.readouterr().err
