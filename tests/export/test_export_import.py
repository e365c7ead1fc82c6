"""Import: our exports come back as the same head (weights, config, draft outputs); published layouts import."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from headstart.heads import KVCache, NonFiniteWeights, load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head, main
from headstart.scripts.export.push_to_hub import stage
from tests.helpers import LAYER_IDS, TINY_LLAMA, make_head, save_tiny_llama

V = TINY_LLAMA["vocab_size"]


def draft_outputs(head, target, seed=0):
    """Every output a proposer reads from the head, on fixed inputs."""
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        if head.config.type == "medusa":
            return (head(states[-1]),)
        source = torch.cat([states[i] for i in LAYER_IDS], -1) if head.config.type == "eagle3" else states[-1]
        return head.draft_step(ids, head.first_features(source), torch.arange(8).expand(2, 8), KVCache())


ROUND_TRIPS = [
    ("eagle", "vllm", "eagle"),
    ("eagle", "sglang", "eagle"),
    ("eagle3", "vllm", "eagle3"),
    ("eagle3", "sglang", "eagle3"),
    ("eagle3", "speculators", "speculators"),
    ("medusa", "medusa", "medusa"),
]


@pytest.mark.parametrize(("head_type", "fmt", "source"), ROUND_TRIPS)
def test_export_then_import_gives_the_same_head(tiny_llama_from_dir, tiny_llama_dir, tmp_path, head_type, fmt, source):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, head_type)
    out = export_head(head_dir, fmt, tmp_path / "export")
    back = import_head(source, out, tmp_path / "back", tiny_llama_dir)
    original, imported = load_head(head_dir, tiny_llama_from_dir), load_head(back, tiny_llama_from_dir)
    assert imported.config == original.config
    a, b = original.state_dict(), imported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    for x, y in zip(draft_outputs(original, tiny_llama_from_dir), draft_outputs(imported, tiny_llama_from_dir)):
        assert torch.equal(x, y)


def as_speculators_trainer_writes(out):
    """Our speculators export rewritten as speculators 0.9.0's own checkpointer writes a draft (what its trainer
    wrote here, ../shared/FORMATS.md): ``layer_types`` for its one layer and no ``num_hidden_layers`` in
    ``transformer_layer_config``, an ``auto_map`` to a config.py beside it, bf16 weights, the trainer's state files."""
    config = json.loads((out / "config.json").read_text())
    layer = {k: v for k, v in config["transformer_layer_config"].items() if k != "num_hidden_layers"}
    config |= {"transformer_layer_config": layer | {"layer_types": ["full_attention"]}, "speculators_version": "0.9.0"}
    config |= {"auto_map": {"AutoConfig": "config.Eagle3SpeculatorConfig"}}
    (out / "config.json").write_text(json.dumps(config))
    (out / "config.py").write_text("raise SystemExit('never run')\n")
    for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        (out / name).write_bytes(b"not read")
    (out / "training_state.json").write_text("{}")
    tensors = load_file(str(out / "model.safetensors"))
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(bf16, str(out / "model.safetensors"))
    return config


def test_a_draft_as_the_speculators_trainer_writes_it_imports(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    """transformers 5.23 refused its decoder config (1 layer type against LlamaConfig's default 32 layers)."""
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    out = export_head(head_dir, "speculators", tmp_path / "export")
    config = as_speculators_trainer_writes(out)
    imported = load_head(import_head("speculators", out, tmp_path / "back", tiny_llama_dir), tiny_llama_from_dir)
    original = load_head(head_dir, tiny_llama_from_dir)
    assert imported.config.arch == original.config.arch
    a, b = original.state_dict(), imported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].to(b[k].dtype), b[k]) for k in a)
    # Its default draft layer: a 2048-token sliding window, the whole of the tiny target's context, or less.
    config["transformer_layer_config"] |= {"layer_types": ["sliding_attention"], "sliding_window": 2048}
    (out / "config.json").write_text(json.dumps(config))
    windowed = import_head("speculators", out, tmp_path / "window", tiny_llama_dir)
    assert load_head(windowed, tiny_llama_from_dir).config.arch == original.config.arch
    config["transformer_layer_config"]["sliding_window"] = 2047
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2047-token window, shorter than the target's 2048-token context"):
        import_head("speculators", out, tmp_path / "sliding", tiny_llama_dir)


