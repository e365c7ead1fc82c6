"""An output folder nothing can be written to is refused by name before the work it would lose (exit 2).

Each command checks its outputs (eval's and autotune's ``--out``, autotune's head folder with ``--write-head``,
export's ``--out``, training's ``train.out_dir``) before any model loads: found after a whole evaluation, a
read-only ``--out`` cost every measurement. The folder is made unwritable the way ``core.io.check_writable`` reads
it (``os.access`` denies writing it), so the tests hold for root, who ignores permission bits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from headstart.core.config_files import load_config, run_command
from headstart.core.io import NotWritableError
from headstart.eval import acceptance, autotune
from headstart.scripts.export import command as export
from headstart.train import loop
from headstart.train.train_config import resolve_config

DEMO_TARGET = "assets/demo-target"
BENCH = "assets/data/gsm8k_test.jsonl"


@pytest.fixture
def unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder this process may not write (as a read-only mount or an immutable folder reads to ``os.access``)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    access = os.access

    def denied(path: os.PathLike | str, mode: int, **kwargs: object) -> bool:
        if Path(path) == folder and mode & os.W_OK:
            return False
        return access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", denied)
    return folder


def no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command started its work before checking its output folder")


def test_eval_refuses_an_unwritable_out_before_loading(unwritable, monkeypatch):
    monkeypatch.setattr(acceptance, "load", no_work)
    argv = ["--target", DEMO_TARGET, "--method", "vanilla", "--bench", BENCH, "--limit", "1", "--out", str(unwritable)]
    with pytest.raises(NotWritableError, match=f"{unwritable} is not writable by this process"):
        acceptance.main(argv)


def test_autotune_refuses_an_unwritable_out_before_loading(unwritable, monkeypatch):
    monkeypatch.setattr(autotune, "start", no_work)
    argv = ["--target", DEMO_TARGET, "--draft", "assets/demo-draft", "--out", str(unwritable / "tuned")]
    with pytest.raises(NotWritableError, match=f"{unwritable / 'tuned'} cannot be made: {unwritable} is not writable"):
        autotune.main(argv)


def test_autotune_refuses_an_unwritable_head_folder_to_write_before_loading(unwritable, tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "start", no_work)
    argv = ["--target", DEMO_TARGET, "--head", str(unwritable), "--write-head", "--out", str(tmp_path / "tuned")]
    with pytest.raises(NotWritableError, match=f"{unwritable} is not writable by this process"):
        autotune.main(argv)


def test_export_refuses_an_unwritable_out_before_loading(unwritable, monkeypatch):
    monkeypatch.setattr(export, "export_head", no_work)
    argv = ["--head", "runs/any/head", "--format", "vllm", "--out", str(unwritable)]
    with pytest.raises(NotWritableError, match=f"{unwritable} is not writable by this process"):
        export.main(argv)


def test_training_refuses_an_unwritable_out_dir_before_starting(unwritable, monkeypatch):
    monkeypatch.setattr(loop, "init_distributed", no_work)
    cfg = resolve_config(load_config("configs/demo-eagle3.yaml", [f"train.out_dir={unwritable}"]), "eagle")
    with pytest.raises(NotWritableError, match=f"{unwritable} is not writable by this process"):
        loop.start_processes(cfg)


def test_an_unwritable_output_ends_a_command_with_its_message_and_exit_code_2(unwritable, monkeypatch, capsys):
    monkeypatch.setattr(acceptance, "load", no_work)
    argv = ["--target", DEMO_TARGET, "--method", "vanilla", "--bench", BENCH, "--out", str(unwritable)]
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: acceptance.main(argv), "python -m eval.acceptance")
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"python -m eval.acceptance: [Errno 13] {unwritable} is not writable")
