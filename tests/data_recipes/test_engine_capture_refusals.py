"""Issue #40 items 1, 2 and 13: capture through a vLLM server, against a server that names files it should not,
answers states that do not fit the request, or is not the one configured; and misaligned shards.

A fake server (a thread here, no vLLM) answers ``GET /v1/models`` and ``POST /v1/completions`` as vLLM with the
hidden-states connector does: each answer names a file it wrote (``kv_transfer_params.hidden_states_path``).
Every file a test makes lies under ``tmp_path``; every wait is bounded (``join(timeout)``, ``timeout_s``).
"""

import json
import os
import re
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from headstart.core.config_files import ConfigError
from headstart.core.settings import as_dict, parse
from headstart.data_recipes import shards
from headstart.data_recipes.capture import capture_shard, run_capture
from headstart.data_recipes.engine_capture import EngineStates
from headstart.data_recipes.engine_client import ChatServer, EngineError
from headstart.data_recipes.recipes import Sample
from headstart.data_recipes.settings import CaptureConfig
from headstart.data_recipes.shards import ShardDataset, StatesError, write_manifest, write_shard
from tests.helpers import JsonHandler

H, AUX = 8, [1]  # the unit tests' hidden size and aux layers: files of [n, 2, 8]
DEAD = "http://127.0.0.1:9/v1"  # never contacted: the unit tests call EngineStates._read directly


def engine(states_dir: Path, timeout_s: float = 5.0) -> EngineStates:
    return EngineStates(ChatServer(DEAD, "m", 1, timeout_s, 0), AUX, torch.nn.LayerNorm(H), states_dir, H)


def states_file(path: Path, ids: list[int], rows: int | None = None, layers: int = 2, hidden: int = H, **over):
    """A connector's file for ``ids``: ``rows`` rows of states (default one per id), seeded values."""
    gen = torch.Generator().manual_seed(len(ids))
    tensors = {
        "hidden_states": torch.randn(len(ids) if rows is None else rows, layers, hidden, generator=gen),
        "token_ids": torch.tensor(ids),
    }
    tensors.update(over)
    save_file({k: v for k, v in tensors.items() if v is not None}, str(path))
    return path


def answer(path) -> dict:
    return {"choices": [{"text": "x", "finish_reason": "length"}], "kv_transfer_params": {"hidden_states_path": path}}


