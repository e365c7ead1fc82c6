"""Checkpoints are verified before they are read: digests in COMPLETE, fall-back past a corrupt step, no
unpickling of a file that does not match, and no resume onto other data.

The direct tests build tag folders by hand; the end-to-end ones copy one finished in-process run
(the EAGLE-3 recipe, world of one, checkpoints at steps 3 and 6) and damage the copy.
"""

import errno
import json
import shutil

import pytest
import torch
import yaml
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from headstart.core import io
from headstart.core.io import OutOfSpaceError, out_of_space_named
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.shards import ShardDataset
from headstart.train import eagle, loop
from headstart.train.checkpoint import (
    MARKER,
    CorruptCheckpoint,
    check_optimizer,
    complete_steps,
    file_digests,
    tag_for,
    to_universal,
    verify_checkpoint,
)
from headstart.train.loop import NonFiniteLoss
from tests.helpers import base_config, head_weights, records, run_here, shards_with_a_nan

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # ZeRO-2, rank 0


def complete_tag(tag_dir, files):
    """A tag folder holding ``files`` (name -> bytes) and the COMPLETE marker save_checkpoint writes for them."""
    tag_dir.mkdir(parents=True)
    for name, data in files.items():
        (tag_dir / name).parent.mkdir(exist_ok=True)
        (tag_dir / name).write_bytes(data)
    marker = {"step": 3, "world": 1, "zero_stage": 2, "files": file_digests(tag_dir)}
    (tag_dir / MARKER).write_text(json.dumps(marker))
    return tag_dir


