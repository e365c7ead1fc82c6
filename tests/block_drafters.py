"""The block drafters' shared test set-up (DFlash, DFlash-2, DSpark, Domino), imported from here
(``from tests.block_drafters import ...``): their prompts and features on the wide tiny Llama (peaked_wide_llama,
tiny_llama(**WIDE)), the batch their losses score and the blocks those losses draft, the greedy-identity and
sampling checks of their decoding, their export for vLLM and their recipes' training runs.
What every test module shares is in tests/helpers.py."""

import json
import shutil
from pathlib import Path

import torch

from tests.helpers import (
    TINY_LLAMA,
    WIDE,
    assert_matches,
    exact_two_tokens_of,
    greedy_reference,
    tiny_llama,
    world_of_one,
    write_config,
)

V, NEW = TINY_LLAMA["vocab_size"], 16  # the tiny Llama's vocabulary; the tokens a greedy-identity test generates
SAMPLED_PROMPT = torch.tensor([[1, 2, 3, 4, 2, 1, 3]])  # the sampling tests' prompt on five_token_target()


def features(target, ids, layers):
    """(``target``'s states at ``layers`` concatenated [B, S, n * H], its last hidden state) of ``ids``."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in layers], dim=-1), states[-1]


def prompts():
    """The greedy tests' three prompts: one token, 5 and 12 random ones."""
    gen = torch.Generator().manual_seed(1)
    return [
        torch.tensor([[7]]),
        torch.randint(2, V, (1, 5), generator=gen),
        torch.randint(2, V, (1, 12), generator=gen),
    ]


def first_tree(target, proposer):
    """(the tree ``proposer`` drafts after prompts()[2]'s features are committed, those features [1, 11, n * H])."""
    from headstart.decoding.verify import Sampling

    tokens = prompts()[2][0]
    aux, _ = features(target, tokens[None, :-1], proposer.hidden_layers)
    proposer.reset(Sampling())
    with torch.no_grad():
        proposer.update(tokens, aux[0])
        return proposer.propose(tokens), aux


def assert_same_head(imported, head):
    """An imported block drafter is the exported one: the same tensors and options (the draft layer's width written
    out)."""
    mine = head.state_dict()
    assert imported.state_dict().keys() == mine.keys()
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in mine.items())
    assert imported.config.options == head.config.options.model_copy(update={"intermediate_size": 96})