@pytest.mark.parametrize(("fmt", "source"), [("vllm", "eagle3"), ("speculators", "speculators")])
def test_peagle_export_then_import_gives_the_same_head(tiny_llama_from_dir, tiny_llama_dir, tmp_path, fmt, source):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", parallel_drafting={"mask_token_id": 5})
    back = import_head(source, export_head(head_dir, fmt, tmp_path / "export"), tmp_path / "back", tiny_llama_dir)
    original, imported = load_head(head_dir, tiny_llama_from_dir), load_head(back, tiny_llama_from_dir)
    assert imported.config == original.config and imported.config.options.parallel_drafting.mask_token_id == 5
    a, b = original.state_dict(), imported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(original.mask_slots(1, 2)[1], imported.mask_slots(1, 2)[1])


def test_published_peagle_checkpoint_names_its_mask_token_as_vllm_reads_it(
    tiny_llama_from_dir, tiny_llama_dir, tmp_path
):
    # vLLM reads mask_token_id, pard_token or ptd_token_id, and mask_hidden of any shape (speculators: [1, 1, 3H]).
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", parallel_drafting={"mask_token_id": 5})
    out = export_head(head_dir, "vllm", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config | {"ptd_token_id": 9}))
    tensors = load_file(str(out / "model.safetensors"))
    save_file(tensors | {"mask_hidden": tensors["mask_hidden"][None]}, str(out / "model.safetensors"))
    imported = load_head(import_head("eagle3", out, tmp_path / "back", tiny_llama_dir), tiny_llama_from_dir)
    assert imported.config.options.parallel_drafting.mask_token_id == 9
    assert torch.equal(imported.mask_hidden, load_head(head_dir, tiny_llama_from_dir).mask_hidden)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has mask_hidden \\(P-EAGLE\\) but its config.json names no mask token"):
        import_head("eagle3", out, tmp_path / "again", tiny_llama_dir)


