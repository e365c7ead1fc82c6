"""Drafts written by the peers' own code import, decode and export back (``make verify-engines`` runs these).

speculators 0.9.0 is installed in the engines venv only, so its own trainer writes each draft there:
``python -m speculators.train --dry-run`` builds the draft through its model classes, from the tiny target and a
token-frequency file (its own vocabulary mapping), and saves it in bf16 as it saves every checkpoint. The draft is
imported with ``import_head --from speculators``, checked tensor for tensor against what speculators wrote, drafts
the logits speculators' own model computes on the same target features, decodes greedy-identically to the target
alone, and exports back to the very tensors speculators wrote.

The EAGLE-3 draft is written with its trainer's defaults (``norm_before_residual``, and a draft layer attending
through a 2048-token sliding window, which covers the tiny target's 2048-token context: full attention) and once as
the paper's layer (``--no-norm-before-residual --full-attention-indices 0``); P-EAGLE with its defaults (a Qwen3
layer). speculators' DFlash layout is not one import reads (``--from dflash`` reads vLLM's).

The last test reads a headstart capture converted for speculators' trainer (``scripts/bench/peer_speculators.py``)
back through speculators' own dataset class.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.verify import generate
from headstart.heads import load_head
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import main as import_main
from headstart.scripts.export.verify_engines_side import side_import_path
from tests.helpers import ENGINES_PYTHON, LAYER_IDS, SAMPLES, TINY_LLAMA, greedy_reference

pytestmark = pytest.mark.engines

DRAFT_VOCAB = 200
MASK_TOKEN = 5
TOLERANCE = 1e-4  # max |logit difference|: the same bf16 weights in fp32, only summation order differs


@pytest.fixture(scope="module")
def token_frequencies(tmp_path_factory) -> Path:
    """speculators' data folder holding only ``token_freq.pt``: ids 100..299 the most frequent, so its own mapping
    keeps them (d2t offsets of 100)."""
    data = tmp_path_factory.mktemp("speculators-data")
    frequencies = {i: 1000 - i for i in range(100, TINY_LLAMA["vocab_size"])} | {i: 1 for i in range(100)}
    torch.save(frequencies, data / "token_freq.pt")
    return data


def speculators_writes(kind: str, target: str, data: Path, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """A fresh ``kind`` draft for ``target`` built and saved by speculators 0.9.0's own trainer (``--dry-run``), with
    its defaults but for ``flags``."""
    cmd = [str(ENGINES_PYTHON), "-m", "speculators.train", "--dry-run", "--speculator-type", kind]
    cmd += ["--verifier-name-or-path", target, "--data-path", str(data), "--save-path", str(out), "--logger", ""]
    cmd += ["--draft-vocab-size", str(DRAFT_VOCAB), "--target-layer-ids", *map(str, LAYER_IDS)]
    # Its trainer looks a mask token up in the verifier's tokenizer even for EAGLE-3; the tiny target has none.
    cmd += ["--mask-token-id", str(MASK_TOKEN), "--draft-attn-impl", "sdpa"]
    cmd += ["--seed", "0", *flags]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=out.parent, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def speculators_logits(folder: Path, reference: Path, out: Path, work: Path) -> torch.Tensor:
    """speculators' own ``Eagle3DraftModel``'s step-0 draft logits (``verify_engines_side.speculators_logits``),
    computed in the engines venv."""
    code = (
        "import sys; from safetensors.torch import load_file, save_file; "
        "from headstart.scripts.export.verify_engines_side import speculators_logits; "
        "save_file({'logits': speculators_logits(sys.argv[1], load_file(sys.argv[2])).contiguous()}, sys.argv[3])"
    )
    env = {**os.environ, "PYTHONPATH": str(side_import_path(work))}
    done = subprocess.run(
        [str(ENGINES_PYTHON), "-c", code, str(folder), str(reference), str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out))["logits"]


def imported(written: Path, target: str, out: Path) -> Path:
    """``python -m scripts.export.import_head --from speculators WRITTEN --out OUT --target TARGET``."""
    import_main(["--from", "speculators", str(written), "--out", str(out), "--target", target])
    return out


def as_we_name_them(theirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' tensors under our head's names: the draft layer is ``midlayer``, P-EAGLE's ``mask_hidden`` one
    row; the target's embedding (speculators keeps a copy) and its verifier copies are not the head's."""
    ours = {k.replace("layers.0.", "midlayer.", 1): v for k, v in theirs.items() if k != "embed_tokens.weight"}
    if "mask_hidden" in ours:
        ours["mask_hidden"] = ours["mask_hidden"].reshape(1, -1)
    return ours


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def decodes_as_the_target(head_dir: Path, target) -> None:
    head = load_head(head_dir, target).float().eval()
    proposer = head_proposer(head.config).served_chain(head, 3)
    for seed in range(2):
        prompt = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(seed))
        out, stats = generate(target, proposer, prompt, 16, eos_token_id=target.config.eos_token_id)
        assert torch.equal(out, greedy_reference(target, prompt)) and stats.target_forwards > 0


