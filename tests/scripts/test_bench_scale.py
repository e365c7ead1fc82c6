"""scripts/bench/scale.py: the real shapes it builds, one whole run at a tiny shape (seconds, seeded), and the
borrowed-tensor load from a checkpoint whose decoder cannot be read."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from headstart.core.models import load_target
from headstart.core.weights import INDEX_NAME
from headstart.scripts.bench import scale as bench_scale
from headstart.scripts.bench import scale_borrowed as bench_scale_borrowed
from headstart.scripts.bench import scale_capture_tp as bench_scale_capture_tp
from headstart.scripts.bench import scale_shapes as bench_scale_shapes


@pytest.mark.parametrize(
    ("shape", "parameters"),
    # The published parameter counts (the models' hub cards: Llama-3.2-1B ties its embeddings).
    [
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.3-70b", 70_553_706_496),
        ("qwen3-8b", 8_190_735_360),
        ("llama-3.2-1b", 1_235_814_400),
    ],
)
def test_real_shapes_have_the_published_parameter_count(shape: str, parameters: int) -> None:
    # On the meta device: the shapes without the memory.
    model = bench_scale_shapes.build_target(shape, None, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model.dtype == torch.bfloat16 and not any(p.requires_grad for p in model.parameters())
    reduced = bench_scale_shapes.build_target(shape, 4, torch.device("meta"), torch.bfloat16)
    assert reduced.config.num_hidden_layers == 4 and reduced.config.hidden_size == model.config.hidden_size


def test_fused_layers_are_eagle3_defaults_or_three_spread_ones() -> None:
    assert bench_scale_shapes.fused_layers(32) == [2, 16, 29]
    assert bench_scale_shapes.fused_layers(4) == [1, 2, 3]
    with pytest.raises(ValueError, match="at least 4"):
        bench_scale_shapes.fused_layers(3)


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
        (["--stages", "generate"], "stage generate needs --compare-generate N"),
        (["--stages", "borrowed,nope"], "['nope']: expected comma-separated names of"),
        (["--capture-tp", "1,0"], "expected comma-separated integers >= 1"),
    ],
)
def test_flags_that_would_divide_by_zero_are_refused_by_name(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench_scale.parse_args(["--out", "unused", *flags])
    assert message in capsys.readouterr().err


def test_the_stages_default_to_the_target_ones_plus_those_flagged() -> None:
    assert bench_scale.parse_args(["--out", "o"]).stages == ["capture", "heads", "verify"]
    flagged = bench_scale.parse_args(["--out", "o", "--borrowed-shapes", "tiny", "--capture-tp", "1,2"])
    assert flagged.stages == ["capture", "heads", "verify", "borrowed", "capture-tp"]
    alone = bench_scale.parse_args(["--out", "o", "--stages", "borrowed,capture-tp"])
    assert alone.borrowed_shapes == ["llama-3.1-8b", "llama-3.3-70b"] and alone.capture_tp == [1, 2]


@pytest.mark.parametrize(
    "line",
    ["capture: wrote r/manifest.json (1,234 tokens/s this run)", "capture: wrote r/m.json (1,234 tokens/s on rank 0"],
)
def test_the_capture_rate_is_read_from_what_capture_prints(line: str) -> None:
    assert bench_scale_capture_tp.CAPTURE_RATE.search(f"other\n{line}\nmore").group(1) == "1,234"


TINY_BORROWED = (2 * 512 * 64 + 64) * 2  # embedding and lm_head 512 x 64, final norm 64, in bf16


def test_the_borrowed_checkpoint_has_only_the_borrowed_tensors(tmp_path) -> None:
    config = bench_scale_shapes.shape_config("tiny")
    written = bench_scale_borrowed.write_borrowed_checkpoint(tmp_path / "ckpt", config, seed=0)
    assert written["index_tensors"] == 3 + 4 * 9  # the borrowed three, 9 tensors per decoder layer
    assert (written["decoder_files_missing"], written["decoder_files_garbage"]) == (2, 2)
    assert json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())["weight_map"]["model.norm.weight"]
    with pytest.raises(Exception):  # noqa: B017 - a missing file or a garbage header: whichever it meets first
        AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    model, _ = load_target(str(tmp_path / "ckpt"), "cpu", "bf16", borrowed_only=True)
    assert model.lm_head.weight.dtype == torch.bfloat16 and 0 < model.lm_head.weight.float().std() < 0.1
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # two draws, not one table


def test_borrowed_load_peak_does_not_grow_with_depth(tmp_path) -> None:
    # Two fresh processes (a few seconds each): the tiny shape at its 4 layers and at 2.
    result = bench_scale_borrowed.measure_borrowed(["tiny"], 2, tmp_path, seed=0)
    entry = result["shapes"]["tiny"]
    published, shallow = entry["published"], entry["shallow"]
    assert (published["layers"], shallow["layers"]) == (4, 2)
    for run in (published, shallow):
        assert run["borrowed_bytes"] == run["memory_estimate_bytes"] == TINY_BORROWED
        assert run["borrowed_dtype"] == "torch.bfloat16" and run["parameters_loaded"] * 2 == TINY_BORROWED
        assert run["parameters_on_meta"] == run["parameters"] - run["parameters_loaded"] > 0
        assert run["whole_target_bytes"] == run["parameters"] * 2
        assert 0 < run["imports_rss_mb"] <= run["peak_rss_after_load_mb"] <= run["peak_rss_mb"]
    assert published["parameters"] > shallow["parameters"]
    # The same tensors, the same fingerprint inputs but for the config and inventory: the peak stays put.
    assert published["peak_rss_mb"] == pytest.approx(shallow["peak_rss_mb"], rel=0.05)
    assert entry["peak_published_vs_shallow"] == pytest.approx(published["peak_rss_mb"] / shallow["peak_rss_mb"])
    assert published["weights_hash"] != shallow["weights_hash"]  # another config and tensor inventory
    assert not list(tmp_path.iterdir())  # the checkpoints are gone
