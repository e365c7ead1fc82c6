"""Provenance: shards, parts and heads refuse a target, tokenizer or file other than the one they came from.

Shards of another checkpoint, a shard copied into the wrong slot, a truncated or bit-flipped shard,
token ids past the vocabulary, regeneration parts of other settings, a head on a target with another
tokenizer, two writers in one folder, a read-only folder, data without assistant tokens.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from headstart.core.fingerprint import tokenizer_hash, weights_hash
from headstart.core.io import FolderLockedError, NotWritableError, OutOfSpaceError, output_lock
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.capture_plan import check_free_disk
from headstart.data_recipes.errors import DataError
from headstart.data_recipes.regenerate import run_regenerate
from headstart.data_recipes.shards import (
    ManifestMismatch,
    ShardDataset,
    ShardError,
    read_manifest,
    shard_name,
    verify_capture,
)
from headstart.data_recipes.shards import main as verify_main
from headstart.heads import build_head, load_head
from headstart.scripts.export.command import export_head
from headstart.train.data import load_data, loss_token_counts
from headstart.train.train_config import resolve_config
from tests.helpers import REPO


def capture_config(target_dir, data_file, out_dir, **data):
    return {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "gsm8k", "max_length": 64, "limit": 16, **data},
        "capture": {
            "out_dir": str(out_dir),
            "aux_layers": [1, 3, 4],
            "store_dtype": "fp32",
            "shard_samples": 4,
            "batch_tokens": 256,
        },
    }


def train_config(capture: dict, **train) -> dict:
    cfg = capture | {"head": {"type": "eagle3", "draft_vocab_size": 64}}
    cfg["train"] = {"out_dir": "unused", "batch_size": 4, "micro_batch_size": 2, "heldout_samples": 2, **train}
    return resolve_config(cfg, "eagle")


@pytest.fixture(scope="module")
def captured(tiny_target_dir, gsm8k_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("provenance") / "shards"
    run_capture(capture_config(tiny_target_dir, gsm8k_file, out))
    return out


@pytest.fixture
def copy_of(captured, tmp_path):
    """A private copy of the capture, to damage."""
    out = tmp_path / "shards"
    shutil.copytree(captured, out)
    return out


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with another chat template: the same vocabulary (and size), another tokenizer."""
    out = tmp_path_factory.mktemp("other-tokenizer")
    shutil.copytree(tiny_target_dir, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template += "{# another template #}"
    tokenizer.save_pretrained(out)
    return out


def rewrite_shard(path, change):
    """Save a shard again after ``change(tensors)``, with the same fingerprint (and, for same-sized changes, size)."""
    from headstart.data_recipes.shards import shard_fingerprint

    fingerprint = shard_fingerprint(path)
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"fingerprint": fingerprint})


# Item 6: shards captured from another checkpoint of the same shape.


def test_training_refuses_shards_of_other_weights(captured, tiny_target_dir, gsm8k_file, tiny_target, tmp_path):
    model, tokenizer = tiny_target
    cfg = train_config(capture_config(tiny_target_dir, gsm8k_file, captured))
    assert len(load_data(cfg, model, tokenizer, aux=True, online_states=True).dataset) == 16  # the same target

    # "Fine-tuned": same shapes, other values in a tensor the head borrows (the lm_head).
    tuned = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with torch.no_grad():
        tuned.lm_head.weight.mul_(1.01)
    tuned.save_pretrained(tmp_path / "tuned")
    tokenizer.save_pretrained(tmp_path / "tuned")
    cfg.target.path = str(tmp_path / "tuned")
    captured_from, here = read_manifest(captured)["target_weights_hash"], weights_hash(tmp_path / "tuned", "fp32")
    assert captured_from == weights_hash(tiny_target_dir, "fp32") != here
    assert weights_hash(tiny_target_dir, "bf16") != captured_from  # another compute dtype: other states
    with pytest.raises(ManifestMismatch, match=f"weights hash {captured_from} in the shards, {here} here"):
        load_data(cfg, tuned, tokenizer, aux=True, online_states=True)

    cfg.capture.allow_other_weights = True
    with pytest.warns(UserWarning, match="capture.allow_other_weights"):
        assert len(load_data(cfg, tuned, tokenizer, aux=True, online_states=True).dataset) == 16


# Item 7: a shard in the wrong slot (same fingerprint, other samples).