# (speculators' trainer flags, the residual of its draft layer normed, its layer types)
EAGLE3_LAYERS = {
    "defaults": ((), True, ["sliding_attention"]),
    "paper-layer": (("--no-norm-before-residual", "--full-attention-indices", "0"), False, ["full_attention"]),
}


@pytest.mark.parametrize("layer", EAGLE3_LAYERS)
def test_an_eagle3_draft_speculators_writes_imports_drafts_its_logits_and_exports_back(
    tiny_llama_dir, tiny_llama_from_dir, token_frequencies, tmp_path, layer
):
    flags, normed_residual, layer_types = EAGLE3_LAYERS[layer]
    written = speculators_writes("eagle3", tiny_llama_dir, token_frequencies, tmp_path / "speculators", flags)
    config = json.loads((written / "config.json").read_text())
    theirs = load_file(str(written / "model.safetensors"))
    # What its trainer writes: bf16 tensors, EAGLE-3.1's norms by default, the layer's type beside no layer count.
    assert config["dtype"] == "bfloat16" and {
        v.dtype for k, v in theirs.items() if "d2t" not in k and "t2d" not in k
    } == {torch.bfloat16}
    assert config["norm_before_fc"] and config["norm_output"] and "input_norm.weight" in theirs
    assert config["norm_before_residual"] is normed_residual
    decoder = config["transformer_layer_config"]
    assert decoder["layer_types"] == layer_types
    if layer_types == ["sliding_attention"]:  # its window covers the target's whole context: full attention
        assert decoder["sliding_window"] == tiny_llama_from_dir.config.max_position_embeddings == 2048
    assert torch.equal(theirs["d2t"], torch.full((DRAFT_VOCAB,), 100))  # its mapping from the frequencies
    head_dir = imported(written, tiny_llama_dir, tmp_path / "head")
    head = load_head(head_dir, tiny_llama_from_dir)
    options = head.config.options
    assert options.layer_ids == LAYER_IDS and options.draft_vocab_size == DRAFT_VOCAB
    assert options.norm_before_fc and options.norm_output and not options.fc_norm
    assert bool(options.norm_before_residual) is normed_residual
    assert same_tensors(load_file(str(head_dir / "model.safetensors")), as_we_name_them(theirs))

    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    head = head.float().eval()
    with torch.no_grad():
        states = tiny_llama_from_dir(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in LAYER_IDS], dim=-1)
        ours, _ = head(ids[:, 1:], head.first_features(aux[:, :-1]))
    reference = tmp_path / "reference.safetensors"
    save_file({"input_ids": ids, "aux": aux.contiguous()}, str(reference))
    logits = speculators_logits(written, reference, tmp_path / "logits.safetensors", tmp_path)
    assert logits.shape == ours.shape and (logits - ours).abs().max() <= TOLERANCE

    decodes_as_the_target(head_dir, tiny_llama_from_dir)
    back = export_head(head_dir, "speculators", tmp_path / "export", tiny_llama_dir)
    exported = load_file(str(back / "model.safetensors"))
    assert same_tensors(exported, {k: v for k, v in theirs.items() if k != "embed_tokens.weight"})
    again = json.loads((back / "config.json").read_text())
    assert again["transformer_layer_config"]["num_hidden_layers"] == 1
    assert again["norm_before_residual"] is normed_residual


