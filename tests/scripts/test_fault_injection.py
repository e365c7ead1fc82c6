"""Fault injection on the demo pipeline: SIGKILL at seeded points inside capture, training and export, and
a write that runs out of room.

The pipeline is ``scripts.demo`` on a tiny random target (capture -> torchrun training -> export), run
the way a user runs it. A kill takes down the whole process tree at once, like a lost machine; the
test then restarts the same command. Artifacts are compared with an uninterrupted run laid out the same
way under another root: shards and exports byte for byte, head weights within ATOL (one process and
one thread: the resumed run does the same float ops in the same order, so they are in fact equal).
"""

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from headstart.core.config_files import load_config
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.shards import read_manifest, shard_name
from headstart.scripts.export.command import main as export_main
from headstart.train import eagle
from tests.helpers import REPO, children, free_port, kill_tree, wait_for

SEED = 2026
ATOL = 1e-6  # head weights after kills vs uninterrupted; bit-equal is expected (see above)
STEPS = 12
CAPTURE, HEAD, EXPORT = Path("capture"), Path("eagle3/head"), Path("export/eagle3-vllm")


def pipeline_config(root: Path, target_dir: Path) -> Path:
    """The tiny pipeline under ``root``: every path in it is relative, so two roots give byte-comparable files."""
    stage_config = {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {
            "source": str(REPO / "assets/data/gsm8k_train.jsonl"),
            "format": "gsm8k",
            "max_length": 128,
            "limit": 120,
        },
        "capture": {
            "out_dir": str(CAPTURE),
            "aux_layers": [1, 3, 4],
            "store_dtype": "fp32",
            "shard_samples": 8,  # 15 shards: room for a kill between them
            "batch_tokens": 1024,
        },
        "head": {"type": "eagle3", "draft_vocab_size": 256, "ttt_steps": 3},
        "train": {
            "out_dir": "eagle3",
            "seed": 1,
            "batch_size": 4,
            "micro_batch_size": 2,
            "max_steps": STEPS,
            "lr": 1e-2,
            "warmup_steps": 1,
            "heldout_samples": 4,
            "eval_every": 0,
            "save_every": 3,
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "eagle3.yaml").write_text(yaml.safe_dump(stage_config))
    demo = {
        "out_dir": ".",
        "report": "report.md",
        "stages": [
            {
                "name": "capture",
                "cmd": "{python} -m data_recipes.capture --config eagle3.yaml",
                "inputs": ["eagle3.yaml"],
                "outputs": [str(CAPTURE / "manifest.json")],
            },
            {
                "name": "train",
                "cmd": f"{{bin}}/torchrun --standalone --nproc_per_node 1 {REPO}/train/eagle.py --config eagle3.yaml",
                "inputs": ["eagle3.yaml"],
                "outputs": [str(HEAD / "model.safetensors")],
            },
            {
                "name": "export",
                "cmd": f"{{python}} -m scripts.export --head {HEAD} --format vllm --out {EXPORT}",
                "outputs": [str(EXPORT / "config.json")],
            },
        ],
    }
    (root / "demo.yaml").write_text(yaml.safe_dump(demo))
    return root / "demo.yaml"


def demo_command(root: Path) -> list[str]:
    return [sys.executable, "-m", "scripts.demo", "--config", str(root / "demo.yaml")]


def env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def wait_for_child(proc: subprocess.Popen) -> int:
    found: list[int] = []
    wait_for(lambda: found.extend(children(proc.pid)) or found, proc, "the stage's process started")
    return found[0]


def state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z zombie), or X once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "X"


def run_in_slices_until(pid: int, predicate, what: str, slice_s: float = 5e-4) -> None:
    """Let ``pid`` run in slices of ``slice_s``, checking ``predicate`` while it is stopped between them.

    For a window of a few milliseconds (the export's write): the check never races the process, so
    the kill lands inside the window, and the process is left stopped for it.
    """
    while True:
        os.kill(pid, signal.SIGSTOP)
        while state(pid) not in "TtZX":
            pass
        if state(pid) in "ZX":
            raise AssertionError(f"the process ended before {what}")
        if predicate():
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(slice_s)


