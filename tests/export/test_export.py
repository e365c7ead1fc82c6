"""Export: every file, config field, weight name and shape the engines' loaders read; bad input; atomic output.

The names and fields asserted here are the ones vLLM 0.33 (llama_eagle.py, llama_eagle3.py, the
speculators config reader), SGLang 0.5.23 (llama_eagle.py, llama_eagle3.py) and the Medusa repo read:
a rename in our heads or in the export breaks a test here even without the engines installed.
"""

import json
import os
import shlex

import pytest
import torch
from safetensors.torch import load_file

from headstart.data_recipes.shards import write_shard
from headstart.scripts.export import command as export_mod
from headstart.scripts.export.command import export_head, main
from tests.helpers import LAYER_IDS, make_head, save_tiny_llama

V, H, INNER, LAYERS, HEADS, KV, HEAD_DIM = 300, 32, 64, 6, 4, 2, 8  # tiny_llama()


def read_export(out, weights="model.safetensors"):
    return json.loads((out / "config.json").read_text()), load_file(str(out / weights))


def shapes(tensors):
    return {k: tuple(v.shape) for k, v in tensors.items()}


def eagle3_layer_shapes(prefix):
    return {
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}hidden_norm.weight": (H,),
        f"{prefix}self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.k_proj.weight": (KV * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.v_proj.weight": (KV * HEAD_DIM, 2 * H),
        f"{prefix}self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        f"{prefix}post_attention_layernorm.weight": (H,),
        f"{prefix}mlp.gate_proj.weight": (INNER, H),
        f"{prefix}mlp.up_proj.weight": (INNER, H),
        f"{prefix}mlp.down_proj.weight": (H, INNER),
    }


EAGLE3_TOP = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (200, H), "d2t": (200,), "t2d": (V,)}


