"""Issue #40, configs and commands: duplicate keys, alias bombs and oversized files refused by the loader, bad
overrides and devices named, torchrun's variables checked, errors that quote at most a clipped value, and an
export never replacing a trained head."""

import subprocess
import sys
import time

import pytest
import torch

from headstart.core.config_files import MAX_CONFIG_BYTES, QUOTE_CHARS, ConfigError, apply_overrides, load_config
from headstart.core.memory import device_memory
from headstart.core.settings import parse
from headstart.data_recipes.regenerate import RegenerateConfig
from headstart.data_recipes.settings import CaptureConfig
from headstart.scripts.export.command import export_head
from headstart.train.train_config import TrainConfig
from tests.helpers import REPO, base_config, make_head, subprocess_env


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_key_given_twice_is_refused_naming_file_and_lines(tmp_path):
    # YAML keeps the last one: the first train: section's settings (or the first lr) would be dropped silently.
    two_sections = write(tmp_path, "train:\n  lr: 0.1\n  seed: 3\ntrain:\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: line 4: key 'train' is given twice .*first on line 1"):
        load_config(two_sections)
    two_keys = write(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n", "lr.yaml")
    with pytest.raises(ConfigError, match=r"lr\.yaml: line 3: key 'lr' is given twice .*first on line 2"):
        load_config(two_keys)


def test_an_alias_bomb_and_an_oversized_config_are_refused_at_once(tmp_path):
    names = ["a", *(f"l{i}" for i in range(8))]  # each level 10 aliases of the one before: 10^9 values expanded
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{name}: &{name} [{', '.join([f'*{below}'] * 10)}]" for below, name in zip(names, names[1:])]
    bomb = write(tmp_path, "\n".join(levels) + "\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"aliases expand to more than 100,000 values") as caught:
        load_config(bomb)
    assert time.perf_counter() - start < 5 and len(str(caught.value)) < 300
    big = write(tmp_path, "a: " + "x" * (MAX_CONFIG_BYTES + 1) + "\n", "big.yaml")
    with pytest.raises(ConfigError, match=r"big\.yaml: 1,000,005 bytes, more than a config's 1,000,000: refused"):
        load_config(big)


def test_a_malformed_override_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'data\.source=\[a, b': not valid YAML"):
        apply_overrides({}, ["data.source=[a, b"])


def test_errors_quote_a_clipped_value():
    config = {"target": {"path": "t", "dtype": "x" * 10_000}, "data": {"source": "s", "format": "gsm8k"}}
    with pytest.raises(ConfigError) as caught:
        parse(config, CaptureConfig)
    assert "characters)" in str(caught.value) and len(str(caught.value)) < 2 * QUOTE_CHARS + 400


@pytest.mark.parametrize("device", ["tpu", "banana", "cuda:x"])
def test_a_device_torch_would_refuse_late_fails_the_config_check(device):
    config = {"target": {"path": "t", "device": device}, "data": {"source": "s", "format": "gsm8k"}}
    with pytest.raises(ConfigError, match=rf"target\.device must be auto, cpu, cuda or cuda:N, got '{device}'"):
        parse(config, CaptureConfig)


def test_torchruns_variables_are_checked(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")  # divided by before
    with pytest.raises(ValueError, match=r"environment variable LOCAL_WORLD_SIZE='0': must be an integer >= 1"):
        device_memory(torch.device("cpu"))


def test_export_never_replaces_a_trained_head(demo_target, tmp_path):
    # Training writes head/README.md: a trained head folder looked like an earlier export and was replaced.
    model, _ = demo_target
    source = make_head(model, tmp_path, "eagle3", "a")
    other = make_head(model, tmp_path, "eagle3", "b")
    (other / "README.md").write_text("# a trained head's card\n")
    before = (other / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"--out .*b exists and holds .*pass --overwrite"):
        export_head(source, "vllm", other)
    assert (other / "model.safetensors").read_bytes() == before
    again = export_head(source, "vllm", tmp_path / "export")  # an earlier export is still replaced by a new one
    assert export_head(source, "vllm", again) == again


@pytest.mark.parametrize(
    "command, prog",
    [
        (["train/eagle.py"], "torchrun train/eagle.py"),
        (["-m", "data_recipes.regenerate"], "python -m data_recipes.regenerate"),
    ],
)
def test_the_entry_points_the_docs_lead_with_refuse_without_a_traceback(command, prog, tmp_path):
    # As `headstart VERB` does: the message alone on stderr, exit code 2 (they printed a traceback, exit 1).
    config = write(tmp_path, "train:\n  lr: 0.1\ntrain:\n  lr: 0.2\n")
    done = subprocess.run(
        [sys.executable, *command, "--config", str(config)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith(f"{prog}: {config}: line 3: key 'train' is given twice")


@pytest.mark.parametrize(
    "schema, section, key",
    [(CaptureConfig, "capture", "out_dir"), (TrainConfig, "train", "out_dir"), (RegenerateConfig, "regenerate", "out")],
)
def test_an_empty_output_folder_is_refused_by_name(schema, section, key):
    # An unset shell variable (`train.out_dir=$OUT`) would write into the folder the command runs in: training there
    # overwrote the user's config.yaml and head/, regeneration took the working folder for a finished dataset.
    config = {"target": {"path": "t"}, "data": {"source": "s", "format": "gsm8k"}, section: {key: ""}}
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must name a folder, got ''"):
        parse(config, schema)


def test_capture_refuses_samples_past_the_targets_positions(tiny_target_dir, gsm8k_file, tmp_path):
    # A 3,000-token sample on a 1,024-position target was captured (exit 0) where eval refuses the same.
    from transformers import AutoConfig

    from headstart.data_recipes.capture import run_capture

    positions = AutoConfig.from_pretrained(tiny_target_dir).max_position_embeddings
    cfg = base_config(tiny_target_dir, gsm8k_file, tmp_path / "shards", tmp_path, "eagle3")
    cfg["data"]["max_length"] = positions + 1
    with pytest.raises(ConfigError, match=rf"data\.max_length {positions + 1} is past the {positions} positions"):
        run_capture(cfg)
    assert not (tmp_path / "shards").exists()