def test_a_shard_in_the_wrong_slot_is_named_on_load_and_by_capture(copy_of, tiny_target_dir, gsm8k_file):
    first, second = copy_of / shard_name(0), copy_of / shard_name(1)
    ids_of_second = load_file(str(second))["sample_ids"]
    rewrite_shard(first, lambda t: t.update(sample_ids=ids_of_second.clone()))  # same size, same fingerprint
    duplicate = int(ids_of_second[0])
    with pytest.raises(ShardError, match=f"sample {duplicate} is in both {first} and {second}"):
        ShardDataset(copy_of)
    # Capture does not call it complete ...
    with pytest.raises(ShardError, match=f"sample {duplicate} is in both"):
        run_capture(capture_config(tiny_target_dir, gsm8k_file, copy_of))
    # ... nor resume over it once the manifest is gone.
    (copy_of / "manifest.json").unlink()
    with pytest.raises(ShardError, match=f"{first} has this capture's fingerprint but not the samples of shard 0"):
        run_capture(capture_config(tiny_target_dir, gsm8k_file, copy_of))


def test_sample_ids_outside_the_capture_are_named(copy_of):
    ids = load_file(str(copy_of / shard_name(3)))["sample_ids"]
    rewrite_shard(copy_of / shard_name(3), lambda t: t.update(sample_ids=ids + 100))
    with pytest.raises(
        ShardError, match=rf"{copy_of / shard_name(3)} holds sample 1\d\d, outside this capture's 0\.\.15"
    ):
        ShardDataset(copy_of)


# Item 15: truncated, corrupt, bit-flipped shards; ids past the vocabulary; a draft with a larger vocabulary.


def test_a_truncated_shard_is_named(copy_of):
    path = copy_of / shard_name(2)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match=f"{path} is {size - 100} bytes, the manifest records {size}: truncated"):
        ShardDataset(copy_of)


def test_a_flipped_header_byte_is_named_at_open(copy_of):
    path = copy_of / shard_name(1)
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{path} is truncated or corrupt"):
        ShardDataset(copy_of)


def flip_bit_in(path, tensor):
    """Flip one bit in the middle of ``tensor``'s bytes in the safetensors file ``path`` (header left intact)."""
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_size])[tensor]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_data_byte_is_found_by_the_checksum_only(copy_of, tiny_target_dir, gsm8k_file, capsys):
    path = copy_of / shard_name(2)
    flip_bit_in(path, "last_hidden")  # the header and every count stay valid
    assert len(ShardDataset(copy_of)) == 16  # the cheap checks cannot see it (module docstring of shards.py)
    with pytest.raises(ShardError, match=f"{path}: its sha256 differs from the one the manifest recorded"):
        verify_capture(copy_of)
    with pytest.raises(SystemExit) as exit_info:
        verify_main([str(copy_of)])
    assert exit_info.value.code == 1 and f"verify failed: {path}: its sha256 differs" in capsys.readouterr().err
    with pytest.raises(ShardError, match="its sha256 differs"):
        run_capture(capture_config(tiny_target_dir, gsm8k_file, copy_of))


