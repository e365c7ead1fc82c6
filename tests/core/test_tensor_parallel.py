"""Targets larger than one device: training from shards reads only the borrowed tensors, and a target split
across torchrun ranks (``target.tp_size``, transformers' tensor parallelism over gloo) captures, trains online
and evaluates as one process does. CPU, the tiny target (4 attention heads, 2 key/value heads: tp_size 2)."""

import json
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from headstart.core.fingerprint import weights_hash
from headstart.core.memory import InsufficientMemoryError
from headstart.core.models import load_model
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.shards import shard_name
from headstart.eval import acceptance
from headstart.train import eagle
from tests.helpers import (
    REPO,
    assert_matches,
    base_config,
    free_port,
    head_weights,
    kill_tree,
    make_head,
    records,
    run_here,
    subprocess_env,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: one step is 2^-7 of the value's power of two


def torchrun(*args: str, nproc: int = 2, wait: bool = True):
    """``torchrun --nproc_per_node nproc args`` from the repository; its stdout (or, ``wait=False``, the process)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", free_port()]
    if not wait:
        return subprocess.Popen([*cmd, *args], cwd=REPO, env=subprocess_env(), start_new_session=True)
    done = subprocess.run([*cmd, *args], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ---- training from shards borrows three tensors


def sharded_copy(src, out, garbage=False):
    """``src`` saved again as small safetensors shards; ``garbage``: the first decoder-layer-only shard overwritten
    with random bytes (unreadable: loading the whole model must fail)."""
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out, max_shard_size="20KB")
    for file in src.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(file, out / file.name)
    if garbage:
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        layer_file = next(f for f, names in sorted(files.items()) if all(".layers." in n for n in names))
        size = (out / layer_file).stat().st_size
        (out / layer_file).write_bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(0))
                                       .to(torch.uint8).numpy().tobytes())  # fmt: skip
    return out


def test_a_garbage_decoder_shard_trains_the_same_head_byte_for_byte(
    make_config, sharp_target_dir, tmp_path, monkeypatch
):
    intact = sharded_copy(sharp_target_dir, tmp_path / "intact")
    broken = sharded_copy(sharp_target_dir, tmp_path / "broken", garbage=True)
    with pytest.raises(Exception):  # noqa: B017 - whatever safetensors says of random bytes: the decoder is gone
        AutoModelForCausalLM.from_pretrained(broken)
    # The fingerprint reads the config, the tensor names and the borrowed tensors: the shards' provenance holds.
    assert weights_hash(broken, "fp32") == weights_hash(intact, "fp32") == weights_hash(sharp_target_dir, "fp32")
    config, _ = make_config("eagle3", max_steps=3, eval_every=3)
    for target, out in ((intact, tmp_path / "from-intact"), (broken, tmp_path / "from-broken")):
        run_here(monkeypatch, eagle, config, f"target.path={target}", f"train.out_dir={out}")
    assert (tmp_path / "from-broken/head/model.safetensors").read_bytes() == (
        tmp_path / "from-intact/head/model.safetensors"
    ).read_bytes()


# ---- a split target: capture, evaluation, sampling, online training


def test_capture_at_tp_size_2_writes_the_one_process_states(tiny_target_dir, gsm8k_file, tmp_path):
    cfg = base_config(tiny_target_dir, gsm8k_file, tmp_path / "one", tmp_path, "eagle3")
    cfg["capture"]["store_dtype"] = "bf16"
    run_capture(cfg)
    cfg["capture"]["out_dir"] = str(tmp_path / "split")
    out = torchrun("-m", "data_recipes.capture", "--config", str(write_config(tmp_path / "c.yaml", cfg)),
                   "target.tp_size=2")  # fmt: skip
    assert "1 groups of 2 splitting the target" in out
    for k in range(2):
        one, split = load_file(tmp_path / "one" / shard_name(k)), load_file(tmp_path / "split" / shard_name(k))
        assert one.keys() == split.keys()
        for key in ("input_ids", "loss_mask", "sample_offsets", "sample_ids"):
            assert torch.equal(one[key], split[key]), key
        for key in ("last_hidden", "aux_hidden"):
            a, b = one[key].float(), split[key].float()
            magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-126)
            step = 2.0 ** torch.floor(torch.log2(magnitude)) * BF16_STEP
            # Two bf16 steps of the value; near zero, where a step is below fp32's own reduction-order noise, 1e-5.
            assert ((a - b).abs() <= 2 * step + 1e-5).all(), key


def test_evaluation_at_tp_size_2_is_greedy_identical_with_the_one_process_tau(tiny_target_dir, tmp_path, monkeypatch):
    head = make_head(AutoModelForCausalLM.from_pretrained(tiny_target_dir), tmp_path, "eagle3", layer_ids=[1, 3, 4])
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"question": f"Ann has {i} apples. How many?", "answer": "#### 1"}) + "\n"
                             for i in range(3)))  # fmt: skip
    flags = ["--target", str(tiny_target_dir), "--head", str(head), "--method", "vanilla,ngram,eagle3",
             "--bench", str(bench), "--max-new-tokens", "24", "--device", "cpu"]  # fmt: skip
    one = acceptance.main([*flags, "--out", str(tmp_path / "one")])
    torchrun("-m", "eval.acceptance", *flags, "--tp-size", "2", "--out", str(tmp_path / "split"))
    split = json.loads((tmp_path / "split" / "report.json").read_text())
    assert split["tp_size"] == 2
    for method in ("vanilla", "ngram", "eagle3"):
        assert split["methods"][method]["greedy_identical"] is True, method
        assert split["methods"][method]["tau"] == pytest.approx(one["methods"][method]["tau"]), method
        assert split["methods"][method]["target_forwards"] == one["methods"][method]["target_forwards"], method


SAMPLING_WORKER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from tests.decoding.test_decoding_sampling import PROMPT, sample_pairs
    from headstart.core.models import load_decoding_target
    from headstart.decoding.proposers import DraftModel
    from headstart.decoding.verify import Sampling
    from tests.helpers import exact_two_tokens_of, tiny_llama
    target, ranks = load_decoding_target({target!r}, "cpu", "fp32", 2, 0, 16)
    draft = tiny_llama(7, vocab_size=4, num_hidden_layers=2)  # whole on every rank, the same weights
    draft.lm_head.weight.data *= 4
    sampling = Sampling(temperature=1.0)
    torch.manual_seed(0)  # every rank draws the same numbers: the split forwards stay in lockstep
    counts = sample_pairs(target, lambda: DraftModel(draft, k=2), sampling, 1000)
    exact, wrong = exact_two_tokens_of(target, PROMPT, sampling), exact_two_tokens_of(draft, PROMPT, sampling)
    if ranks.rank == 0:
        torch.save({{"counts": counts, "exact": exact, "wrong": wrong}}, {out!r})
""")


