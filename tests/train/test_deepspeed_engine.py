"""The wait before DeepSpeed builds its shared-memory op: a lock a killed build left stops the start at once with
the file to remove, where torch's ``FileBaton`` would poll it forever; a live build's lock is waited out."""

import os
import threading
import time

import pytest
import torch.distributed as dist

from headstart.train.deepspeed_engine import STALE_LOCK_SECONDS, StaleBuildLock, wait_for_op_build
from headstart.train.loop import init_distributed
from tests.helpers import world_of_one


@pytest.fixture
def op_lock(tmp_path, monkeypatch):
    """Where torch's JIT build of DeepSpeed's CPU communication op takes its lock, under a TORCH_EXTENSIONS_DIR of
    the test's own; the lock is created by the test."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    return folder / "lock"


def test_a_lock_older_than_any_build_stops_the_start_naming_the_file(op_lock, monkeypatch):
    op_lock.touch()
    hour_ago = time.time() - 3600
    os.utime(op_lock, (hour_ago, hour_ago))
    world_of_one(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # a fresh process: DeepSpeed would build its op next
    start = time.perf_counter()
    with pytest.raises(StaleBuildLock) as err:
        init_distributed("cpu")
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert f"{op_lock} has been there for 60 min" in message
    assert f"If no build is running (no ninja or c++ process), remove it: rm {op_lock}" in message
    assert op_lock.exists()  # removing it is the user's call: a build may still be running elsewhere


def test_a_live_build_is_waited_for_then_the_start_goes_on(op_lock, capsys):
    op_lock.touch()
    finish = threading.Timer(0.3, op_lock.unlink)  # the build in progress ends and releases its lock
    finish.start()
    start = time.perf_counter()
    wait_for_op_build(poll_seconds=0.02)
    assert not op_lock.exists()  # it returned once the build released its lock, not before
    assert time.perf_counter() - start < STALE_LOCK_SECONDS
    finish.join()
    assert f"to release {op_lock}" in capsys.readouterr().out


def test_a_lock_left_moments_before_the_start_fails_once_it_outlives_a_build(op_lock):
    """A restart right after a killed build finds a young lock: waited on, then refused once it is stale."""
    op_lock.touch()
    start = time.perf_counter()
    with pytest.raises(StaleBuildLock, match="remove it"):
        wait_for_op_build(stale_after=0.3, poll_seconds=0.02)
    # Not before it was 0.3 s old; a file's time is the kernel's coarse clock, up to a tick behind ours.
    assert 0.25 <= time.perf_counter() - start < 5