def in_thread(call, seconds: float):
    """``call()``'s result or exception, or the test fails if it has not returned after ``seconds``."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return out


# ---- item 1: what a server names is read and deleted only inside the states folder


def test_a_named_file_outside_the_states_folder_is_neither_read_nor_deleted(tmp_path, monkeypatch):
    states, model = tmp_path / "states", tmp_path / "model"
    states.mkdir(), model.mkdir()
    victim = states_file(model / "model.safetensors", [4, 5, 6])  # what a model's weights file is, to a reader
    monkeypatch.chdir(model)
    os.symlink(victim, states / "link.safetensors")
    (states / "folder.safetensors").mkdir()
    names = {
        str(victim): "not a .safetensors file directly in",
        "model.safetensors": "not a .safetensors file directly in",  # relative: the working folder's
        str(states / ".." / "model" / "model.safetensors"): "not a .safetensors file directly in",
        str(states / "link.safetensors"): "a symbolic link",
        str(states / "folder.safetensors"): "is a folder, not a regular file",
        7: "hidden_states_path is 7, not a file's path",
        str(states / "missing.safetensors"): "but it is not there",
    }
    for name, message in names.items():
        with pytest.raises(EngineError, match=f"{DEAD}: sample 3: .*{message}"):
            engine(states)._read(answer(name), [4, 5, 6], "sample 3")
    with pytest.raises(EngineError, match=r"hidden_states_path is \[1, 2\], not a file's path"):
        engine(states)._read(answer([1, 2]), [4, 5, 6], "sample 3")
    assert victim.is_file() and (states / "link.safetensors").is_symlink() and (states / "folder.safetensors").is_dir()
    assert torch.equal(load_file(str(victim))["token_ids"], torch.tensor([4, 5, 6]))  # untouched


def test_a_fifo_or_a_lock_never_released_ends_within_the_timeout(tmp_path):
    import fcntl

    states = tmp_path / "states"
    states.mkdir()
    os.mkfifo(states / "fifo.safetensors")  # opened for reading, it would wait for a writer forever
    out = in_thread(lambda: engine(states)._read(answer(str(states / "fifo.safetensors")), [1], "sample 0"), 10)
    assert isinstance(out.get("error"), EngineError) and "is a FIFO, not a regular file" in str(out["error"])

    path = states_file(states / "held.safetensors", [1, 2])
    lock = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a server that never lets go
    try:
        out = in_thread(lambda: engine(states, timeout_s=0.5)._read(answer(str(path)), [1, 2], "sample 9"), 10)
    finally:
        os.close(lock)
    assert isinstance(out.get("error"), EngineError), out
    assert "sample 9: the server still holds" in str(out["error"]) and "after 0.5 s (capture.timeout_s)" in str(
        out["error"]
    )
    assert path.is_file()  # not read, not deleted


def test_a_file_that_does_not_fit_the_request_is_named_and_kept(tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    ids = list(range(10, 20))
    sent = r"\(10 token ids sent, 1 aux l"
    cases = {  # file contents -> what the error says
        "rows+3": ({"rows": 13}, r"hidden_states has shape \[13, 2, 8\], the request's is \[10, 2, 8\]"),
        "rows-3": ({"rows": 7}, r"hidden_states has shape \[7, 2, 8\], the request's is \[10, 2, 8\]"),
        "layers": ({"layers": 3}, r"hidden_states has shape \[10, 3, 8\], the request's is \[10, 2, 8\] " + sent),
        "hidden": ({"hidden": 16}, r"hidden_states has shape \[10, 2, 16\].*the target's hidden size 8"),
        "no ids": ({"token_ids": None}, r"the file has no token_ids \(it holds \['hidden_states'\]\)"),
        "no states": ({"hidden_states": None}, r"the file has no hidden_states"),
        "ids": ({"token_ids": torch.tensor([[1]])}, r"token_ids is torch.int64 of shape \[1, 1\], not a list"),
        "int": ({"hidden_states": torch.ones(10, 2, H, dtype=torch.int32)}, r"hidden_states are torch.int32, not f"),
        "nan": ({"hidden_states": torch.zeros(10, 2, H).index_fill_(0, torch.tensor([4]), float("nan"))},
                r"hidden_states hold 16 NaN or infinite values \(the first at token 4, layer 0 of 2\)"),
        "inf": ({"hidden_states": torch.zeros(10, 2, H).index_fill_(1, torch.tensor([1]), float("inf"))},
                r"hidden_states hold 80 NaN or infinite values \(the first at token 0, layer 1 of 2\)"),
    }  # fmt: skip
    for name, (contents, message) in cases.items():
        path = states_file(states / f"{name}.safetensors", ids, **contents)
        with pytest.raises(EngineError, match=f"sample 5: {re.escape(str(path))}: {message}"):
            engine(states)._read(answer(str(path)), ids, "sample 5")
        assert path.is_file()  # kept to be looked at
    good = states_file(states / "good.safetensors", ids)
    open(str(good) + ".lock", "w").close()
    got = engine(states)._read(answer(str(good)), ids, "sample 5")
    assert got["last_hidden"].shape == (10, H) and got["aux_hidden"].shape == (10, H)
    assert not good.exists() and not Path(str(good) + ".lock").exists()  # consumed


# ---- item 2: states that do not fit their samples are never written to a shard


def test_states_that_do_not_fit_their_samples_are_refused_before_a_shard(tmp_path):
    samples = [Sample(list(range(1, n + 1)), [1] * n, f"d.jsonl:{n}") for n in (10, 6)]
    ok = {"last_hidden": torch.ones(10, 4), "aux_hidden": torch.ones(10, 8)}

    def source(first: dict):
        return lambda s, i: [first, {"last_hidden": torch.ones(6, 4), "aux_hidden": torch.ones(6, 8)}]

    nan = torch.ones(10, 4).index_fill_(0, torch.tensor([3]), float("nan"))
    bad = [  # the first sample's states -> what the error says
        ({**ok, "last_hidden": torch.ones(13, 4)}, r"sample 40: last_hidden has shape \[13, 4\], not \[10, 4\]"),
        ({**ok, "aux_hidden": torch.ones(7, 8)}, r"sample 40: aux_hidden has shape \[7, 8\], not \[10, 8\]"),
        ({**ok, "last_hidden": nan}, r"sample 40: last_hidden holds 4 NaN or infinite values, the first at token 3"),
        ({**ok, "aux_hidden": torch.full((10, 8), float("-inf"))}, r"sample 40: aux_hidden holds 80 NaN"),
        ({**ok, "last_hidden": torch.ones(10, 4, dtype=torch.int64)}, r"last_hidden is torch.int64, not a float"),
        (
            {**ok, "last_hidden": torch.full((10, 4), 1e6)},
            r"sample 40: last_hidden stored as torch.float16",
        ),  # overflow
    ]
    for first, message in bad:
        with pytest.raises(StatesError, match=message):
            capture_shard(source(first), samples, [40, 41], 2, torch.float16)
    tensors = capture_shard(source(ok), samples, [40, 41], 2, torch.float16)
    assert tensors["last_hidden"].shape == (16, 4) and tensors["sample_offsets"].tolist() == [0, 10, 16]


def misaligned_capture(out: Path, extra: int) -> Path:
    """A finished capture of two samples (5 and 3 tokens) whose first sample has ``extra`` hidden rows more."""
    out.mkdir()
    ids, mask = torch.arange(8, dtype=torch.int32), torch.ones(8, dtype=torch.uint8)
    tensors = {
        "input_ids": ids,
        "loss_mask": mask,
        "last_hidden": torch.ones(8 + extra, 4),
        "aux_hidden": torch.ones(8 + extra, 8),
        "sample_offsets": torch.tensor([0, 5, 8]),
        "sample_ids": torch.tensor([0, 1]),
    }
    write_shard(out / shards.shard_name(0), tensors, "fp")
    path = out / shards.shard_name(0)
    entry = {"file": path.name, "samples": 2, "tokens": 8, "bytes": path.stat().st_size}
    entry["sha256"] = shards.file_sha256(path)
    settings = {"fingerprint": "fp", "samples": 2, "hidden_size": 4, "aux_layers": [1, 2], "store_dtype": "float32"}
    write_manifest(out, {**settings, "shards": [entry]})
    return out


def test_the_shard_verification_checks_rows_against_the_samples_offsets(tmp_path, capsys):
    for extra in (3, -3):
        out = misaligned_capture(tmp_path / f"extra{extra}", extra)
        with pytest.raises(SystemExit) as exited:
            shards.main([str(out)])
        said = capsys.readouterr().err
        assert exited.value.code == 1 and "all as recorded" not in said
        assert f"last_hidden has shape [{8 + extra}, 4], its 2 samples' offsets make it [8, 4]" in said
        assert f"aux_hidden has shape [{8 + extra}, 8]" in said
        with pytest.raises(shards.ShardError, match="the rows do not line up with the samples"):
            ShardDataset(out)  # what training opens
    shards.main([str(misaligned_capture(tmp_path / "aligned", 0))])
    assert "2 samples in 1 shards, all as recorded" in capsys.readouterr().out


# ---- item 13 and the whole capture against a fake server


def config(target_dir, data_file, tmp_path: Path, **capture) -> dict:
    return {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "gsm8k", "max_length": 64, "limit": 6},
        "capture": {
            "out_dir": str(tmp_path / "out"),
            "aux_layers": [1, 3],
            "store_dtype": "fp32",
            "shard_samples": 3,
            "engine": "vllm",
            "model": "tiny",
            "concurrency": 2,
            "timeout_s": 5,
            "retries": 0,
            **capture,
        },
    }


def test_a_bad_server_url_is_refused_by_its_key_before_any_work(tiny_target_dir, gsm8k_file, tmp_path):
    for url, said in (
        ("file:///etc/passwd", "capture.base_url must be an http(s) URL, the server's API root"),
        ("http://127.0.0.1:99999/v1", "capture.base_url must have a port in 0..65535, got 'http://127.0.0.1:99999/v1'"),
        ("http://user:hunter2@:80/v1", "capture.base_url must be an http(s) URL, the server's API root (http://localho"),
    ):  # fmt: skip
        cfg = config(tiny_target_dir, gsm8k_file, tmp_path, base_url=url, states_dir=str(tmp_path))
        with pytest.raises(ConfigError) as refused:
            run_capture(cfg)
        assert said in str(refused.value) and "hunter2" not in str(refused.value)
        assert not (tmp_path / "out").exists()
    secret = "http://user:hunter2@127.0.0.1:8000/v1"
    parsed = parse(config(tiny_target_dir, gsm8k_file, tmp_path, base_url=secret, states_dir="s"), CaptureConfig)
    assert parsed.capture.base_url == secret  # used as given; recorded without the password
    assert as_dict(parsed)["capture"]["base_url"] == "http://***@127.0.0.1:8000/v1"
    assert "hunter2" not in ChatServer(secret, "m", 1, 1.0, 0).base_url
    with pytest.raises(ConfigError, match="capture.states_dir is required with base_url"):
        parse(config(tiny_target_dir, gsm8k_file, tmp_path, base_url="http://127.0.0.1:8000/v1"), CaptureConfig)


@pytest.mark.parametrize("states", ["out", "out/states", "."])
def test_a_states_dir_that_is_or_holds_or_sits_in_out_dir_is_refused(tiny_target_dir, gsm8k_file, tmp_path, states):
    """The capture deletes the server's files in states_dir: never in the folder its shards are written to."""
    url = "http://127.0.0.1:8000/v1"
    cfg = config(tiny_target_dir, gsm8k_file, tmp_path, base_url=url, states_dir=str(tmp_path / states))
    with pytest.raises(
        ConfigError, match="capture.states_dir .* and out_dir .* are one folder or one inside the other"
    ):
        parse(cfg, CaptureConfig)
    parse(
        config(tiny_target_dir, gsm8k_file, tmp_path, base_url=url, states_dir=str(tmp_path / "states")), CaptureConfig
    )


