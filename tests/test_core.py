import os

import pytest
import torch

from core.config import ConfigError, apply_overrides, load_config, save_config
from core.io import atomic_dir, atomic_path, atomic_write_text
from core.runtime import resolve_device, resolve_dtype


def test_overrides_parse_yaml_values_and_create_sections():
    cfg = apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=[1, 2]", "new.deep.key=true", "s=hello"])
    assert cfg == {"a": {"b": 2.5, "c": [1, 2]}, "new": {"deep": {"key": True}}, "s": "hello"}


def test_override_errors_name_the_problem():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a' is a value"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_load_config_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    save_config({"lr": 0.001, "head": {"type": "eagle3"}}, path)
    assert load_config(path, ["head.type=medusa"]) == {"lr": 0.001, "head": {"type": "medusa"}}
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_atomic_path_keeps_old_file_when_writer_fails(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "complete")
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "complete"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_atomic_dir_replaces_whole_directory(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("killed")
    assert sorted(os.listdir(out)) == ["a"]
    with atomic_dir(out) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(os.listdir(out)) == ["c"]
    assert os.listdir(tmp_path) == ["model"]


def test_runtime_resolution():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")