def check_decoder_config(cfg):
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (H, INNER, HEAD_DIM)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (HEADS, KV)
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle3_repo_layout_is_what_vllm_and_sglang_load(tiny_llama_from_dir, tmp_path, fmt):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    cfg, tensors = read_export(export_head(head_dir, fmt, tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    check_decoder_config(cfg)
    assert cfg["draft_vocab_size"] == 200 and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS  # vLLM: id i = input of layer i = ours
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang captures id + 1
    assert {k: cfg[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False
    )
    assert shapes(tensors) == {**EAGLE3_TOP, **eagle3_layer_shapes("midlayer.")}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # d2t holds OFFSETS: target id = draft id + d2t[draft id] (vLLM compute_logits, SGLang hot_token_id).
    assert (torch.arange(200) + tensors["d2t"]).tolist() == list(range(100, 300))
    assert torch.equal(tensors["t2d"], torch.arange(V) >= 100)


def test_eagle3_vllm_and_sglang_exports_are_one_folder(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    a, b = (export_head(head_dir, fmt, tmp_path / fmt) for fmt in ("vllm", "sglang"))
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_speculators_layout(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    cfg, tensors = read_export(export_head(head_dir, "speculators", tmp_path / "out"))
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    check_decoder_config(cfg["transformer_layer_config"])
    assert cfg["draft_vocab_size"] == 200 and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    # Written explicitly: vLLM's speculators reader defaults norm_before_residual to true.
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["default_proposal_method"] in [m["proposal_type"] for m in spec["proposal_methods"]]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3  # vLLM's num_speculative_tokens
    assert spec["verifier"] == {"name_or_path": tiny_llama_dir, "architectures": ["LlamaForCausalLM"]}
    assert shapes(tensors) == {**EAGLE3_TOP, **eagle3_layer_shapes("layers.0.")}


def test_peagle_exports_carry_mask_hidden_and_the_mask_token(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    # vLLM 0.32 (llama_eagle3.py) loads any key holding "mask_hidden" as [1, num_aux * target_hidden] and
    # reads the top-level mask_token_id; speculators' peagle type maps to eagle3 with parallel drafting.
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", parallel_drafting={"mask_token_id": 7}, ttt_steps=4)
    mask_hidden = load_file(str(head_dir / "model.safetensors"))["mask_hidden"]
    cfg, tensors = read_export(export_head(head_dir, "vllm", tmp_path / "out"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["mask_token_id"] == 7
    assert shapes(tensors) == {**EAGLE3_TOP, **eagle3_layer_shapes("midlayer."), "mask_hidden": (1, 3 * H)}
    assert torch.equal(tensors["mask_hidden"], mask_hidden) and "embed_tokens.weight" not in tensors
    card = (tmp_path / "out" / "README.md").read_text()
    spec = {"method": "eagle3", "model": str(tmp_path / "out"), "num_speculative_tokens": 4, "parallel_drafting": True}
    assert f"vllm serve {tiny_llama_dir} --speculative-config '{json.dumps(spec)}'" in card
    assert "P-EAGLE" in card and "sglang.launch_server" not in card and "sgl-project/sglang#23171" in card
    cfg, tensors = read_export(export_head(head_dir, "speculators", tmp_path / "spec"))
    assert (cfg["speculators_model_type"], cfg["architectures"], cfg["mask_token_id"]) == (
        "peagle",
        ["PEagleSpeculator"],
        7,
    )
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # every trained depth
    assert torch.equal(tensors["mask_hidden"], mask_hidden) and "layers.0.hidden_norm.weight" in tensors
    with pytest.raises(ValueError, match=r"P-EAGLE head .* SGLang 0\.5\.23 cannot draft"):
        export_head(head_dir, "sglang", tmp_path / "sglang")
    # A plain EAGLE-3 head's export has neither.
    cfg, tensors = read_export(
        export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3", "plain"), "vllm", tmp_path / "p")
    )
    assert "mask_token_id" not in cfg and "mask_hidden" not in tensors


def test_full_draft_vocab_writes_no_d2t(tiny_llama_from_dir, tmp_path):
    # vLLM creates draft_id_to_target_id only when the draft vocab is smaller: a d2t would not load.
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", draft_vocab_size=V)
    for fmt in ("vllm", "speculators"):
        cfg, tensors = read_export(export_head(head_dir, fmt, tmp_path / fmt))
        assert cfg["draft_vocab_size"] == V and "d2t" not in tensors and "t2d" not in tensors


EAGLE_LAYER = {
    "layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
    "layers.0.self_attn.k_proj.weight": (KV * HEAD_DIM, H),
    "layers.0.self_attn.v_proj.weight": (KV * HEAD_DIM, H),
    "layers.0.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "layers.0.post_attention_layernorm.weight": (H,),
    "layers.0.mlp.gate_proj.weight": (INNER, H),
    "layers.0.mlp.up_proj.weight": (INNER, H),
    "layers.0.mlp.down_proj.weight": (H, INNER),
}


def test_eagle_layouts_for_vllm_and_sglang(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle")
    cfg, tensors = read_export(export_head(head_dir, "vllm", tmp_path / "vllm"))
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"]  # vLLM keeps names starting with "Eagle"
    check_decoder_config(cfg)
    assert shapes(tensors) == {"fc.weight": (H, 2 * H), **EAGLE_LAYER}  # no input_layernorm, no fc.bias
    cfg, tensors = read_export(export_head(head_dir, "sglang", tmp_path / "sglang"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's EntryClass, looked up as written
    assert shapes(tensors) == {"fc.weight": (H, 2 * H), "fc.bias": (H,), **EAGLE_LAYER}
    assert not tensors["fc.bias"].any()  # SGLang's fc always has a bias: zero reproduces ours


def test_eagle_with_fc_bias_cannot_go_to_vllm(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle", fc_bias=True)
    with pytest.raises(ValueError, match="fc bias.*--format sglang"):
        export_head(head_dir, "vllm", tmp_path / "out")
    _, tensors = read_export(export_head(head_dir, "sglang", tmp_path / "out"))
    assert tensors["fc.bias"].any()


def test_a_refusal_lists_only_the_formats_this_head_takes(tiny_llama_from_dir, tmp_path):
    """An EAGLE-1 head with an fc bias: its type has vllm and sglang layouts, but vLLM's cannot hold this one."""
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle", fc_bias=True)
    with pytest.raises(ValueError, match=r"as 'speculators': .*; formats this head takes: sglang$"):
        export_head(head_dir, "speculators", tmp_path / "out")
    with pytest.raises(ValueError, match=r"fc bias.*; formats this head takes: sglang$"):
        export_head(head_dir, "vllm", tmp_path / "out")
    plain = make_head(tiny_llama_from_dir, tmp_path, "eagle", name="plain")
    with pytest.raises(ValueError, match=r"; formats this head takes: vllm, sglang$"):
        export_head(plain, "speculators", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_medusa_layout(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "medusa", num_heads=3)
    out = export_head(head_dir, "medusa", tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "medusa_lm_head.safetensors"]
    cfg, tensors = read_export(out, "medusa_lm_head.safetensors")
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == tiny_llama_dir
    expected = {}
    for k in range(3):
        expected |= {f"{k}.0.linear.weight": (H, H), f"{k}.0.linear.bias": (H,), f"{k}.1.weight": (V, H)}
    assert shapes(tensors) == expected


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_medusa_to_an_engine_says_it_is_not_served(tiny_llama_from_dir, tmp_path, fmt):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "medusa")
    with pytest.raises(ValueError, match="no longer serve Medusa.*--format medusa.*eagle3"):
        export_head(head_dir, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_medusa_with_different_blocks_cannot_go_to_the_medusa_repo(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "medusa", num_layers=2)
    with pytest.raises(ValueError, match="repeats one block"):
        export_head(head_dir, "medusa", tmp_path / "out")


@pytest.mark.parametrize(
    ("head_type", "fmt", "match"), [("eagle", "speculators", "no EAGLE-1"), ("eagle3", "medusa", "Medusa heads only")]
)
def test_formats_that_cannot_hold_the_head(tiny_llama_from_dir, tmp_path, head_type, fmt, match):
    with pytest.raises(ValueError, match=match):
        export_head(make_head(tiny_llama_from_dir, tmp_path, head_type), fmt, tmp_path / "out")


def test_a_head_of_another_target_names_the_mismatch(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    wide = save_tiny_llama(tmp_path / "wide", hidden_size=64)
    with pytest.raises(ValueError, match="hidden size 32 vs 64"):
        export_head(head_dir, "vllm", tmp_path / "out", target=wide)
    other_vocab = save_tiny_llama(tmp_path / "vocab", vocab_size=320)
    with pytest.raises(ValueError, match="vocab size 300 vs 320"):
        export_head(head_dir, "vllm", tmp_path / "out", target=other_vocab)
    with pytest.raises(FileNotFoundError, match="cannot read the target's config"):
        export_head(head_dir, "vllm", tmp_path / "out", target=str(tmp_path / "nowhere"))
    assert not (tmp_path / "out").exists()


def test_missing_or_wrong_files_are_named(tiny_llama_from_dir, tmp_path):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        export_head(tmp_path / "nothing", "vllm", tmp_path / "out")
    state = load_file(str(head_dir / "model.safetensors"))
    del state["norm.weight"]
    state["lm_head.weight"] = state["lm_head.weight"][:10]
    from safetensors.torch import save_file

    save_file(state, str(head_dir / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing norm.weight; lm_head.weight has shape \(10, 32\), expected \(200, 32\)"
    ):
        export_head(head_dir, "vllm", tmp_path / "out")
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing model.safetensors"):
        export_head(head_dir, "vllm", tmp_path / "out")


def test_out_is_atomic_and_never_clobbers_other_files(tiny_llama_from_dir, tmp_path, monkeypatch):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    out = export_head(head_dir, "vllm", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_head(head_dir, "speculators", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head", "out"]  # no temp dir left behind
    monkeypatch.undo()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="would delete"):
        export_head(head_dir, "vllm", tmp_path / "mine")
    with pytest.raises(ValueError, match="the head folder itself"):
        export_head(head_dir, "vllm", head_dir)


def test_model_card_has_the_serve_commands(tiny_llama_from_dir, tiny_llama_dir, tmp_path):
    out = export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), "vllm", tmp_path / "out")
    card = (out / "README.md").read_text()
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    assert f"vllm serve {tiny_llama_dir} --speculative-config '{spec}'" in card
    assert (
        f"python -m sglang.launch_server --model-path {tiny_llama_dir} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out}"
    ) in card
    assert f"`{tiny_llama_dir}`" in card and "[1, 3, 5]" in card
    medusa_card = (
        export_head(make_head(tiny_llama_from_dir, tmp_path, "medusa", "m"), "medusa", tmp_path / "m-out") / "README.md"
    ).read_text()
    assert "no longer serve Medusa" in medusa_card and "vllm serve" not in medusa_card


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_the_model_cards_commands_keep_a_path_with_a_space_or_a_semicolon_one_argument(
    tiny_llama_from_dir, tmp_path, fmt
):
    """Pasted into a shell, an unquoted ``--speculative-draft-model-path <out>`` would split at the space and run
    what follows the ``;``."""
    out = tmp_path / "my exports; touch pwned"
    card = (export_head(make_head(tiny_llama_from_dir, tmp_path, "eagle3"), fmt, out) / "README.md").read_text()
    commands = [block.split("\n```")[0] for block in card.split("```bash\n")[1:]]
    assert len(commands) >= 2
    for command in commands:
        words = shlex.split(command)
        config = next((json.loads(w) for w in words if w.startswith("{")), {})
        assert str(out) in words or config.get("model") == str(out) or str(out) + "-sglang" in words, command


def test_cli(tiny_llama_from_dir, tmp_path, capsys):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle")
    main(["--head", str(head_dir), "--format", "sglang", "--out", str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out and (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["--head", str(head_dir), "--format", "speculators", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2 and "no EAGLE-1" in capsys.readouterr().err


def test_out_holding_a_head_folder_is_refused_unless_overwrite(tiny_llama_from_dir, tmp_path, capsys):
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
    other = make_head(tiny_llama_from_dir, tmp_path, "eagle3", name="other")  # config.json + model.safetensors, no card
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    argv = ["--head", str(head_dir), "--format", "vllm", "--out", str(other)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "['config.json', 'model.safetensors'], which replacing it would delete" in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    with pytest.raises(ValueError, match="holds the head folder"):
        export_head(head_dir, "vllm", tmp_path, overwrite=True)
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        export_head(head_dir, "vllm", tmp_path / "notes.txt", overwrite=True)
    main([*argv, "--overwrite"])  # replaced whole: the export and its settings, nothing of the head folder
    files = ["README.md", "config.json", "export_config.yaml", "model.safetensors"]
    assert sorted(p.name for p in other.iterdir()) == files


def test_every_safetensors_file_gets_the_mode_of_any_new_file(tiny_llama_from_dir, tmp_path):
    mask = os.umask(0o027)  # not the usual 022: the mode must follow the umask, not be a constant
    try:
        write_shard(tmp_path / "shard-00000.safetensors", {"x": torch.zeros(2)}, "fp")
        head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3")
        out = export_head(head_dir, "vllm", tmp_path / "out")
        (tmp_path / "plain.txt").write_text("any new file")
    finally:
        os.umask(mask)
    files = [tmp_path / "shard-00000.safetensors", *head_dir.iterdir(), *out.iterdir(), tmp_path / "plain.txt"]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == {name: oct(0o640) for name in modes} and len(modes) == 7


def test_a_head_import_would_refuse_is_not_exported(tiny_llama_from_dir, tmp_path, capsys):
    # P-EAGLE's mask token must be a row of the target's embedding, as its build and import require.
    head_dir = make_head(tiny_llama_from_dir, tmp_path, "eagle3", parallel_drafting={"mask_token_id": 5})
    path = head_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"parallel_drafting": {"mask_token_id": V}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--head", str(head_dir), "--format", "vllm", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{path}: head.parallel_drafting.mask_token_id {V} is not a token" in err
    assert not (tmp_path / "out").exists()
