"""``train.optimizer: muon``: which parameters Muon takes, that its step is the orthogonalised one, and that a run
through DeepSpeed resumes to the same head bit for bit, under ZeRO and in bf16."""

import copy
import shutil

import pytest
import torch
from deepspeed.runtime.zero.muon.original_muon import muon_update
from torch import nn

from headstart.core.config_files import load_config
from headstart.heads import build_head
from headstart.train import eagle as trainer
from headstart.train.deepspeed_engine import build_engine
from headstart.train.loop import init_distributed
from headstart.train.optimizers import MUON_MOMENTUM, build_optimizer
from headstart.train.train_config import Train
from tests.block_drafters import block_drafter_run, trains_then_resumes_identically
from tests.helpers import LAYER_IDS, world_of_one, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def muon_train(**settings) -> Train:
    return Train(out_dir="unused", optimizer="muon", lr=1e-3, muon_lr=0.05, **settings)


@pytest.mark.parametrize(
    ("settings", "muon", "adamw"),
    [
        (
            {"type": "dflash2", "layer_ids": LAYER_IDS, "block_size": 4, "selector_rank": 8},
            {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"},
            {"hidden_norm.weight", "candidate_selector.successor_codebook", "candidate_selector.predecessor_codebook"},
        ),
        (
            {"type": "dspark", "layer_ids": LAYER_IDS, "block_size": 3, "markov_rank": 8},
            {"fc.weight"},
            {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"},
        ),
        (
            {"type": "eagle3", "layer_ids": LAYER_IDS, "draft_vocab_size": 200},
            {"fc.weight", "midlayer.self_attn.q_proj.weight"},
            {"lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight"},
        ),
        ({"type": "medusa", "num_heads": 2}, {"medusa_head.0.0.linear.weight"}, {"medusa_head.0.1.weight"}),
    ],
    ids=["dflash2", "dspark", "eagle3", "medusa"],
)
def test_muon_takes_the_weight_matrices_and_adamw_the_rest(peaked_tiny_llama, settings, muon, adamw):
    head = build_head(settings, peaked_tiny_llama)
    optimizer = build_optimizer(head, muon_train(), peaked_tiny_llama.config.vocab_size)
    names = {id(p): name for name, p in head.named_parameters()}
    groups = {g["use_muon"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert muon <= groups[True] and adamw <= groups[False]
    assert all(head.get_parameter(n).ndim == 2 for n in groups[True])
    assert groups[True] | groups[False] == {n for n, p in head.named_parameters() if p.requires_grad}
    assert {g["use_muon"]: g["lr"] for g in optimizer.param_groups} == {True: 0.05, False: 1e-3}


def test_domino_keeps_its_correction_with_adamw_unless_muon_exclude_says_otherwise(peaked_tiny_llama):
    head = build_head({"type": "domino", "layer_ids": LAYER_IDS, "block_size": 3, "emb_dim": 8}, peaked_tiny_llama)
    correction = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight"}
    names = {id(p): name for name, p in head.named_parameters()}

    def muon_names(**settings) -> set[str]:
        optimizer = build_optimizer(
            head, muon_train(**settings), peaked_tiny_llama.config.vocab_size, head.adamw_under_muon
        )
        return {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}

    by_default, none_excluded = muon_names(), muon_names(muon_exclude=[])
    assert not correction & by_default and "fc.weight" in by_default
    assert none_excluded - by_default == correction
    assert muon_names(muon_exclude=["prefix_gru"]) - by_default == {"embed_proj.0.weight"}
    with pytest.raises(ValueError, match=r"train.muon_exclude: \['prefix_rgu'\] is part of no trained parameter"):
        muon_names(muon_exclude=["prefix_gru", "prefix_rgu"])


def test_a_muon_step_moves_each_matrix_by_an_orthogonalised_update(peaked_tiny_llama):
    head = build_head({"type": "medusa", "num_heads": 1}, peaked_tiny_llama)
    optimizer = build_optimizer(head, muon_train(), peaked_tiny_llama.config.vocab_size)
    matrix = head.medusa_head[0][0].linear.weight
    before = matrix.detach().clone()
    matrix.grad = torch.randn_like(matrix) * torch.logspace(-3, 0, matrix.shape[1])  # badly conditioned
    for p in head.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    gradient = torch.linalg.svdvals(matrix.grad.double())
    update = torch.linalg.svdvals((before - matrix.detach()).double())
    # Newton-Schulz flattens the spectrum (5 iterations lift all but the smallest directions to ~1): a plain SGD step
    # keeps the gradient's spread, AdamW's its elementwise-normalised one.
    assert update.max() / update.min() < gradient.max() / gradient.min() / 20
    assert update.median() / update.max() > 0.5 and update.max() == pytest.approx(0.05, rel=0.5)  # ~ muon_lr


@pytest.fixture
def eager_newton_schulz():
    """DeepSpeed's Newton-Schulz uncompiled: torch.compile takes minutes per matrix shape on a shared CPU."""
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.usefixtures("eager_newton_schulz")
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_muon_under_deepspeed_steps_as_plain_muon_does(tmp_path, monkeypatch, zero_stage):
    """One step of the training loop's engine, with a clip that binds, moves each matrix by ``muon_lr`` times
    Muon's orthogonalised gradient, as a single-process Muon does. Under ZeRO DeepSpeed clipped the orthogonalised
    update (train/deepspeed_engine.py's ``gradient_clipping``): these matrices moved ~10x too little."""
    world_of_one(monkeypatch)
    proc = init_distributed("cpu")
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32, bias=False))
    reference = copy.deepcopy(model)
    train = Train(
        out_dir=str(tmp_path), optimizer="muon", muon_lr=0.05, batch_size=1, micro_batch_size=1,
        max_grad_norm=0.5, zero_stage=zero_stage,
    )  # fmt: skip
    engine = build_engine(model, train, proc, total=4, vocab_size=1000)
    inputs = torch.randn(4, 32)
    engine.backward(100 * engine(inputs).square().mean())  # a raw gradient norm past the clip too
    engine.step()
    (100 * reference(inputs).square().mean()).backward()
    for before, after in zip(reference.parameters(), model.parameters(), strict=True):
        if before.ndim == 2:
            update = muon_update(before.grad.clone(), torch.zeros_like(before), MUON_MOMENTUM)
            torch.testing.assert_close(before.detach() - after.detach(), 0.05 * update, rtol=1e-4, atol=1e-6)


# ZeRO-2 in fp32 is the recipes' default; the others each cost as much again (~80 s on 2 CPU cores).
RESUMES = [
    (2, "fp32"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [(0, "fp32"), (1, "bf16"), (3, "bf16")]),
]


@pytest.mark.usefixtures("eager_newton_schulz")
@pytest.mark.parametrize(("zero_stage", "dtype"), RESUMES)
def test_muon_training_resumes_to_the_same_head(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch, zero_stage, dtype):
    world_of_one(monkeypatch)
    head = {"type": "dflash", "block_size": 4, "num_anchors": 8, "num_layers": 1}
    path, out = block_drafter_run(tmp_path, tiny_target_dir, gsm8k_file, head)
    config = load_config(path)
    config["train"] |= {"optimizer": "muon", "muon_lr": 0.05, "zero_stage": zero_stage, "dtype": dtype}
    write_config(path, config)
    _, lines = trains_then_resumes_identically(trainer.main, path, out)
    heldout = [r for r in lines if r["split"] == "heldout"]
    assert heldout[1]["loss"] < heldout[0]["loss"]


@pytest.mark.usefixtures("eager_newton_schulz")
def test_a_resume_under_another_optimizer_grouping_or_setting_is_refused_by_name(
    tiny_target_dir, gsm8k_file, tmp_path, monkeypatch
):
    """The optimizer state fits only the grouping that wrote it (DeepSpeed itself failed mid-load with an unrelated
    "parameter-alignment layout" message), and its schedule and parameter groups restore their own rates, weight
    decay and betas over the config's. Put back as it was, the run resumes."""
    world_of_one(monkeypatch)
    head = {"type": "dflash", "block_size": 4, "num_anchors": 8, "num_layers": 1}
    path, out = block_drafter_run(tmp_path, tiny_target_dir, gsm8k_file, head)
    config = load_config(path)
    config["train"] |= {"optimizer": "muon", "muon_lr": 0.05}
    write_config(path, config)
    trainer.main(["--config", str(path)])
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    write_config(path, config | {"train": config["train"] | {"muon_exclude": ["fc"]}})
    moved = r"cannot resume from step 2: .*\(\['head.fc.weight'\] Muon -> AdamW\) \(checkpoint -> now\)"
    with pytest.raises(ValueError, match=moved):
        trainer.main(["--config", str(path)])
    write_config(path, config | {"train": config["train"] | {"optimizer": "adamw"}})
    all_moved = r"\['head.fc.weight', 'head.layers.0.mlp.down_proj.weight', .*\] Muon -> AdamW"
    with pytest.raises(ValueError, match=all_moved):
        trainer.main(["--config", str(path)])
    write_config(path, config | {"train": config["train"] | {"muon_lr": 0.1}})
    with pytest.raises(ValueError, match=r"cannot resume from step 2: train.muon_lr 0.05 -> 0.1 \(checkpoint -> now\)"):
        trainer.main(["--config", str(path)])
    # The optimizer state's param_groups restored these over the config's without a word.
    write_config(path, config | {"train": config["train"] | {"weight_decay": 0.1, "betas": [0.8, 0.95]}})
    changed = r"train.weight_decay 0.0 -> 0.1; train.betas \[0.9, 0.95\] -> \[0.8, 0.95\] \(checkpoint -> now\)"
    with pytest.raises(ValueError, match=changed):
        trainer.main(["--config", str(path)])
    write_config(path, config)
    trainer.main(["--config", str(path)])
    assert (out / "checkpoints" / "step-00000004" / "COMPLETE").is_file()