def test_a_peagle_draft_speculators_writes_imports_decodes_and_exports_back(
    tiny_llama_dir, tiny_llama_from_dir, token_frequencies, tmp_path
):
    written = speculators_writes("peagle", tiny_llama_dir, token_frequencies, tmp_path / "speculators")
    theirs = load_file(str(written / "model.safetensors"))
    assert theirs["mask_hidden"].shape == (1, 1, 3 * TINY_LLAMA["hidden_size"])  # its own shape for the vector
    assert "layers.0.self_attn.q_norm.weight" in theirs  # P-EAGLE's default draft layer is Qwen3's
    head_dir = imported(written, tiny_llama_dir, tmp_path / "head")
    head = load_head(head_dir, tiny_llama_from_dir)
    assert head.config.options.parallel_drafting.mask_token_id == MASK_TOKEN and head.config.arch.qk_norm
    assert same_tensors(load_file(str(head_dir / "model.safetensors")), as_we_name_them(theirs))
    decodes_as_the_target(head_dir, tiny_llama_from_dir)
    back = export_head(head_dir, "speculators", tmp_path / "export", tiny_llama_dir)
    exported = load_file(str(back / "model.safetensors"))
    expected = {k: v for k, v in theirs.items() if k != "embed_tokens.weight"}
    assert same_tensors(exported | {"mask_hidden": exported["mask_hidden"].reshape(1, 1, -1)}, expected)


def test_a_capture_converted_for_speculators_trainer_reads_there_as_headstart_captured_it(
    tiny_target_dir, gsm8k_file, tmp_path
):
    """scripts/bench/peer_speculators.py's conversion, read back by speculators' own ``ArrowDataset``: the same
    tokens, loss mask and fused layers, headstart's training samples first, and the last state that speculators'
    verifier norm turns back into the post-norm state the capture stored."""
    from transformers import LlamaForCausalLM

    from headstart.data_recipes.capture import run_capture
    from headstart.data_recipes.shards import ShardDataset
    from headstart.scripts.bench.peer_speculators import side, side_env, to_speculators
    from headstart.train.data import split_heldout
    from headstart.train.train_config import TrainConfig
    from tests.helpers import base_config, make_head, resolve

    target = LlamaForCausalLM.from_pretrained(tiny_target_dir).eval()
    config = base_config(tiny_target_dir, gsm8k_file, tmp_path / "capture", tmp_path, "eagle3")
    run_capture(config)
    train = TrainConfig(**resolve(config, TrainConfig)).train
    head_dir = make_head(target, tmp_path, "eagle3", layer_ids=config["capture"]["aux_layers"])
    data = tmp_path / "speculators-data"
    split = to_speculators(tmp_path / "capture", head_dir, data, train)
    train_ids, heldout_ids = split_heldout(SAMPLES, train.heldout_samples, train.seed)
    assert split["train_ratio"] == len(train_ids) / SAMPLES and split["heldout"] == len(heldout_ids)
    args = type("Args", (), {"engines_python": str(ENGINES_PYTHON)})()
    done = subprocess.run(side(args, "dataset", str(data)), env=side_env(tmp_path), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    code = (
        "import sys, torch; from safetensors.torch import save_file; from speculators.train.data import ArrowDataset; "
        "rows = ArrowDataset(4096, sys.argv[1], on_missing='raise', hidden_states_dtype=torch.float32); "
        "save_file({f'{k}.{i}': v.contiguous() for i in (0, len(rows) - 1) for k, v in rows[i].items()}, sys.argv[2])"
    )
    read = tmp_path / "read.safetensors"
    done = subprocess.run([str(ENGINES_PYTHON), "-c", code, str(data), str(read)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = load_file(str(read))
    capture = ShardDataset(tmp_path / "capture")
    for i, index in ((0, train_ids[0]), (len(train_ids) + len(heldout_ids) - 1, heldout_ids[-1])):
        ours = capture[index]
        assert torch.equal(theirs[f"input_ids.{i}"], ours["input_ids"])
        assert torch.equal(theirs[f"loss_mask.{i}"], ours["loss_mask"].bool())
        assert torch.equal(theirs[f"hidden_states.{i}"], ours["aux_hidden"])
        with torch.no_grad():
            normed = target.model.norm(theirs[f"verifier_last_hidden_states.{i}"])
        assert torch.allclose(normed, ours["last_hidden"], rtol=1e-4, atol=1e-5)