def test_bf16_head_round_trips_in_bf16(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    head = load_head(head_dir, tiny_llama_from_dir).to(torch.bfloat16)
    head.save_pretrained(head_dir)
    out = export_head(head_dir, "vllm", tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_head(import_head("eagle3", out, tmp_path / "back", tiny_llama_dir), tiny_llama_from_dir)
    assert back.fc.weight.dtype == torch.bfloat16 and torch.equal(back.fc.weight, head.fc.weight)


def eagle_repo_config(**extra):
    """A config.json as the EAGLE repo publishes it for this tiny target (Llama fields, one layer)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,  # a draft may use another MLP width than its target (64)
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": V,
        **extra,
    }


def layer_tensors(prefix, in_features, inner=48):
    g = torch.Generator().manual_seed(1)
    shapes = {
        "self_attn.q_proj.weight": (32, in_features),
        "self_attn.k_proj.weight": (16, in_features),
        "self_attn.v_proj.weight": (16, in_features),
        "self_attn.o_proj.weight": (32, 32),
        "post_attention_layernorm.weight": (32,),
        "mlp.gate_proj.weight": (inner, 32),
        "mlp.up_proj.weight": (inner, 32),
        "mlp.down_proj.weight": (32, inner),
    }
    return {prefix + k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_eagle_repo_eagle3_checkpoint_in_pytorch_model_bin(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    # SGLang-style config: layer ids only under eagle_config (the decoder layer whose output is taken).
    src = tmp_path / "published"
    src.mkdir()
    config = eagle_repo_config(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=100,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]},
    )
    (src / "config.json").write_text(json.dumps(config))
    state = layer_tensors("layers.0.", 64)
    state |= {"layers.0.input_layernorm.weight": torch.ones(32), "layers.0.hidden_norm.weight": torch.ones(32)}
    d2t = torch.full((100,), 200)  # draft ids 0..99 are target ids 200..299
    state |= {"fc.weight": torch.randn(32, 96), "norm.weight": torch.ones(32), "lm_head.weight": torch.randn(100, 32)}
    state |= {"d2t": d2t, "embed_tokens.weight": torch.randn(V, 32)}  # no t2d: rebuilt from d2t
    torch.save(state, src / "pytorch_model.bin")
    head = load_head(import_head("eagle3", src, tmp_path / "head", tiny_llama_dir), tiny_llama_from_dir)
    assert head.config.options.layer_ids == LAYER_IDS and head.config.options.draft_vocab_size == 100
    assert head.config.arch.intermediate_size == 48 and head.config.target == tiny_llama_dir
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, state["layers.0.self_attn.q_proj.weight"])
    assert head.target_ids(torch.tensor([0, 99])).tolist() == [200, 299] and head.t2d.sum() == 100
    logp, _ = draft_outputs(head, tiny_llama_from_dir)
    assert torch.isinf(logp[..., :200]).all() and torch.isfinite(logp[..., 200:]).all()


def test_eagle_repo_eagle1_checkpoint_with_bias_and_embedding(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    src = tmp_path / "published"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(eagle_repo_config()))
    state = layer_tensors("layers.0.", 32) | {"fc.weight": torch.randn(32, 64), "fc.bias": torch.randn(32)}
    save_file(state | {"embed_tokens.weight": torch.randn(V, 32)}, str(src / "model.safetensors"))
    head = load_head(import_head("eagle", src, tmp_path / "head", tiny_llama_dir), tiny_llama_from_dir)
    assert head.config.options.fc_bias is True and torch.equal(head.fc.bias, state["fc.bias"])
    assert all(torch.isfinite(t).all() for t in draft_outputs(head, tiny_llama_from_dir))


def test_medusa_repo_checkpoint_in_pt(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    src = tmp_path / "published"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"})
    )
    state = {}
    for k in range(2):
        state |= {
            f"{k}.0.linear.weight": torch.randn(32, 32),
            f"{k}.0.linear.bias": torch.randn(32),
            f"{k}.1.weight": torch.randn(V, 32),
        }
    torch.save(state, src / "medusa_lm_head.pt")
    head = load_head(import_head("medusa", src, tmp_path / "head", tiny_llama_dir), tiny_llama_from_dir)
    assert head.config.options.num_heads == 2 and torch.equal(head.medusa_head[1][1].weight, state["1.1.weight"])


def test_import_errors_name_the_problem(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    out = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "export")
    with pytest.raises(ValueError, match="vocab size 300 vs 320"):
        import_head("eagle3", out, tmp_path / "back", save_tiny_llama(tmp_path / "t2", vocab_size=320))
    with pytest.raises(ValueError, match="hidden size 32 vs 64"):
        import_head("eagle3", out, tmp_path / "back", save_tiny_llama(tmp_path / "t3", hidden_size=64))
    with pytest.raises(ValueError, match="do not fit a eagle head: missing layers.0.*unexpected midlayer"):
        import_head("eagle", out, tmp_path / "back", tiny_llama_dir)
    with pytest.raises(ValueError, match="has no 'medusa_num_heads': is it a medusa checkpoint"):
        import_head("medusa", out, tmp_path / "back", tiny_llama_dir)
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        import_head("eagle3", out, tmp_path / "back", tiny_llama_dir)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize(
    "damage, said",
    [(b'{"architectures": [', "not UTF-8 JSON"), (b"\xff\xfe{}", "not UTF-8 JSON"), (b"[1, 2]", "a JSON list")],
)
def test_a_malformed_config_json_is_refused_naming_the_file(
    tiny_llama_from_dir, tiny_llama_dir, tmp_path, damage, said
):
    out = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "export")
    (out / "config.json").write_bytes(damage)
    with pytest.raises(ValueError, match=re.escape(f"{out / 'config.json'}: {said}")):
        import_head("eagle3", out, tmp_path / "back", tiny_llama_dir)
    assert not (tmp_path / "back").exists()


def test_cli(tiny_llama_from_dir, tiny_llama_dir, tmp_path, capsys):
    out = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "speculators", tmp_path / "export")
    main(["--from", "speculators", str(out), "--out", str(tmp_path / "back"), "--target", tiny_llama_dir])
    assert (tmp_path / "back" / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["--from", "eagle3", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"), "--target", tiny_llama_dir])
    assert exit_info.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_an_out_folder_with_files_is_refused_unless_overwrite(tiny_llama_from_dir, tiny_llama_dir, tmp_path, capsys):
    src = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "export")
    trained = make_head(
        tiny_llama_from_dir, tmp_path, "eagle3", name="trained"
    )  # hours of training: config.json + weights
    (trained / "tree.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in trained.iterdir()}
    args = ["--from", "eagle3", str(src), "--out", str(trained), "--target", tiny_llama_dir]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--out {trained} exists and holds" in err and "--overwrite" in err
    assert "'config.json'" in err and "'tree.json'" in err
    assert {p.name: p.read_bytes() for p in trained.iterdir()} == before  # untouched
    with pytest.raises(ValueError, match="is the checkpoint folder itself"):
        import_head("eagle3", src, src, tiny_llama_dir, overwrite=True)
    with pytest.raises(ValueError, match="holds the checkpoint folder"):
        import_head("eagle3", src, tmp_path, tiny_llama_dir, overwrite=True)
    (tmp_path / "empty").mkdir()
    assert (import_head("eagle3", src, tmp_path / "empty", tiny_llama_dir) / "model.safetensors").is_file()
    main([*args, "--overwrite"])
    assert sorted(p.name for p in trained.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(
        load_head(trained, tiny_llama_from_dir).fc.weight, load_head(tmp_path / "head", tiny_llama_from_dir).fc.weight
    )


def sharded_checkpoint(target, tmp_path):
    """Our EAGLE-3 export split in two shards with a model.safetensors.index.json, as the hub shards weights."""
    src = export_head(make_head(target, tmp_path, "eagle3"), "vllm", tmp_path / "sharded")
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(src / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return src, weight_map


def test_a_sharded_index_reads_only_files_inside_its_folder(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    src, weight_map = sharded_checkpoint(tiny_llama_from_dir, tmp_path)
    head = load_head(import_head("eagle3", src, tmp_path / "back", tiny_llama_dir), tiny_llama_from_dir)
    original = load_head(tmp_path / "head", tiny_llama_from_dir).state_dict()
    assert all(torch.equal(t, original[k]) for k, t in head.state_dict().items())
    outside = tmp_path / "outside.safetensors"
    save_file({"secret": torch.ones(2)}, str(outside))
    index = src / "model.safetensors.index.json"
    (src / "link.safetensors").symlink_to(outside)
    for name in (str(outside), "../outside.safetensors", "link.safetensors"):
        index.write_text(json.dumps({"weight_map": {**weight_map, "fc.weight": name}}))
        with pytest.raises(ValueError, match=rf"weight_map entry 'fc.weight' -> '{re.escape(name)}'.*leads outside"):
            import_head("eagle3", src, tmp_path / f"x{len(name)}", tiny_llama_dir)
    index.write_text(json.dumps({"weight_map": {**weight_map, "fc.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="'fc.weight' -> 'gone.safetensors'.*does not exist"):
        import_head("eagle3", src, tmp_path / "y", tiny_llama_dir)


def test_a_hub_cache_snapshot_imports_through_its_blob_links(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    # huggingface_hub's cache: <repo>/snapshots/<revision>/<file> links to <repo>/blobs/<hash>.
    export = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "export")
    repo = tmp_path / "models--acme--eagle3"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (export / name).rename(repo / "blobs" / f"blob{i}")
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    head = load_head(import_head("eagle3", snapshot, tmp_path / "back", tiny_llama_dir), tiny_llama_from_dir)
    assert torch.equal(head.fc.weight, load_head(tmp_path / "head", tiny_llama_from_dir).fc.weight)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "head" / "model.safetensors")  # not its blobs
    with pytest.raises(ValueError, match="model.safetensors leads outside"):
        import_head("eagle3", snapshot, tmp_path / "back2", tiny_llama_dir)


def test_a_pytorch_model_bin_that_is_not_a_tensor_file_is_refused_naming_it(
    tiny_llama_from_dir, tiny_llama_dir, tmp_path
):
    out = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "export")
    (out / "model.safetensors").unlink()
    (out / "pytorch_model.bin").write_bytes(b"<html>not found</html>")  # a download that went wrong
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not a tensor file loadable with torch\.load"):
        import_head("eagle3", out, tmp_path / "back", tiny_llama_dir)


def poison(path, name, value):
    """Write ``value`` (NaN or infinity) into one element of the tensor ``name`` of the safetensors file ``path``."""
    tensors = load_file(str(path))
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_head_with_a_nan_or_inf_weight_is_refused_by_load_export_push_and_import(
    tiny_llama_from_dir, tiny_llama_dir, tmp_path
):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    exported = export_head(head_dir, "vllm", tmp_path / "export")
    # An EAGLE-3 head edited in place: eval and autotune load it, export and push write it.
    weights = head_dir / "model.safetensors"
    poison(weights, "fc.weight", float("nan"))
    poison(weights, "norm.weight", float("inf"))
    said = (
        rf"^{weights}: tensors holding NaN or infinity: fc.weight \(1 NaN, 0 inf of \d+\), norm.weight \(0 NaN, 1 inf"
    )
    with pytest.raises(NonFiniteWeights, match=said):
        load_head(head_dir, tiny_llama_from_dir)
    with pytest.raises(NonFiniteWeights, match=said):
        export_head(head_dir, "vllm", tmp_path / "export-nan")
    with pytest.raises(NonFiniteWeights, match=said):
        stage(head_dir, "acme/demo", "vllm", tmp_path / "staged", target_id="acme/t")
    assert not (tmp_path / "export-nan").exists() and not (tmp_path / "staged").exists()
    # A published checkpoint with a NaN: refused naming the tensor, nothing written.
    poison(exported / "model.safetensors", "fc.weight", float("nan"))
    with pytest.raises(
        NonFiniteWeights, match=rf"the eagle3 checkpoint in {exported} .*: tensors holding NaN .*: fc.weight"
    ):
        import_head("eagle3", exported, tmp_path / "back", tiny_llama_dir)
    assert not (tmp_path / "back").exists()
