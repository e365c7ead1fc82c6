import json
import math
import os
import shutil

import pytest
import torch

from headstart.core.config_files import ConfigError, apply_overrides, load_config, save_config
from headstart.core.errors import DataError
from headstart.core.io import atomic_dir, atomic_path, atomic_write_text, read_jsonl
from headstart.core.models import load_model
from headstart.core.runtime import cosine_with_warmup, mix_seed, resolve_device, resolve_dtype, slow_dtype_warning
from headstart.core.weights import CheckpointError
from headstart.data_recipes.capture import run_capture
from tests.helpers import REPO, base_config, save_tiny_llama


def test_overrides_parse_yaml_values_and_create_sections():
    cfg = apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=[1, 2]", "new.deep.key=true", "s=hello"])
    assert cfg == {"a": {"b": 2.5, "c": [1, 2]}, "new": {"deep": {"key": True}}, "s": "hello"}


def test_override_errors_name_the_problem():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a' is a value"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_load_config_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    save_config({"lr": 0.001, "head": {"type": "eagle3"}}, path)
    assert load_config(path, ["head.type=medusa"]) == {"lr": 0.001, "head": {"type": "medusa"}}
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_atomic_path_keeps_old_file_when_writer_fails(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "complete")
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "complete"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_atomic_dir_replaces_whole_directory(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("killed")
    assert sorted(os.listdir(out)) == ["a"]
    with atomic_dir(out) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(os.listdir(out)) == ["c"]
    assert os.listdir(tmp_path) == ["model"]


def test_runtime_resolution():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_named_as_slow(native_bf16, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    cpu = torch.device("cpu")
    assert slow_dtype_warning(cpu, torch.float32) is None
    assert slow_dtype_warning(torch.device("cuda", 0), torch.bfloat16) is None
    why = slow_dtype_warning(cpu, torch.bfloat16)
    assert (why is None) == native_bf16
    if not native_bf16:
        assert "no native bf16" in why and "set the dtype to fp32" in why
        with pytest.warns(UserWarning, match=r"demo-target: bf16 on this CPU .* no native bf16"):
            load_model(str(REPO / "assets" / "demo-target"), "cpu", "bf16")


def test_read_jsonl_names_each_line_and_skips_blank_ones(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n[2, 3]\n{oops\n"\xe9"\n7\n')
    bad: list[DataError] = []
    assert list(read_jsonl(path, on_bad_record=bad.append)) == [
        (f"{path}:1", {"a": 1}),
        (f"{path}:4", [2, 3]),
        (f"{path}:7", 7),
    ]
    assert [str(err) for err in bad] == [
        f"{path}:5: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{path}:6: not UTF-8 text (byte 0xe9 at byte 2 of the line): re-encode the file as UTF-8",
    ]
    assert [err.location for err in bad] == [f"{path}:5", f"{path}:6"]
    with pytest.raises(DataError, match=rf"^{path}:5: not valid JSON"):
        list(read_jsonl(path))


def test_every_jsonl_reader_raises_the_one_bad_record_error(tmp_path, monkeypatch):
    """Training data, benchmark prompts, the demo models' GSM8K rows and engine verification's prompts."""
    from headstart.data_recipes.bench import load_bench
    from headstart.data_recipes.sources import read_records
    from headstart.scripts.dev.build_demo_models import read_gsm8k
    from headstart.scripts.export import verify_engines

    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "What is 2+2?", "answer": "4"}\n{"question": "q", "answer"\n')
    monkeypatch.setattr(verify_engines, "DATA", str(path))
    readers = {
        "read_records": lambda: list(read_records(str(path))),
        "load_bench": lambda: load_bench(path),
        "read_gsm8k": lambda: read_gsm8k(path),
        "verify_engines.prompts": lambda: verify_engines.prompts(2),
    }
    for name, read in readers.items():
        with pytest.raises(DataError) as err:
            read()
        assert type(err.value) is DataError, name
        assert str(err.value) == f"{path}:2: not valid JSON (Expecting ':' delimiter at column 27)", name


def test_mix_seed_folds_its_parts_in_base_1_000_003():
    assert mix_seed(7) == 7
    assert mix_seed(3, 5) == 3 * 1_000_003 + 5
    assert mix_seed(2, 3, 4) == (2 * 1_000_003 + 3) * 1_000_003 + 4
    assert mix_seed(0, 0, 9) == 9  # seed 0: the counters are their own seeds
    assert len({mix_seed(s, e, c) for s in range(4) for e in range(4) for c in range(4)}) == 64
    big = mix_seed(2**70, 1)
    assert big == (2**70 * 1_000_003 + 1) % 2**64
    torch.Generator().manual_seed(big)  # within what torch accepts


def test_training_data_order_is_the_one_runs_so_far_used():
    """Each epoch's order is seeded ``seed * 1_000_003 + epoch + 1``, as before mix_seed: the trained demo
    heads (and the figures in docs/BENCHMARKS.md) come out the same."""
    from headstart.train.data import epoch_order

    ids = list(range(100, 130))
    for seed, epoch in [(0, 0), (3, 1), (11, 4)]:
        order = torch.randperm(30, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1)).tolist()
        assert epoch_order(ids, seed, epoch) == [ids[i] for i in order]


def test_lr_schedule_is_transformers_decay_after_a_warmup_one_step_ahead():
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 4, 20, min_lr_rate=0.1)
    theirs = schedule.lr_lambdas[0]
    ours = [cosine_with_warmup(step, warmup=4, total=20, min_ratio=0.1) for step in range(25)]
    assert ours[:4] == [0.25, 0.5, 0.75, 1.0] == [theirs(step + 1) for step in range(4)]
    assert ours[4:21] == [theirs(step) for step in range(4, 21)]  # the decay, to the bit
    assert ours[12] == 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16))
    assert ours[20:] == [0.1] * 5  # the floor at the last step and after
    assert cosine_with_warmup(0, warmup=0, total=10, min_ratio=0.0) == 1.0  # no warm-up: the decay from step 0


