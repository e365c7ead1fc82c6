"""Hidden-state capture: equal to a fresh forward, resumable after SIGKILL, shards read back lazily."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.core.fingerprint import tokenizer_hash
from headstart.core.io import OutOfSpaceError
from headstart.core.models import default_aux_layers
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.capture_plan import check_free_disk, storage_estimate
from headstart.data_recipes.recipes import load_samples
from headstart.data_recipes.shards import (
    ManifestMismatch,
    ShardDataset,
    check_manifest,
    dequantize_fp8,
    pad_collate,
    quantize_fp8,
    read_manifest,
)
from headstart.data_recipes.states import OnlineCapture, length_batches, resolve_aux_layers
from tests.helpers import REPO, children


def capture_config(target_dir, data_file, out_dir, **capture):
    return {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "gsm8k", "max_length": 64},
        "capture": {
            "out_dir": str(out_dir),
            "aux_layers": [1, 3, 4],
            "store_dtype": "fp32",
            "shard_samples": 8,
            "batch_tokens": 256,
            **capture,
        },
    }


@pytest.fixture(scope="module")
def captured(tiny_target_dir, gsm8k_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture") / "shards"
    run_capture(capture_config(tiny_target_dir, gsm8k_file, out))
    return out


def test_default_layers_follow_eagle3_and_refuse_collisions():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(10) == [2, 5, 7]
    with pytest.raises(ValueError, match="too few"):
        default_aux_layers(4)
    assert resolve_aux_layers([7, 2, 2], 10) == [2, 7]
    with pytest.raises(ValueError, match=r"out of range.*0\.\.9"):
        resolve_aux_layers([10], 10)


def test_length_batches_respect_token_budget():
    assert length_batches([10, 8, 8, 5, 5, 5, 2], 20) == [[0, 1], [2, 3], [4, 5, 6]]
    assert length_batches([50, 3], 20) == [[0], [1]]


@torch.no_grad()
def test_captured_states_equal_a_fresh_forward(captured, tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    dataset = ShardDataset(captured)
    assert len(dataset) == 48 and sorted(int(dataset[i]["sample_id"]) for i in range(48)) == list(range(48))
    for index in [0, 17, 47]:
        sample = dataset[index]
        fresh = model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
        expected_aux = torch.cat([fresh[i][0] for i in (1, 3, 4)], dim=-1)
        # Batched (padded) capture vs a lone forward: same math, different BLAS blocking.
        torch.testing.assert_close(sample["aux_hidden"], expected_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sample["last_hidden"], fresh[-1][0], atol=1e-5, rtol=1e-4)
        assert sample["loss_mask"].sum() > 0 and sample["loss_mask"][0] == 0


def test_manifest_describes_the_capture(captured, tiny_target_dir):
    manifest = read_manifest(captured)
    assert manifest["samples"] == 48 and manifest["aux_layers"] == [1, 3, 4]
    assert manifest["hidden_size"] == 32 and manifest["num_hidden_layers"] == 6
    assert len(manifest["shards"]) == 6 and sum(s["samples"] for s in manifest["shards"]) == 48
    assert manifest["bytes"] == sum((captured / s["file"]).stat().st_size for s in manifest["shards"])
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    check_manifest(
        manifest, hidden_size=32, num_hidden_layers=6, tokenizer_hash=tokenizer_hash(tok), aux_layers=[4, 1, 3]
    )
    with pytest.raises(ManifestMismatch, match="hidden size 32 in the shards, 64 in the target"):
        check_manifest(manifest, hidden_size=64, num_hidden_layers=6, tokenizer_hash=tokenizer_hash(tok))
    with pytest.raises(ManifestMismatch, match="tokenizer differs"):
        check_manifest(manifest, hidden_size=32, num_hidden_layers=6, tokenizer_hash="x")
    with pytest.raises(ManifestMismatch, match=r"captured layers \[1, 3, 4\], the head needs \[2, 5, 7\]"):
        check_manifest(
            manifest, hidden_size=32, num_hidden_layers=6, tokenizer_hash=tokenizer_hash(tok), aux_layers=[2, 5, 7]
        )


def test_rerun_is_a_no_op_and_other_settings_are_refused(captured, tiny_target_dir, gsm8k_file, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in captured.iterdir()}
    run_capture(capture_config(tiny_target_dir, gsm8k_file, captured))
    assert "nothing to do" in capsys.readouterr().out
    assert before == {p.name: p.stat().st_mtime_ns for p in captured.iterdir()}
    with pytest.raises(FileExistsError, match="captured with other settings"):
        run_capture(capture_config(tiny_target_dir, gsm8k_file, captured, aux_layers=[2, 3, 4]))


@torch.no_grad()
def test_online_capture_yields_the_stored_tensors(captured, tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    dataset = ShardDataset(captured)
    batch = pad_collate([dataset[i] for i in (3, 20, 40)], pad_id=3)
    online = OnlineCapture(model, [1, 3, 4], torch.float32)(
        {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    )
    for key in ("aux_hidden", "last_hidden"):
        torch.testing.assert_close(online[key], batch[key], atol=1e-5, rtol=1e-4)
        assert online[key].dtype == batch[key].dtype


def test_fp8_keeps_each_token_and_layer_within_e4m3s_rounding():
    torch.manual_seed(0)
    # Two layers of very different scale, and one outlier token: a scale per token and layer keeps all.
    x = torch.randn(64, 2, 48) * torch.tensor([0.05, 40.0])[None, :, None]
    x[7] *= 300
    values, scale = quantize_fp8(x.flatten(-2), groups=2)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (64, 2)
    back = dequantize_fp8(values, scale, torch.float32).unflatten(-1, (2, 48))
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value; below 2^-6 of the row's max it is subnormal
    bound = x.abs() / 16 + scale[..., None] * 2.0**-9
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(dequantize_fp8(values, scale, torch.float32), dequantize_fp8(values, scale, torch.float32))
    one_scale = x.abs().max() / 448  # what a scale per tensor would do to the small layer: mostly zeros
    assert ((x[:, 0] / one_scale).to(torch.float8_e4m3fn).float() == 0).float().mean() > 0.5


@torch.no_grad()
def test_fp8_shards_are_smaller_read_back_close_and_online_capture_matches(tiny_target_dir, gsm8k_file, tmp_path):
    run_capture(capture_config(tiny_target_dir, gsm8k_file, tmp_path / "fp32"))
    run_capture(capture_config(tiny_target_dir, gsm8k_file, tmp_path / "fp8", store_dtype="fp8_e4m3"))
    full, fp8 = read_manifest(tmp_path / "fp32"), read_manifest(tmp_path / "fp8")
    assert fp8["store_dtype"] == "float8_e4m3fn"
    states = full["tokens"] * 32 * 4  # hidden 32 x (3 aux layers + last)
    assert full["bytes"] - fp8["bytes"] >= states * 4 - states * 1 - full["tokens"] * 4 * 4 - 4096
    assert abs(fp8["bytes"] - storage_estimate(fp8["tokens"], 32, 3, torch.float8_e4m3fn)) < 2048 * len(fp8["shards"])

    exact, stored = ShardDataset(tmp_path / "fp32"), ShardDataset(tmp_path / "fp8")
    for index in (0, 17, 47):
        a, b = exact[index], stored[index]
        assert set(a) == set(b) and b["aux_hidden"].dtype == torch.bfloat16
        for key in ("aux_hidden", "last_hidden"):
            rows = a[key].unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
            error = (b[key].float() - a[key]).unflatten(-1, (-1, 32)).abs()
            assert (error <= a[key].unflatten(-1, (-1, 32)).abs() / 14 + rows * 2.0**-8).all(), key

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    batch = pad_collate([stored[i] for i in (3, 20, 40)], pad_id=3)
    online = OnlineCapture(model, [1, 3, 4], torch.float8_e4m3fn)(
        {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    )
    for key in ("aux_hidden", "last_hidden"):
        assert online[key].dtype == batch[key].dtype == torch.bfloat16
        # The same quantization of the same states: equal up to the forward's padded-batch blocking.
        assert (online[key].float() - batch[key].float()).abs().max() <= batch[key].float().abs().max() / 8


def test_storage_check_refuses_and_names_the_shortfall(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(OutOfSpaceError, match=r"needs .* GB more in .* but only .* GB is free"):
        check_free_disk(tmp_path, free + 10**9)
    check_free_disk(tmp_path / "not" / "yet" / "made", 1)


def reference_capture(target_dir, tmp_path, limit):
    """A one-process capture of ``limit`` real GSM8K rows in shards of 4 (enough shards for a kill to land
    mid-run) under ``tmp_path/reference``; returns its file names and the same config for ``tmp_path/shards``."""
    data = REPO / "assets/data/gsm8k_train.jsonl"
    settings = capture_config(target_dir, data, tmp_path / "reference", shard_samples=4)
    settings["data"].update(limit=limit, max_length=160)
    run_capture(settings)
    names = sorted(p.name for p in (tmp_path / "reference").glob("*.safetensors")) + ["manifest.json"]
    settings["capture"]["out_dir"] = str(tmp_path / "shards")
    config = tmp_path / "capture.yaml"
    config.write_text(json.dumps(settings))
    return names, config


def assert_same_capture(out, reference, names):
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"


def test_sigkilled_capture_resumes_to_identical_shards(tiny_target_dir, tmp_path):
    names, config = reference_capture(tiny_target_dir, tmp_path, limit=200)
    assert len(names) == 51
    out = tmp_path / "shards"
    cmd = [sys.executable, "-m", "data_recipes.capture", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("shard-*.safetensors")) and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = list(out.glob("shard-*.safetensors"))
    assert 0 < len(written) < 50 and not (out / "manifest.json").exists()
    resumed = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    assert f"({len(written)} already complete, resuming)" in resumed.stdout
    assert_same_capture(out, tmp_path / "reference", names)


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """The worker processes under a torchrun launcher: {RANK: pid}, read from each process's environment."""
    ranks = {}
    for pid in children(launcher_pid):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[int(rank)] = pid
    return ranks