def test_token_ids_past_the_vocabulary_are_named(copy_of, tiny_target_dir, gsm8k_file, tiny_target):
    path = copy_of / shard_name(1)

    model, tokenizer = tiny_target
    vocab = model.config.vocab_size

    def out_of_vocab(tensors):
        tensors["input_ids"][7] = vocab

    rewrite_shard(path, out_of_vocab)
    data = load_data(train_config(capture_config(tiny_target_dir, gsm8k_file, copy_of)), model, tokenizer, True, True)
    message = rf"token id {vocab} is outside the target's vocabulary \(0\.\.{vocab - 1}\)"
    with pytest.raises(ShardError, match=f"{path}: {message}"):  # EAGLE-3's draft vocabulary counts
        loss_token_counts(data.dataset, list(range(16)), vocab)
    index = next(i for i, ref in enumerate(data.dataset.refs) if ref.shard == path.name and ref.start <= 7 < ref.end)
    with pytest.raises(ShardError, match=f"{path}, sample {data.dataset.refs[index].sample_id}: {message}"):
        data.dataset[index]


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tiny_target_dir, gsm8k_file, tmp_path):
    from headstart.eval.acceptance import main

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    draft = tmp_path / "draft"
    LlamaForCausalLM(type(target.config)(**target.config.to_dict() | {"vocab_size": 512})).save_pretrained(draft)
    argv = ["--target", str(tiny_target_dir), "--draft", str(draft), "--method", "draft_model"]
    argv += ["--bench", str(gsm8k_file), "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "r")]
    vocabularies = f"{draft} has a vocabulary of 512 tokens, the target {tiny_target_dir} {target.config.vocab_size}"
    with pytest.raises(ValueError, match=f"the draft model {vocabularies}: it would propose ids"):
        main(argv)


# Item 9: regeneration parts of other settings.


def test_regenerate_never_mixes_parts_of_other_settings(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    import headstart.data_recipes.regenerate as regenerate

    def config(out, max_new_tokens, **regen):
        return {
            "target": {"path": str(tiny_target_dir), "device": "cpu", "dtype": "fp32"},
            "data": {"source": str(gsm8k_file), "format": "gsm8k", "limit": 4},
            "regenerate": {"out": str(out), "max_new_tokens": max_new_tokens, "chunk_size": 2, **regen},
        }

    reference = run_regenerate(config(tmp_path / "ref.jsonl", 24)).read_text()
    # A run with max_new_tokens 4 dies after its first part.
    real_chunk = regenerate.regenerate_chunk
    calls = []

    def dies_after_one_chunk(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real_chunk(*args)

    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        patch.setattr(regenerate, "regenerate_chunk", dies_after_one_chunk)
        with pytest.raises(KeyboardInterrupt):
            run_regenerate(config(out, 4))
    parts = tmp_path / "out.jsonl.parts"
    assert [p.name for p in sorted(parts.glob("part-*"))] == ["part-00000.jsonl"]

    with pytest.raises(
        ValueError, match=r"holds 1 parts made with other settings \(max_new_tokens 4 -> 24; parts -> now\)"
    ):
        run_regenerate(config(out, 24))
    assert not out.exists()
    run_regenerate(config(out, 24, discard_stale_parts=True))
    assert out.read_text() == reference  # every reply of the 24-token run, none of the 4-token one


# Item 13: a head on a target whose tokenizer differs (same vocabulary size).


def test_heads_record_the_tokenizer_and_refuse_another(tiny_target, tiny_target_dir, other_tokenizer_dir, tmp_path):
    model, tokenizer = tiny_target
    other = AutoTokenizer.from_pretrained(other_tokenizer_dir)
    assert len(other) == len(tokenizer) and tokenizer_hash(other) != tokenizer_hash(tokenizer)
    head_dir = tmp_path / "head"
    build_head({"type": "eagle"}, model, tokenizer).save_pretrained(head_dir)
    assert json.loads((head_dir / "config.json").read_text())["tokenizer_hash"] == tokenizer_hash(tokenizer)

    load_head(head_dir, model, tokenizer)
    mismatch = f"tokenizer hash {tokenizer_hash(tokenizer)} in the head, {tokenizer_hash(other)} in the target"
    with pytest.raises(ValueError, match=f"{head_dir}: the head was trained with another tokenizer .*{mismatch}"):
        load_head(head_dir, model, other)
    with pytest.warns(UserWarning, match=mismatch):
        load_head(head_dir, model, other, allow_other_tokenizer=True)

    # Heads saved before heads recorded a tokenizer still load, with a warning.
    old = tmp_path / "old"
    build_head({"type": "eagle"}, model).save_pretrained(old)
    with pytest.warns(UserWarning, match="records no tokenizer hash"):
        load_head(old, model, other)

    # Export for a --target checks it too; the head's own target (no --target) is not reloaded.
    with pytest.raises(ValueError, match=mismatch):
        export_head(head_dir, "vllm", tmp_path / "out", target=str(other_tokenizer_dir))
    allowed = export_head(
        head_dir, "vllm", tmp_path / "out", target=str(other_tokenizer_dir), allow_other_tokenizer=True
    )
    assert (allowed / "config.json").is_file()
    assert (export_head(head_dir, "vllm", tmp_path / "out2", target=str(tiny_target_dir)) / "config.json").is_file()


def test_eval_refuses_a_head_of_another_tokenizer(tiny_target, other_tokenizer_dir, gsm8k_file, tmp_path):
    from headstart.eval.acceptance import main

    model, tokenizer = tiny_target
    head_dir = tmp_path / "head"
    build_head({"type": "eagle"}, model, tokenizer).save_pretrained(head_dir)
    argv = ["--target", str(other_tokenizer_dir), "--head", str(head_dir), "--method", "eagle"]
    argv += ["--bench", str(gsm8k_file), "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "r")]
    with pytest.raises(ValueError, match=f"tokenizer hash {tokenizer_hash(tokenizer)} in the head"):
        main(argv)
    with pytest.warns(UserWarning, match="another tokenizer"):
        report = main(argv + ["--allow-other-tokenizer"])
    assert report["methods"]["eagle"]["new_tokens"] == 4


# Item 16: two writers of one folder.

HOLDER = """
import sys
from headstart.core.io import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def hold_lock(folder):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_a_second_writer_is_refused_and_a_killed_holder_frees_the_folder(tiny_target_dir, gsm8k_file, tmp_path):
    out = tmp_path / "shards"
    holder = hold_lock(out)
    try:
        with pytest.raises(FolderLockedError, match=rf"{out} is being written by another process \(pid {holder.pid},"):
            run_capture(capture_config(tiny_target_dir, gsm8k_file, out, limit=4))
        parts = tmp_path / "regen.jsonl.parts"
        regen_holder = hold_lock(parts)
        regen = {"out": str(tmp_path / "regen.jsonl"), "max_new_tokens": 4}
        cfg = capture_config(tiny_target_dir, gsm8k_file, out, limit=2) | {"regenerate": regen}
        with pytest.raises(FolderLockedError, match=f"pid {regen_holder.pid}"):
            run_regenerate(cfg)
        regen_holder.kill()
        regen_holder.wait()
    finally:
        holder.kill()  # SIGKILL: the holder gets no chance to release anything
        holder.wait()
    assert (out / ".lock").exists()  # what a killed holder leaves: a file, not a lock
    run_capture(capture_config(tiny_target_dir, gsm8k_file, out, limit=4))
    assert len(ShardDataset(out)) == 4 and not (out / ".lock").exists()


# Item 17: a read-only output folder is not a full disk.


def test_an_immutable_folder_is_not_writable_not_full(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i needs CAP_LINUX_IMMUTABLE and ext4/xfs: no real unwritable folder for root here")
    try:
        free = shutil.disk_usage(folder).free
        with pytest.raises(NotWritableError, match=f"{folder} is not writable by this process"):
            check_free_disk(folder, free + 10**9)
        with pytest.raises(NotWritableError, match=f"{folder / 'shards'} cannot be made: {folder} is not writable"):
            output_lock(folder / "shards").__enter__()
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


READ_ONLY_CHECK = """
import sys
from pathlib import Path
from headstart.data_recipes.capture_plan import check_free_disk
try:
    check_free_disk(Path(sys.argv[1]) / "shards", 10**12)
except Exception as err:
    print(type(err).__name__, err)
"""


def test_a_read_only_mount_is_read_only_not_full(tmp_path):
    """A real read-only file system: a tmpfs mounted ro in a private mount namespace (needs CAP_SYS_ADMIN)."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) here")
    mount = f'mount -t tmpfs -o ro,size=64k tmpfs "$1" && exec {sys.executable} -c "$2" "$1"'
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", mount, "sh", str(tmp_path), READ_ONLY_CHECK],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if "mount" in done.stderr or "unshare" in done.stderr:
        pytest.skip(f"no private read-only mount here: {done.stderr.strip()}")
    assert done.stdout.startswith(f"NotWritableError [Errno 30] {tmp_path / 'shards'} cannot be made: "), done
    assert f"{tmp_path} is on a read-only file system" in done.stdout
    assert OutOfSpaceError.__name__ not in done.stdout


# Item 18: online training on data without assistant tokens.


def test_online_training_says_no_sample_has_assistant_tokens(tiny_target_dir, gsm8k_file, tiny_target):
    model, tokenizer = tiny_target
    cfg = train_config(capture_config(tiny_target_dir, gsm8k_file, "unused", max_length=8), online_capture=True)
    # 8 tokens hold the template's header and the question's start: no assistant token survives.
    message = "no sample has assistant tokens: the loss mask of all 48 conversations is empty within data.max_length=8"
    with pytest.raises(DataError, match=f"{gsm8k_file}: {message}"):
        load_data(cfg, model, tokenizer, aux=True, online_states=True)