def test_sampling_at_tp_size_2_is_lossless(tmp_path):
    # test_decoding_sampling's P-EAGLE target (V = 4, peaked), split in two; a whole draft model that disagrees.
    from tests.helpers import tiny_llama

    target = tiny_llama(2, vocab_size=4, num_hidden_layers=3)
    target.lm_head.weight.data *= 4
    target.save_pretrained(tmp_path / "target")
    worker = tmp_path / "worker.py"
    out = tmp_path / "counts.pt"
    worker.write_text(SAMPLING_WORKER.format(repo=str(REPO), target=str(tmp_path / "target"), out=str(out)))
    torchrun(str(worker))
    result = torch.load(out)
    whole = load_model(str(tmp_path / "target"), "cpu")
    assert result["counts"].sum() == 1000
    from headstart.decoding.verify import Sampling
    from tests.decoding.test_decoding_sampling import PROMPT
    from tests.helpers import exact_two_tokens_of

    # The split target's exact distribution is the whole one's (fp32 reduction order only).
    torch.testing.assert_close(result["exact"], exact_two_tokens_of(whole, PROMPT, Sampling(temperature=1.0)))
    assert_matches(result["counts"], result["exact"], result["wrong"])


def test_online_training_at_tp_size_2_takes_the_one_process_steps_and_resumes_byte_identical_after_kill_9(
    make_config, tmp_path, monkeypatch
):
    settings = dict(max_steps=8, save_every=2, keep_checkpoints=0, eval_every=4, online_capture=True)
    config, one = make_config("eagle3", name="one", **settings)
    run_here(monkeypatch, eagle, config)
    script = str(REPO / "train" / "eagle.py")
    split = tmp_path / "split"
    torchrun(script, "--config", str(config), f"train.out_dir={split}", "target.tp_size=2")
    # The same steps as one process: the same batches and losses, fp32 summation order aside (the split forward
    # sums its halves in another order: states differ in the 7th digit). AdamW divides each update by the root
    # of the squared gradients, so on a weight whose gradient is near zero that noise moves the update by up to
    # lr (1e-2) times its relative size: after 8 steps the weights agree to 1e-3, the losses to 1e-5.
    assert [r["tokens"] for r in records(split)] == [r["tokens"] for r in records(one)]
    for mine, theirs in zip(records(split) + records(split, "heldout"), records(one) + records(one, "heldout")):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    for name, weight in head_weights(split).items():
        torch.testing.assert_close(weight, head_weights(one)[name], atol=1e-3, rtol=0, msg=name)

    # kill -9 after the step-4 checkpoint, then the same command: the head of the uninterrupted split run.
    killed = tmp_path / "killed"
    proc = torchrun(script, "--config", str(config), f"train.out_dir={killed}", "target.tp_size=2", wait=False)
    try:
        wait_for(lambda: (killed / "checkpoints" / "step-00000004" / "COMPLETE").is_file(), proc, "step 4's checkpoint")
        kill_tree(proc.pid)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and len(records(killed)) < 8  # killed mid-run
    out = torchrun(script, "--config", str(config), f"train.out_dir={killed}", "target.tp_size=2")
    assert "resumed from step" in out
    assert (killed / "head" / "model.safetensors").read_bytes() == (split / "head" / "model.safetensors").read_bytes()