def train_steps_logged(root: Path) -> int:
    path = root / "eagle3" / "metrics.jsonl"
    return path.read_text().count('"split": "train"') if path.is_file() else 0


def train_records(root: Path) -> list[dict]:
    lines = (root / "eagle3" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def stage_started(log: Path, name: str):
    return lambda: f"stage {name}: running" in log.read_text()


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.name.endswith((".tmp", ".old"))]


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tmp_path_factory):
    """The uninterrupted pipeline, each stage's entry point called in this process (saves ~20 s of imports).

    Training runs as a world of one, as ``torchrun --nproc_per_node 1`` does, with one thread.
    """
    root = tmp_path_factory.mktemp("reference")
    pipeline_config(root, tiny_target_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            mp.setenv(key, value)
        mp.setenv("MASTER_PORT", free_port())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run_capture(load_config("eagle3.yaml"))
            eagle.main(["--config", "eagle3.yaml"])
            export_main(["--head", str(HEAD), "--format", "vllm", "--out", str(EXPORT)])
        finally:
            torch.set_num_threads(threads)
    return root


@pytest.mark.slow
def test_sigkilled_pipeline_ends_with_the_uninterrupted_artifacts(reference, tiny_target_dir, tmp_path):
    rng = random.Random(SEED)
    n_shards = len(read_manifest(reference / CAPTURE)["shards"])
    root = tmp_path / "faulted"
    pipeline_config(root, tiny_target_dir)
    log = root / "demo.log"
    # Kill points, seeded: after k finished shards, after s logged optimizer steps. The export's write
    # takes milliseconds, so the export runs in short slices and is killed in the first one that
    # leaves its temporary folder behind: mid-write.
    shards_before_kill = rng.randint(1, n_shards - 1)
    steps_before_kill = rng.randint(1, STEPS - 2)  # not the last: its kill must beat the final save
    kills = [
        ("capture", lambda: len(list((root / CAPTURE).glob("shard-*.safetensors"))) >= shards_before_kill),
        ("train", lambda: train_steps_logged(root) >= steps_before_kill),
        ("export", lambda: bool(temp_files(root / EXPORT.parent))),
    ]
    for stage, due in kills:
        with log.open("w") as out:
            proc = subprocess.Popen(demo_command(root), cwd=root, env=env(), stdout=out, stderr=subprocess.STDOUT)
        wait_for(stage_started(log, stage), proc, f"stage {stage} started")
        if stage == "export":
            run_in_slices_until(wait_for_child(proc), due, "its temporary folder appeared")
            kill_tree(proc.pid)
        else:
            wait_for(due, proc, f"the kill point in {stage}")
            kill_tree(proc.pid)
        proc.wait()
        assert not (root / "stages" / f"{stage}.json").exists(), f"the kill landed after {stage} finished"
    assert temp_files(root / EXPORT.parent), "the export was not killed mid-write"

    done = subprocess.run(demo_command(root), cwd=root, env=env(), check=True, capture_output=True, text=True)
    assert "stage capture: done, skipped (outputs complete" in done.stdout
    assert "stage train: done, skipped (outputs complete" in done.stdout
    assert "stage export: running" in done.stdout

    # Shards byte-identical, and every sample in exactly one of them.
    assert tree_bytes(root / CAPTURE) == tree_bytes(reference / CAPTURE)
    ids = []
    for k in range(n_shards):
        with safe_open(str(root / CAPTURE / shard_name(k)), framework="pt") as f:
            ids += f.get_tensor("sample_ids").tolist()
    assert sorted(ids) == list(range(read_manifest(root / CAPTURE)["samples"]))
    # Every optimizer step logged once, on the same samples (same token counts) as the reference.
    steps, ref_steps = train_records(root), train_records(reference)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in steps] == [r["tokens"] for r in ref_steps]
    # The head within ATOL, its config and the export identical, no temporary left anywhere.
    weights, ref_weights = (
        load_file(str(root / HEAD / "model.safetensors")),
        load_file(str(reference / HEAD / "model.safetensors")),
    )
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=ATOL)
    assert (root / HEAD / "config.json").read_bytes() == (reference / HEAD / "config.json").read_bytes()
    assert tree_bytes(root / EXPORT) == tree_bytes(reference / EXPORT)
    assert temp_files(root) == []
    assert all((p / "COMPLETE").is_file() for p in (root / "eagle3/checkpoints").glob("step-*"))

    again = subprocess.run(demo_command(root), cwd=root, env=env(), check=True, capture_output=True, text=True)
    assert again.stdout.count("done, skipped (outputs complete") == 3


