"""Training from shards reads a target's embedding, final norm and lm_head by name (``core.weights``): an index
pointing outside the folder or malformed, a file without the tensor it is said to hold, a config transformers
refuses, and borrowed tensors that do not fit the config are each refused naming the file, tensor and values."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from headstart.core.fingerprint import weights_hash
from headstart.core.weights import INDEX_NAME, SINGLE_NAME, CheckpointError, borrowed_model
from tests.helpers import save_tiny_llama

EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    # 6 heads of 8: hidden sizes that 6 does not divide are ones transformers' own config check refuses
    shape = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 1}
    return save_tiny_llama(tmp_path_factory.mktemp("r3w") / "target", **shape)


@pytest.fixture
def target_folder(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "target")


def sharded(folder):
    """``folder``'s one safetensors file as the single shard of an index; the index's weight_map."""
    (folder / SINGLE_NAME).rename(folder / "part-1.safetensors")
    weight_map = dict.fromkeys(load_file(folder / "part-1.safetensors"), "part-1.safetensors")
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def edit_tensors(folder, **changes):
    tensors = load_file(folder / SINGLE_NAME)
    tensors.update({name.replace("__", "."): value for name, value in changes.items()})
    save_file(tensors, folder / SINGLE_NAME, metadata={"format": "pt"})


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_an_index_entry_leading_outside_the_folder_is_refused_by_training_and_the_hash(target_folder, tmp_path, where):
    weight_map = sharded(target_folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(target_folder / "part-1.safetensors", outside / "x.safetensors")
    entry = str(outside / "x.safetensors") if where == "absolute" else "../outside/x.safetensors"
    (target_folder / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map | {EMBED: entry}}))
    said = rf"{INDEX_NAME}: weight_map entry '{EMBED}' -> '{entry}' \(.*\) leads outside"
    with pytest.raises(CheckpointError, match=said):
        borrowed_model(target_folder, CPU, torch.float32)
    with pytest.raises(CheckpointError, match=said):
        weights_hash(target_folder, "fp32")


@pytest.mark.parametrize(
    ("index", "said"),
    [
        ('{"weight_map": {"model.norm', r"not JSON \(Unterminated string"),
        ('{"metadata": {}}', "found weight_map None"),
        ('{"weight_map": ["part-1.safetensors"]}', r"found weight_map \['part-1.safetensors'\]"),
        ('[{"weight_map": {}}]', "found a list"),
        ('{"weight_map": {"model.norm.weight": 7}}', r"weight_map entry 'model.norm.weight' -> 7: a file name"),
        (
            '{"weight_map": {"model.norm.weight": "sub"}}',
            r"weight_map entry 'model.norm.weight' -> 'sub' \(.*\) is not",
        ),
    ],
    ids=["truncated", "no-weight-map", "list-map", "list-index", "number-entry", "folder-entry"],
)
def test_a_malformed_index_is_refused_naming_the_index_and_the_entry(target_folder, index, said):
    sharded(target_folder)
    (target_folder / "sub").mkdir()
    (target_folder / INDEX_NAME).write_text(index)
    with pytest.raises(CheckpointError, match=rf"^{target_folder / INDEX_NAME}: .*{said}"):
        borrowed_model(target_folder, CPU, torch.float32)


def test_an_index_naming_a_file_without_the_tensor_names_the_file_and_tensor(target_folder):
    weight_map = sharded(target_folder)
    tensors = load_file(target_folder / "part-1.safetensors")
    save_file({NORM: tensors.pop(NORM)}, target_folder / "part-2.safetensors")
    save_file(tensors, target_folder / "part-1.safetensors")
    (target_folder / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map | {EMBED: "part-2.safetensors"}}))
    with pytest.raises(CheckpointError, match=rf"^{target_folder / 'part-2.safetensors'}: holds no tensor '{EMBED}'"):
        borrowed_model(target_folder, CPU, torch.float32)


def test_a_config_transformers_refuses_names_its_file(target_folder):
    edit_config(target_folder, hidden_size=64)  # 64 is no multiple of the 6 attention heads
    with pytest.raises(
        CheckpointError, match=rf"^{target_folder / 'config.json'}: transformers refuses this config: .*64"
    ):
        borrowed_model(target_folder, CPU, torch.float32)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            {"hidden_size": 96},
            rf"'{EMBED}' \(the target's embed\) has shape \[300, 48\], but its config.json "
            r"\(vocab_size 300, hidden_size 96\) makes it \[300, 96\]",
        ),  # fmt: skip
        (
            {"vocab_size": 600},
            rf"'{EMBED}' \(the target's embed\) has shape \[300, 48\], but its config.json "
            r"\(vocab_size 600, hidden_size 48\) makes it \[600, 48\]",
        ),  # fmt: skip
    ],
)
def test_a_config_of_other_sizes_than_the_tensors_is_refused_naming_both(target_folder, change, said):
    edit_config(target_folder, **change)
    with pytest.raises(CheckpointError, match=rf"^{target_folder / SINGLE_NAME}: tensor {said}"):
        borrowed_model(target_folder, CPU, torch.float32)


@pytest.mark.parametrize(
    ("tensors", "said"),
    [
        (
            {"model__norm__weight": torch.ones(1)},
            rf"'{NORM}' \(the target's norm\) has shape \[1\], but its config.json "
            r"\(hidden_size 48\) makes it \[48\]",
        ),  # fmt: skip
        ({"model__embed_tokens__weight": torch.zeros(150, 48)}, r"has shape \[150, 48\], .* makes it \[300, 48\]"),
        ({"lm_head__weight": torch.zeros(300, 47)}, r"'lm_head.weight' \(the target's lm_head\) has shape \[300, 47\]"),
        ({"model__embed_tokens__weight": torch.ones(300, 48, dtype=torch.int8)}, r"is stored as torch.int8"),
    ],
    ids=["norm-of-one", "short-embedding", "narrow-lm-head", "int8-embedding"],
)
def test_borrowed_tensors_that_do_not_fit_the_config_are_refused_naming_file_and_tensor(target_folder, tensors, said):
    edit_tensors(target_folder, **tensors)
    with pytest.raises(CheckpointError, match=rf"^{target_folder / SINGLE_NAME}: tensor .*{said}"):
        borrowed_model(target_folder, CPU, torch.float32)
    with pytest.raises(CheckpointError, match=said):
        weights_hash(target_folder, "fp32")


def test_a_tokenizer_longer_than_the_embedding_is_refused_and_the_fitting_target_loads(target_folder, saved):
    with pytest.raises(
        CheckpointError, match=rf"'{EMBED}' \(the target's embed\) has 300 rows, but the tokenizer has 301"
    ):
        borrowed_model(target_folder, CPU, torch.float32, tokenizer_size=301)
    model = borrowed_model(target_folder, CPU, torch.bfloat16, tokenizer_size=300)
    stored = load_file(f"{saved}/{SINGLE_NAME}")
    assert torch.equal(model.get_input_embeddings().weight, stored[EMBED].to(torch.bfloat16))
    assert torch.equal(model.model.norm.weight, stored[NORM].to(torch.bfloat16))