# ---- refused before loading


def test_a_family_transformers_cannot_split_and_a_device_too_small_are_refused_before_loading(tmp_path):
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=32, n_head=4).save_pretrained(gpt2)  # a config and no weights at all
    with pytest.raises(NotImplementedError, match="no tensor-parallel plan for gpt2 targets"):
        load_model(str(gpt2), "cpu", "fp32", tp_size=2)
    odd = tmp_path / "odd"
    LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=1).save_pretrained(odd)
    with pytest.raises(NotImplementedError, match="does not divide the target's attention heads 3 and key/value"):
        load_model(str(odd), "cpu", "fp32", tp_size=2)

    # Llama-3.3-70B's shape, a config and no weights: its 141 GB share on one rank of this machine.
    big = tmp_path / "llama-70b"
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(big)  # fmt: skip
    cfg = base_config(big, tmp_path / "no-data.jsonl", tmp_path / "shards", tmp_path, "eagle3")
    cfg["target"]["dtype"] = "bf16"
    with pytest.raises(InsufficientMemoryError, match=r"capture needs per rank: target share 141\.1\d GB"):
        run_capture(cfg)
    assert not (tmp_path / "shards").exists()


def test_regeneration_at_tp_size_2_writes_the_one_process_replies(tiny_target_dir, gsm8k_file, tmp_path):
    from headstart.data_recipes.regenerate import run_regenerate

    cfg = {
        "target": {"path": str(tiny_target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(gsm8k_file), "format": "gsm8k", "limit": 4},
        "regenerate": {"out": str(tmp_path / "one.jsonl"), "max_new_tokens": 8, "chunk_size": 2, "temperature": 0.9},
    }
    run_regenerate(cfg)
    cfg["regenerate"]["out"] = str(tmp_path / "split.jsonl")
    torchrun(
        "-m", "data_recipes.regenerate", "--config", str(write_config(tmp_path / "r.yaml", cfg)), "target.tp_size=2"
    )
    # Sampled, seeded per chunk: every rank of the group draws the same tokens, the ones one process draws.
    assert (tmp_path / "split.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