def test_waiting_lasts_as_long_as_the_process_works(tmp_path):
    # 3 s of CPU work before the awaited file appears: longer than the stall limit, never idle that long.
    flag = tmp_path / "flag"
    work = "import pathlib, sys, time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", work + "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)", flag])
    try:
        wait_for(flag.exists, proc, "the flag", stall_s=1)
    finally:
        proc.kill()
        proc.wait()


def test_a_hung_process_fails_the_wait(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="the process used no CPU for 1 s before the flag: hung"):
            wait_for((tmp_path / "flag").exists, proc, "the flag", stall_s=1)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - start < 30
    died = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(AssertionError, match=r"the process ended \(exit code 3\) before the flag"):
        wait_for((tmp_path / "flag").exists, died, "the flag")


def file_size_limit(limit: int):
    """For preexec_fn: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored, so the process lives to say so)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_write_that_runs_out_of_room_keeps_the_last_complete_state(reference, tiny_target_dir, tmp_path):
    root = tmp_path / "full"
    pipeline_config(root, tiny_target_dir)
    # A capture that finished two shards before: the third is larger than the file-size limit.
    (root / CAPTURE).mkdir()
    for k in range(2):
        shutil.copy(reference / CAPTURE / shard_name(k), root / CAPTURE / shard_name(k))
    third = (reference / CAPTURE / shard_name(2)).stat().st_size
    cmd = demo_command(root) + ["--stages", "capture"]
    failed = subprocess.run(
        cmd, cwd=root, env=env(), capture_output=True, text=True, preexec_fn=file_size_limit(third // 2)
    )
    assert failed.returncode != 0
    message = failed.stderr + failed.stdout
    assert (
        f"writing {CAPTURE / shard_name(2)} failed: the file size limit (ulimit -f, RLIMIT_FSIZE) was reached"
        in message
    )
    assert "stage capture: failed (exit code 1)" in message
    kept = [shard_name(0), shard_name(1), "capture_config.yaml"]
    assert tree_bytes(root / CAPTURE) == {n: (reference / CAPTURE / n).read_bytes() for n in sorted(kept)}
    assert temp_files(root) == []

    # An export over a previous one: the old folder stays whole.
    shutil.copytree(reference / HEAD, root / HEAD)
    shutil.copytree(reference / EXPORT, root / EXPORT)
    export = [sys.executable, "-m", "scripts.export", "--head", str(HEAD), "--format", "vllm", "--out", str(EXPORT)]
    weights = (reference / EXPORT / "model.safetensors").stat().st_size
    failed = subprocess.run(
        export, cwd=root, env=env(), capture_output=True, text=True, preexec_fn=file_size_limit(weights // 2)
    )
    assert failed.returncode != 0
    assert f"writing {EXPORT} failed: the file size limit (ulimit -f, RLIMIT_FSIZE) was reached" in failed.stderr
    assert tree_bytes(root / EXPORT) == tree_bytes(reference / EXPORT)
    assert temp_files(root) == []

    # With room again, the capture resumes after the two shards and ends as the uninterrupted one did.
    resumed = subprocess.run(cmd, cwd=root, env=env(), check=True, capture_output=True, text=True)
    assert "(2 already complete, resuming)" in resumed.stdout
    assert tree_bytes(root / CAPTURE) == tree_bytes(reference / CAPTURE)
