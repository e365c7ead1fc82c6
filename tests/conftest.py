"""Test-wide settings: no network, no wandb, seeded, one place for the bundled model paths; the tiny training
config and its process env; waiting on a process."""

import os
import socket
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "assets" / "demo-target"
DRAFT = REPO / "assets" / "demo-draft"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is much faster than two fighting over cores shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TARGET).eval(), AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="session")
def draft():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DRAFT).eval(), AutoTokenizer.from_pretrained(DRAFT)


GSM8K_ROWS = [
    {
        "question": f"Ann has {i} apples and buys {i + 3} more. How many apples does she have?",
        "answer": f"She has {i}+{i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}",
    }
    for i in range(48)
]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama with the bundled tokenizer's design, saved like a real HF model folder."""
    from transformers import LlamaForCausalLM

    from scripts.build_demo_models import build_tokenizer, model_config, to_messages

    out = tmp_path_factory.mktemp("tiny-target")
    tokenizer = build_tokenizer([to_messages(r, None) for r in GSM8K_ROWS], vocab_size=400, min_frequency=1)
    arch = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(model_config(arch, tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return path


# ---- tiny training runs (tests/test_train.py, tests/test_cli.py)

TINY_HEADS = {  # head options for the tiny training runs
    "eagle": {"type": "eagle"},
    "eagle3": {"type": "eagle3", "draft_vocab_size": 256, "ttt_steps": 3},
    "medusa": {"type": "medusa", "num_heads": 2},
}
SAMPLES, HELDOUT, BATCH = 16, 4, 4


def base_config(target_dir, data_file, shards, out_dir, head_type, **train):
    return {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "gsm8k", "max_length": 64, "limit": SAMPLES},
        "capture": {
            "out_dir": str(shards),
            "aux_layers": [1, 3, 4],
            "store_dtype": "fp32",
            "shard_samples": 8,
            "batch_tokens": 512,
        },
        "head": TINY_HEADS[head_type],
        "train": {
            "out_dir": str(out_dir),
            "seed": 3,
            "batch_size": BATCH,
            "micro_batch_size": 2,
            "max_steps": 6,
            "lr": 1e-2,
            "warmup_steps": 1,
            "zero_stage": 2,
            "heldout_samples": HELDOUT,
            "eval_every": 3,
            **train,
        },
    }


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def world_of_one(monkeypatch):
    """The env of rank 0 of a world of one, undone after the test (a recipe's main() run in this process)."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", free_port())


def subprocess_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def head_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(str(out_dir / "head" / "model.safetensors"))


def children(pid: int) -> list[int]:
    """The ids of ``pid``'s direct children (from /proc: Linux only)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:  # fields after the command: state, ppid, ...
            found.append(int(stat.parent.name))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU time used so far by ``pid`` and its descendants, the finished ones included (those reaped)."""
    total, frontier = 0, [pid]
    while frontier:
        p = frontier.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime (clock ticks)
        frontier += children(p)
    return total / os.sysconf("SC_CLK_TCK")


def wait_for(predicate, proc, what: str, stall_s: float = 600, deadline_s: float = 3600) -> None:
    """Poll ``predicate`` until it holds, as long as ``proc`` runs and makes progress.

    No fixed clock: on a loaded machine a stage may take minutes to reach its first step (DeepSpeed
    builds its ops inside the torchrun child). Progress is CPU time used by ``proc``'s process tree;
    the wait fails when ``proc`` ends first, when the tree used no CPU for ``stall_s`` (hung), and,
    as a last safety net only, after ``deadline_s``.
    """
    start = last_check = last_progress = time.monotonic()
    used = tree_cpu_seconds(proc.pid)
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (exit code {proc.returncode}) before {what}")
        now = time.monotonic()
        if now - last_check >= 0.5:  # reading /proc for the whole tree costs more than the predicate
            last_check, cpu = now, tree_cpu_seconds(proc.pid)
            if cpu > used:
                used, last_progress = cpu, now
            if now - last_progress > stall_s:
                raise AssertionError(f"the process used no CPU for {stall_s:.0f} s before {what}: hung")
            if now - start > deadline_s:
                raise AssertionError(f"the process still worked after {deadline_s:.0f} s but not yet {what}")
        time.sleep(0.002)