def test_the_loader_asks_for_sdpa_only_where_the_family_has_it(tmp_path, tiny_llama_dir):
    # gpt-oss's attention sinks have no SDPA kernel in transformers (it refuses the request): the family's own
    # eager attention, and its hidden states come back as capture reads them.
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt-oss")
    model = load_model(str(tmp_path / "gpt-oss"), "cpu")
    assert model.config._attn_implementation == "eager"
    states = model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    assert len(states) == 3 and states[-1].shape == (1, 4, 64)
    assert load_model(str(tiny_llama_dir), "cpu").config._attn_implementation == "sdpa"
    # target.attn_implementation (--attn-implementation) overrides the choice; a kernel the family lacks is named.
    assert load_model(str(tiny_llama_dir), "cpu", attention="eager").config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"gpt-oss: target.attn_implementation 'sdpa' cannot load it: .*GptOss"):
        load_model(str(tmp_path / "gpt-oss"), "cpu", attention="sdpa")


def without_tensor(src, dst, name):
    """A copy of the model folder ``src`` at ``dst`` whose model.safetensors lacks the tensor ``name``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_target_missing_a_weight_is_refused_by_name_before_capture_writes(tiny_target_dir, gsm8k_file, tmp_path):
    # transformers would draw the missing tensor at random (another draw in each process) and capture shards from it.
    gone = "model.layers.3.mlp.down_proj.weight"
    target = without_tensor(tiny_target_dir, tmp_path / "target", gone)
    said = rf"^{target}: 1 weights of the llama model .* not in {target / 'model.safetensors'} \({gone}\): .*truncated"
    with pytest.raises(CheckpointError, match=said):
        load_model(str(target), "cpu")
    shards = tmp_path / "shards"
    with pytest.raises(CheckpointError, match=said):
        run_capture(base_config(target, gsm8k_file, shards, tmp_path / "run", "eagle3"))
    assert not shards.exists()
    # A tied lm_head is not in the checkpoint and not missing; the full checkpoint loads as before.
    assert load_model(save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True), "cpu").config.tie_word_embeddings
    assert load_model(str(tiny_target_dir), "cpu")


def test_a_moe_checkpoint_under_a_dense_config_is_refused(tiny_target_dir, tmp_path):
    # Every MLP of a dense Qwen3 is missing, and every expert has no place in it: both are named.
    from transformers import AutoTokenizer

    from headstart.scripts.dev.tiny_families import save_target

    save_target(tmp_path / "moe", "qwen3_moe", AutoTokenizer.from_pretrained(tiny_target_dir))
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    config |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_model(str(tmp_path / "moe"), "cpu")
    message = str(err.value)
    assert "weights of the qwen3 model its config.json describes are not in" in message
    assert "model.layers.0.mlp.gate_proj.weight" in message
    assert "decoder tensors in" in message and "model.layers.0.mlp.experts.0." in message
    assert "(18 in all)" in message and "model_type (qwen3) is not the family of these weights" in message


def test_a_targets_mtp_layer_loads_and_a_stray_decoder_tensor_is_still_refused(tmp_path):
    # transformers leaves the MTP layer out of the model (heads/mtp.py reads it): not a bad load; a tensor of no
    # layer at all still is.
    from safetensors.torch import load_file, save_file

    from headstart.scripts.dev.tiny_mtp_targets import save_tiny_mtp_target

    folder = save_tiny_mtp_target(tmp_path / "mimo", "mimo")
    assert load_model(folder, "cpu").config.num_nextn_predict_layers == 1
    weights = tmp_path / "mimo" / "model.safetensors"
    save_file(load_file(weights) | {"model.extra.weight": torch.zeros(2)}, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 decoder tensors in .* \(model.extra.weight\)"):
        load_model(folder, "cpu")