class Plant:
    """Unpickling this creates ``path``: what a crafted checkpoint file could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').close()",)


def plant_pickle(path, sentinel):
    """Replace ``path`` with a torch file whose unpickling creates ``sentinel``."""
    torch.save({"module": Plant(sentinel)}, path)


def test_each_damaged_file_is_named(tmp_path):
    tag = complete_tag(tmp_path / "step-00000003", {"a.pt": b"a" * 100, "b.pt": b"b" * 10, "sub/c.pt": b"c"})
    assert verify_checkpoint(tag)["files"].keys() == {"a.pt", "b.pt", "sub/c.pt"}

    (tag / "a.pt").write_bytes(b"a" * 50)  # truncated
    (tag / "b.pt").unlink()
    (tag / "extra.pt").write_bytes(b"x")  # a file DeepSpeed's globs would pick up
    with pytest.raises(CorruptCheckpoint) as err:
        verify_checkpoint(tag)
    assert str(err.value) == (
        f"{tag / 'b.pt'} is missing; {tag / 'extra.pt'} is not recorded in COMPLETE; "
        f"{tag / 'a.pt'} (50 bytes) does not match its sha256 in COMPLETE (truncated or altered)"
    )


def test_one_flipped_byte_fails_verification(tmp_path):
    tag = complete_tag(tmp_path / "step-00000003", {"optim.pt": bytes(range(256)) * 4})
    data = bytearray((tag / "optim.pt").read_bytes())
    data[700] ^= 0x01
    (tag / "optim.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=r"optim\.pt \(1024 bytes\) does not match its sha256"):
        verify_checkpoint(tag)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("{not json", r"COMPLETE is not JSON"),
        ('{"step": 3, "world": 1, "zero_stage": 2}', r"COMPLETE lacks files \(written before file digests"),
        ("[1, 2]", r"COMPLETE lacks step, world, zero_stage, files"),
        ('{"step": 3, "world": 1, "zero_stage": 2, "files": []}', r"COMPLETE lacks a files table"),
    ],
)
def test_an_unreadable_marker_is_a_named_error(tmp_path, marker, message):
    tag = complete_tag(tmp_path / "step-00000003", {"a.pt": b"a"})
    (tag / MARKER).write_text(marker)
    with pytest.raises(CorruptCheckpoint, match=message):
        verify_checkpoint(tag)


def test_universal_conversion_verifies_before_unpickling(tmp_path):
    files = {MODEL_STATES: b"the weights DeepSpeed wrote", OPTIM_STATES: b"the optimizer state DeepSpeed wrote"}
    tag = complete_tag(tmp_path / "step-00000003", files)
    sentinel = tmp_path / "code-ran"
    for name in files:
        plant_pickle(tag / name, sentinel)
    with pytest.raises(CorruptCheckpoint, match=f"{MODEL_STATES} .* does not match its sha256"):
        to_universal(tag, tmp_path / "universal-step-00000003")
    assert not sentinel.exists(), "the crafted pickle ran"
    assert not (tmp_path / "universal-step-00000003").exists()


SETTINGS = dict(max_steps=6, save_every=3, eval_every=0)


@pytest.fixture(scope="module")
def finished(sharp_target_dir, gsm8k_file, shards, tmp_path_factory):
    """A run of 6 steps with checkpoints at steps 3 and 6 (one thread, in this process): (config, out_dir)."""
    root = tmp_path_factory.mktemp("finished")
    cfg = base_config(sharp_target_dir, gsm8k_file, shards, root / "run", "eagle3", **SETTINGS)
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            run_here(mp, eagle, root / "run.yaml")
    finally:
        torch.set_num_threads(threads)
    assert complete_steps(root / "run" / "checkpoints") == [3, 6]
    return root / "run.yaml", root / "run"


def copy_run(finished, tmp_path):
    config, out = finished
    shutil.copytree(out, tmp_path / "run")
    return config, tmp_path / "run"


def test_a_crafted_pickle_is_refused_before_it_is_unpickled(finished, tmp_path, monkeypatch):
    config, out = copy_run(finished, tmp_path)
    ckpt_dir = out / "checkpoints"
    sentinel = tmp_path / "code-ran"
    plant_pickle(ckpt_dir / tag_for(6) / MODEL_STATES, sentinel)
    (ckpt_dir / tag_for(3) / OPTIM_STATES).write_bytes(b"")  # nothing to fall back to either

    with pytest.raises(CorruptCheckpoint) as err:
        run_here(monkeypatch, eagle, config, f"train.out_dir={out}")
    assert not sentinel.exists(), "the crafted pickle ran"
    message = str(err.value)
    assert message.startswith(f"no checkpoint under {ckpt_dir} verifies, so none was loaded: ")
    assert f"{ckpt_dir / tag_for(6) / MODEL_STATES} (" in message
    assert f"{ckpt_dir / tag_for(3) / OPTIM_STATES} (0 bytes) does not match its sha256" in message
    assert complete_steps(ckpt_dir) == [3, 6]  # left as they were for the user to inspect


def test_a_truncated_file_falls_back_to_the_previous_step(finished, tmp_path, monkeypatch, capsys):
    config, out = copy_run(finished, tmp_path)
    ckpt_dir = out / "checkpoints"
    broken = ckpt_dir / tag_for(6) / MODEL_STATES
    size = broken.stat().st_size
    with broken.open("r+b") as f:
        f.truncate(size // 2)

    run_here(monkeypatch, eagle, config, f"train.out_dir={out}")
    printed = capsys.readouterr().out
    aside = ckpt_dir / f"corrupt-{tag_for(6)}"
    assert f"{broken} ({size // 2} bytes) does not match its sha256 in COMPLETE (truncated or altered): " in printed
    assert f"not loaded, moved to {aside}" in printed
    assert "resumed from step 3 of 6" in printed
    assert (aside / MODEL_STATES).stat().st_size == size // 2
    # Steps 4-6 again, from the verified step 3: the head of the uninterrupted run, bit for bit.
    resumed, uninterrupted = head_weights(out), head_weights(finished[1])
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
    assert [r["step"] for r in records(out)] == list(range(1, 7))
    assert complete_steps(ckpt_dir) == [3, 6]
    verify_checkpoint(ckpt_dir / tag_for(6))


def test_resume_on_another_capture_of_the_same_size_is_refused(
    finished, shards, sharp_target_dir, gsm8k_file, tmp_path, monkeypatch
):
    config, out = copy_run(finished, tmp_path)
    # Other questions, as many samples: only the data's fingerprint tells the captures apart.
    rows = gsm8k_file.read_text().splitlines()
    other_data = tmp_path / "other.jsonl"
    other_data.write_text("\n".join(reversed(rows)) + "\n")
    other = tmp_path / "other-shards"
    run_capture(base_config(sharp_target_dir, other_data, other, out, "eagle3"))
    old, new = (f"capture {ShardDataset(path).manifest['fingerprint']}" for path in (shards, other))
    assert len(ShardDataset(other)) == len(ShardDataset(shards)) and old != new

    with pytest.raises(ValueError, match=rf"cannot resume from step 6: data {old} -> {new} \(checkpoint -> now\)"):
        run_here(monkeypatch, eagle, config, f"train.out_dir={out}", f"capture.out_dir={other}")


def test_the_last_good_state_named_after_nan_is_one_that_verifies(make_config, shards, tmp_path, monkeypatch):
    # A NaN in the second micro-batch of step 3 (the 12th sample of the seeded order), checkpoints every step.
    corrupt = shards_with_a_nan(shards, tmp_path / "shards", 11)

    # The disk flips one byte of step 2's optimizer state once it is written.
    real_save = loop.save_checkpoint

    def save_then_flip(engine, out_dir, step, **kwargs):
        tag_dir = real_save(engine, out_dir, step, **kwargs)
        if step == 2:
            data = bytearray((tag_dir / OPTIM_STATES).read_bytes())
            data[len(data) // 2] ^= 0x40
            (tag_dir / OPTIM_STATES).write_bytes(bytes(data))
        return tag_dir

    monkeypatch.setattr(loop, "save_checkpoint", save_then_flip)
    config, out = make_config("eagle3", save_every=1)
    step1, step2 = (out / "checkpoints" / tag_for(s) for s in (1, 2))
    with pytest.raises(NonFiniteLoss) as err:
        run_here(monkeypatch, eagle, config, f"capture.out_dir={corrupt}")
    assert str(err.value) == (
        f"non-finite loss (nan) at step 3; stopped. The last good state is {step1} (step 1, its files verified). "
        f"Not good: {step2 / OPTIM_STATES} ({(step2 / OPTIM_STATES).stat().st_size} bytes) does not match its "
        "sha256 in COMPLETE (truncated or altered)."
    )


# What a full disk looks like through DeepSpeed's save (torch.save's zip writer), and through a plain write.
FULL_DISK = [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10688 vs 10578"),
    RuntimeError("basic_ios::clear: iostream error"),
    OSError(errno.ENOSPC, "No space left on device"),
]


@pytest.mark.parametrize("failure", FULL_DISK, ids=["unexpected-pos", "iostream", "enospc"])
def test_each_way_a_save_runs_out_of_room_is_named(tmp_path, failure):
    said = rf"^\[Errno 28\] writing {tmp_path / 'step'} failed: no space left on the device \("
    with pytest.raises(OutOfSpaceError, match=said), out_of_space_named(tmp_path / "step"):
        raise failure


def test_a_full_disk_at_a_checkpoint_is_named_and_the_last_complete_one_resumes(
    finished, tmp_path, monkeypatch, capsys
):
    config, out = copy_run(finished, tmp_path)
    ckpt_dir, more = out / "checkpoints", "train.max_steps=9"
    # Checked before DeepSpeed writes: a free-space probe that finds the disk nearly full.
    real_usage = shutil.disk_usage
    monkeypatch.setattr(io.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    with pytest.raises(OutOfSpaceError, match=rf"^the checkpoint of step 9 needs .* MB more in {ckpt_dir} but only "):
        run_here(monkeypatch, eagle, config, f"train.out_dir={out}", more)
    assert not (ckpt_dir / tag_for(9)).exists()
    # The disk fills during the save: torch's words become the error naming the folder.
    monkeypatch.setattr(io.shutil, "disk_usage", real_usage)

    def full(self, state_dict, path):
        raise FULL_DISK[0]

    monkeypatch.setattr(TorchCheckpointEngine, "save", full)
    with pytest.raises(OutOfSpaceError) as err:
        run_here(monkeypatch, eagle, config, f"train.out_dir={out}", more)
    said = f"[Errno 28] writing {ckpt_dir / tag_for(9)} failed: no space left on the device ("
    assert str(err.value).startswith(said)
    assert f"{ckpt_dir / tag_for(6)}, the last complete checkpoint, is untouched" in str(err.value)
    assert complete_steps(ckpt_dir) == [3, 6]
    verify_checkpoint(ckpt_dir / tag_for(6))
    # Space freed: the run resumes from the last complete checkpoint and saves step 9.
    monkeypatch.undo()
    capsys.readouterr()
    run_here(monkeypatch, eagle, config, f"train.out_dir={out}", more)
    assert "resumed from step 6 of 9" in capsys.readouterr().out
    assert complete_steps(ckpt_dir)[-1] == 9
    verify_checkpoint(ckpt_dir / tag_for(9))


def test_a_marker_is_checked_for_the_optimizer_settings_it_recorded_and_no_others():
    """A marker written before weight decay and betas were recorded holds the rates alone (``learning_rates``), one
    written before that nothing: each is checked for what it holds, never refused for what it could not know."""
    now = {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}
    check_optimizer({"step": 4, "learning_rates": {"lr": 1e-3}}, [], now)
    check_optimizer({"step": 4}, [], now)
    with pytest.raises(ValueError, match=r"step 4: train.lr 0.002 -> 0.001 \(checkpoint -> now\)"):
        check_optimizer({"step": 4, "learning_rates": {"lr": 2e-3}}, [], now)
    with pytest.raises(ValueError, match=r"step 4: train.weight_decay unused -> 0.1 \(checkpoint"):
        check_optimizer({"step": 4, "optimizer_settings": {"lr": 1e-3, "betas": [0.9, 0.95]}}, [], now)