def test_two_processes_capture_the_one_process_shards_and_resume_after_a_rank_is_killed(tiny_target_dir, tmp_path):
    names, config = reference_capture(tiny_target_dir, tmp_path, limit=120)
    assert len(names) == 31
    out = tmp_path / "shards"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, "-m", "data_recipes.capture", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(ranks_written := {int(p.name[6:11]) % 2 for p in out.glob("shard-*.safetensors")}) < 2:
        assert time.time() < deadline, "no shard from each rank within 120 s"
        time.sleep(0.005)
    os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)  # one rank dies; torchrun stops the other
    assert proc.wait(timeout=60) != 0
    written = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert 0 < len(written) < 30 and not (out / "manifest.json").exists()
    assert ranks_written == {0, 1}  # both ranks wrote their own shards

    resumed = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    assert f"({len(written)} already complete, resuming), 2 processes" in resumed.stdout
    assert_same_capture(out, tmp_path / "reference", names)


def test_shard_dataset_needs_a_finished_capture(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished capture"):
        ShardDataset(tmp_path)


def test_recipe_samples_feed_capture(tiny_target_dir, gsm8k_file):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    samples, report = load_samples(str(gsm8k_file), "gsm8k", tok, 64)
    assert report.kept == len(samples) == 48


FORMAT_RECORDS = {
    "sharegpt": {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "2+2 = 4"}]},
    "messages": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "3+4?"},
            {"role": "assistant", "content": "3+4 = 7\n#### 7"},
        ]
    },
    "alpaca": {"instruction": "Add the numbers.", "input": "5 and 6", "output": "5+6 = 11"},
    "text": {"text": "Ann has 3 apples. She buys 4 more, so she has 7."},
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_RECORDS))
@torch.no_grad()
def test_each_format_captures_the_fresh_forward(fmt, tiny_target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(FORMAT_RECORDS[fmt]) + "\n")
    config = capture_config(tiny_target_dir, data, tmp_path / "shards")
    config["data"]["format"] = fmt
    sample = ShardDataset(run_capture(config))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    fresh = model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(
        sample["aux_hidden"], torch.cat([fresh[i][0] for i in (1, 3, 4)], -1), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(sample["last_hidden"], fresh[-1][0], atol=1e-5, rtol=1e-4)
    assert sample["loss_mask"].all() if fmt == "text" else 0 < sample["loss_mask"].sum() < len(sample["loss_mask"])


def test_a_shard_holds_the_bytes_the_per_sample_copies_wrote(tiny_target_dir, gsm8k_file, tmp_path):
    # capture_shard fills one host buffer per tensor and checks finiteness once per shard: the shard file must be
    # the one the plain recipe writes (each sample's states stored, copied to the host, concatenated).
    from headstart.data_recipes.capture import capture_shard
    from headstart.data_recipes.capture_plan import token_tensors
    from headstart.data_recipes.shards import store_hidden, write_shard
    from headstart.data_recipes.states import forward_states

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    samples, _ = load_samples(str(gsm8k_file), "gsm8k", tokenizer, 64, limit=8)
    states = forward_states(model, [1, 3, 4], 256, tokenizer.pad_token_id)
    for store in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        ids = list(range(len(samples)))
        with torch.no_grad():
            pieces = [store_hidden(one, store, 3) for one in states(samples, ids)]
        plain = token_tensors(samples, ids) | {k: torch.cat([p[k].cpu() for p in pieces]) for k in pieces[0]}
        write_shard(tmp_path / "plain.safetensors", plain, "fp")
        with torch.no_grad():
            write_shard(tmp_path / "now.safetensors", capture_shard(states, samples, ids, 3, store), "fp")
        assert (tmp_path / "now.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes(), store


def test_a_nan_in_a_later_sample_is_named_after_the_shards_one_check():
    from headstart.data_recipes.capture import capture_shard
    from headstart.data_recipes.recipes import Sample
    from headstart.data_recipes.shards import StatesError

    samples = [Sample(list(range(1, n + 1)), [1] * n, f"d.jsonl:{n}") for n in (5, 4, 6)]
    found = [{"last_hidden": torch.ones(n, 4), "aux_hidden": torch.ones(n, 8)} for n in (5, 4, 6)]
    found[2]["aux_hidden"][2, 5] = float("nan")
    message = r"sample 12: aux_hidden holds 1 NaN or infinite values, the first at token 2"
    with pytest.raises(StatesError, match=message):
        capture_shard(lambda s, i: found, samples, [10, 11, 12], 2, torch.float32)
    found[2]["aux_hidden"][2, 5] = 1.0
    tensors = capture_shard(lambda s, i: found, samples, [10, 11, 12], 2, torch.float32)
    assert tensors["aux_hidden"].shape == (15, 8) and tensors["sample_offsets"].tolist() == [0, 5, 9, 15]


def test_write_behind_raises_a_failed_write_at_the_next_put_and_waits_on_exit(tmp_path):
    from headstart.data_recipes.shards import WriteBehind

    written: list[int] = []

    def write(k: int) -> None:
        time.sleep(0.05)  # slower than the caller: the next put must wait for it
        if k == 1:
            raise OSError(28, "No space left on device")
        written.append(k)

    with pytest.raises(OSError, match="No space left"), WriteBehind() as writer:
        for k in range(4):
            writer.put(write, k)
    assert written == [0]  # write 1 failed: put(2) raised it, so nothing after it was queued

    with WriteBehind() as writer:
        writer.put(write, 5)
    assert written == [0, 5]  # the block's end waited for the last write
    with pytest.raises(OSError), WriteBehind() as writer:
        writer.put(write, 1)  # a failed last write is raised at the block's end