def block_batch(target, head, gap: bool = True):
    """Two samples of 14 random tokens with the target's states: the second padded from 11, the first 4 of each
    unlabelled and (``gap``) a gap at 9 in the first (a block stops being scored there, where its loss says so)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (2, 14), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 11:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0
    loss_mask[0, 9] = 0 if gap else 1
    aux, last = features(target, ids, head.hidden_layers)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "aux_hidden": aux} | {
        "last_hidden": last
    }


def served_blocks(head, batch, drafts: int):
    """(sample b, anchor a, normed outputs [K, H]) of every block a block drafter's loss scores in ``batch`` (each
    position whose next token is a label anchors one), drafted as served: the anchor's token and masks over the
    context strictly before it, ``drafts`` slots; of those, the K whose tokens lie inside the sample."""
    ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    for b in range(len(ids)):
        n = int(attention[b].sum())
        for a in range(n - 1):
            if loss_mask[b, a + 1]:
                context = head.context_kv(batch["aux_hidden"][b : b + 1, :a], torch.arange(a)[None])
                yield b, a, head.draft_hidden(ids[b, a], a, context, drafts)[: n - 1 - a]


def trained_on(head, batch, steps):
    """((loss, metrics) before, (loss, metrics) after ``steps`` Adam steps at 1e-2 on ``batch``)."""
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    first = head.loss(batch)
    for _ in range(steps):
        optimizer.zero_grad()
        head.loss(batch)[0].backward()
        optimizer.step()
    return first, head.loss(batch)


def assert_decodes_as_target_greedy(target, proposer, make_proposer) -> list:
    """Speculative decoding of each of prompts() gives ``target``'s own greedy tokens, token for token: one sequence
    at a time with ``proposer`` and batched with one ``make_proposer()`` a sequence (each its own draft context).
    The stats of the one-at-a-time runs."""
    from headstart.decoding.verify import generate, generate_batch

    runs = []
    for prompt in prompts():
        out, stats = generate(target, proposer, prompt, NEW, eos_token_id=target.config.eos_token_id)
        assert torch.equal(out, greedy_reference(target, prompt))
        runs.append(stats)
    outputs, _ = generate_batch(target, [make_proposer() for _ in prompts()], prompts(), NEW)
    assert all(torch.equal(out, greedy_reference(target, p)) for out, p in zip(outputs, prompts()))
    return runs


def five_token_target():
    """tiny_llama(**WIDE) over 5 tokens, frozen, its distributions sharpened: two sampled tokens have 25 outcomes,
    every one populated in a thousand samples, and the target's and a fresh draft's distributions differ but
    overlap."""
    target = tiny_llama(**WIDE | {"vocab_size": 5, "eos_token_id": None}).requires_grad_(False)
    target.lm_head.weight.data *= 5
    return target


def assert_samples_as_the_target(target, make_proposer, sampling, wrong: torch.Tensor) -> None:
    """The first two tokens sampled after SAMPLED_PROMPT with ``make_proposer()``'s drafts (a thousand runs, a
    hundred sequences a verification) follow ``target``'s exact distribution (a chi-square test at 0.001, as in
    test_decoding_sampling.py, which ``wrong`` [25], what handing out the drafts unverified would give, must fail by
    far), and the drafts are often accepted: acceptance is exercised, not only the residual."""
    from headstart.decoding.verify import generate_batch

    exact = exact_two_tokens_of(target, SAMPLED_PROMPT, sampling)
    torch.manual_seed(0)
    counts, accepted = torch.zeros(25), 0
    for _ in range(10):
        proposers = [make_proposer() for _ in range(100)]
        outputs, stats = generate_batch(target, proposers, [SAMPLED_PROMPT] * 100, 2, sampling)
        for out, stat in zip(outputs, stats):
            counts[out[0, -2] * 5 + out[0, -1]] += 1
            accepted += stat.accepted_lengths[0] - 1
    assert accepted > 300
    assert_matches(counts, exact, wrong)


def exported_for_vllm(target, head, tmp_path: Path) -> tuple[Path, dict, Path]:
    """(the export folder, its config.json, the target's folder) of ``head`` saved at tmp_path/head and exported
    for vLLM beside ``target`` saved at tmp_path/target."""
    from headstart.scripts.export.command import export_head

    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    head.save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", "vllm", tmp_path / "export", str(target_dir))
    return out, json.loads((out / "config.json").read_text()), target_dir


# ---- training runs of the block drafters' recipes (train/eagle.py)


def block_drafter_run(tmp_path, target_dir, data_file, head: dict, save_every: int = 2):
    """(config path, out dir) of a 4-step online-capture run of a block drafter (DFlash, DSpark) on the tiny target:
    what their recipes' training tests share."""
    out = tmp_path / "run"
    config = {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(data_file), "format": "gsm8k", "max_length": 64, "limit": 12},
        "capture": {"aux_layers": [1, 3, 4], "store_dtype": "fp32"},
        "head": head,
        "train": {"out_dir": str(out), "seed": 5, "batch_size": 4, "micro_batch_size": 2, "max_steps": 4,
                  "lr": 1e-2, "online_capture": True, "heldout_samples": 4, "eval_every": 2,
                  "save_every": save_every, "keep_checkpoints": 0},
    }  # fmt: skip
    return write_config(tmp_path / f"{head['type']}.yaml", config), out


def metrics_lines(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trains_then_resumes_identically(main, path: Path, out: Path) -> tuple[dict, list[dict]]:
    """(the head's tensors, the metrics records) of ``block_drafter_run``'s run through the recipe ``main``, after
    checking that the same run resumed from its step-2 checkpoint writes the same head bit for bit and logs the same
    losses (the blocks come from the generator the loop seeds per micro-batch)."""
    from safetensors.torch import load_file

    main(["--config", str(path)])
    straight, lines = load_file(str(out / "head" / "model.safetensors")), metrics_lines(out)
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    main(["--config", str(path)])
    resumed = load_file(str(out / "head" / "model.safetensors"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    relogged = metrics_lines(out)
    assert [(r["step"], r["split"], r["loss"]) for r in relogged] == [(r["step"], r["split"], r["loss"]) for r in lines]
    return straight, lines


def block_drafter_resumes(monkeypatch, tmp_path, target_dir, data_file, head: dict) -> tuple[dict, dict, Path]:
    """(the head's tensors, the last held-out record, the out dir) of ``block_drafter_run``'s run of ``head`` through
    train/eagle.py in this process (rank 0 of a world of one), after checking that the run resumed from its step-2
    checkpoint writes the same head (``trains_then_resumes_identically``) and that the held-out loss, logged at
    steps 2 and 4, fell."""
    from headstart.train import eagle as trainer

    world_of_one(monkeypatch)
    path, out = block_drafter_run(tmp_path, target_dir, data_file, head)
    straight, lines = trains_then_resumes_identically(trainer.main, path, out)
    heldout = [r for r in lines if r["split"] == "heldout"]
    assert [r["step"] for r in heldout] == [2, 4] and heldout[1]["loss"] < heldout[0]["loss"]
    return straight, heldout[1], out