def test_an_engines_venv_without_vllm_is_refused_before_any_work(tiny_target_dir, gsm8k_file, tmp_path):
    missing = config(tiny_target_dir, gsm8k_file, tmp_path, engine_python=str(tmp_path / "no" / "python"))
    with pytest.raises(FileNotFoundError, match=f"capture.engine_python: no engines-venv interpreter {tmp_path}"):
        run_capture(missing)
    without = config(tiny_target_dir, gsm8k_file, tmp_path, engine_python=sys.executable)  # this venv: no vllm
    with pytest.raises(RuntimeError, match=f"capture.engine_python: {sys.executable} has no vllm installed"):
        run_capture(without)
    assert not (tmp_path / "out").exists()


class FakeVLLM(JsonHandler):
    """``GET /v1/models`` serves ``server.served``; each completion writes ``server.write(path, ids)`` into
    ``server.states`` and names it, or names ``server.name`` when that is set."""

    def do_GET(self):
        self.answer(200, {"data": [{"id": self.server.served}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.count_lock:
            self.server.count += 1
            path = self.server.states / f"cmpl-{self.server.count}.safetensors"
        self.server.write(path, body["prompt"])
        open(str(path) + ".lock", "w").close()
        self.answer(200, answer(self.server.name or str(path)))


@pytest.fixture
def fake_vllm(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    server.states = tmp_path / "states"
    server.states.mkdir()
    server.served, server.name, server.count, server.count_lock = "tiny", None, 0, threading.Lock()
    server.write = lambda path, ids: states_file(path, ids, layers=3, hidden=32)  # tiny target: 2 aux + last
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join(10)
    server.server_close()


def served_config(server, target_dir, data_file, tmp_path, userinfo: str = "") -> dict:
    url = f"http://{userinfo}127.0.0.1:{server.server_address[1]}/v1"
    return config(target_dir, data_file, tmp_path, base_url=url, states_dir=str(server.states))


def test_a_capture_through_a_server_checks_its_model_and_records_no_password(
    fake_vllm, tiny_target_dir, gsm8k_file, tmp_path
):
    fake_vllm.served = "another-model"
    with pytest.raises(EngineError, match=r"serves \['another-model'\], not 'tiny'"):
        run_capture(served_config(fake_vllm, tiny_target_dir, gsm8k_file, tmp_path))
    assert not (tmp_path / "out").exists() and fake_vllm.count == 0  # asked before any work

    fake_vllm.served = "tiny"
    out = run_capture(served_config(fake_vllm, tiny_target_dir, gsm8k_file, tmp_path, "user:hunter2@"))
    saved = (out / "capture_config.yaml").read_text()
    assert "hunter2" not in saved and yaml.safe_load(saved)["capture"]["base_url"].startswith("http://***@127.0.0.1:")
    assert len(shards.verify_capture(out)) == 6 and fake_vllm.count == 6
    assert not list(fake_vllm.states.iterdir())  # every file read and removed, locks too


def test_a_server_answering_misaligned_states_or_foreign_files_writes_no_shard(
    fake_vllm, tiny_target_dir, gsm8k_file, tmp_path
):
    from headstart.data_recipes.states import EngineCapture

    cfg = served_config(fake_vllm, tiny_target_dir, gsm8k_file, tmp_path)
    fake_vllm.write = lambda path, ids: states_file(path, ids, rows=len(ids) + 3, layers=3, hidden=32)
    with pytest.raises(EngineError, match=r"sample \d+: .*hidden_states has shape \[(\d+), 3, 32\]"):
        run_capture(cfg)
    assert not list((tmp_path / "out").glob("shard-*"))

    victim = states_file(tmp_path / "model.safetensors", [1, 2, 3])  # a model's file, as the server names it
    fake_vllm.name = str(victim)
    with pytest.raises(EngineError, match="is not a .safetensors file directly in"):
        run_capture(cfg)
    parsed = parse(cfg, CaptureConfig)
    online = EngineCapture(parsed.target, parsed.capture, 64, [1, 3], torch.float32, tmp_path / "train")
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3), "sample_id": torch.tensor([0])}
    with online, pytest.raises(EngineError, match="sample 0: the server named .*model.safetensors"):
        online.states(batch)  # train.online_capture: vllm reads through the same check
    assert victim.is_file() and not list((tmp_path / "out").glob("shard-*"))
