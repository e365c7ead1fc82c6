"""Every target family a serving engine drafts for (issue #39), each a tiny random model built from transformers' own
config class with the tiny test tokenizer: MoE (qwen3_moe, gpt_oss, deepseek_v3 with MLA), sliding windows shorter
than the context (mistral, gemma3_text, gpt_oss), phi3's fused projections, linear-attention and Mamba hybrids
(qwen3_next, granitemoehybrid). For each: capture -> EAGLE-3 and DFlash training -> decoding identical to the
target's own greedy output (vanilla, n-gram, both heads) -> the engines' export layouts.

The draft layer is the head's: one dense Llama (or Qwen3) layer, sized from the target, whatever its blocks are.
"""

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import models as hf

from headstart.core.config_files import load_config
from headstart.core.memory import GB, TargetSizes, kv_cache_bytes
from headstart.core.models import load_model
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.capture_plan import storage_estimate
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_block import DFlash
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import Sampling, generate, generate_batch, new_cache
from headstart.eval import acceptance, autotune
from headstart.export.card import vllm_command
from headstart.export.common import AUX_CAPTURE, VLLM_UNSERVED_FAMILIES
from headstart.heads import WEIGHTS_NAME, build_head, load_head
from headstart.heads.target import arch_from_target
from headstart.scripts.dev.tiny_families import (
    EXPERTS_ONLY,
    FAMILIES,
    RECURRENT,
    WINDOW,
    family_config,
    save_target,
)
from headstart.scripts.export.command import export_head
from headstart.scripts.export.import_head import import_head
from headstart.train import eagle
from headstart.train.loop import Process, training_memory
from headstart.train.train_config import resolve_config
from tests.core.test_tensor_parallel import torchrun
from tests.heads.test_families import check_export
from tests.helpers import REPO, assert_matches, base_config, exact_two_tokens_of, records, run_here

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS = {
    "eagle3": {"type": "eagle3", "draft_vocab_size": 256, "ttt_steps": 3},
    "dflash": {"type": "dflash", "block_size": 4, "num_anchors": 8},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_heads(request, tiny_target_dir, gsm8k_file, tmp_path_factory, monkeypatch_module):
    """(family, target folder, {head type: trained head folder}) for each family: one capture feeds both heads."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    save_target(root / "target", family, AutoTokenizer.from_pretrained(tiny_target_dir))
    run_capture(base_config(root / "target", gsm8k_file, root / "shards", root, "eagle3"))
    heads = {}
    for head_type, options in HEADS.items():
        cfg = base_config(root / "target", gsm8k_file, root / "shards", root / head_type, "eagle3", max_steps=3)
        cfg["head"] = options | ({"intermediate_size": 64} if family in EXPERTS_ONLY else {})
        (root / f"{head_type}.yaml").write_text(yaml.safe_dump(cfg))
        run_here(monkeypatch_module, eagle, root / f"{head_type}.yaml")  # train/eagle.py trains both
        heads[head_type] = root / head_type
    return family, root / "target", heads


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def check_the_eval_command(family, target_dir, heads, bench, tmp_path):
    """``eval.acceptance`` with every method and both heads, EAGLE-3's default (dynamic) tree: greedy-identical, a
    recurrent target's trees set aside for chains."""
    argv = ["--target", str(target_dir), "--head", f"{heads['eagle3'] / 'head'},{heads['dflash'] / 'head'}"]
    argv += ["--method", "vanilla,ngram,eagle3,dflash", "--bench", str(bench), "--limit", "2"]
    report = acceptance.main([*argv, "--max-new-tokens", "16", "--device", "cpu", "--out", str(tmp_path / "eval")])
    assert all(result["greedy_identical"] for result in report["methods"].values()), family


def test_heads_train_decode_as_the_target_and_export_for_each_family(family_heads, gsm8k_file, tmp_path):
    family, target_dir, heads = family_heads
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer("Ann has 3 apples and buys 5 more apples.", return_tensors="pt").input_ids
    assert prompt.shape[1] > WINDOW
    expected = target.generate(prompt, do_sample=False, max_new_tokens=16, pad_token_id=0)
    loaded = {head_type: load_head(out / "head", target) for head_type, out in heads.items()}
    for out in heads.values():
        steps = records(out)
        assert [r["step"] for r in steps] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    # A tree where one forward verifies it exactly; chains over a recurrence (decoding.verify).
    tree = dict(top_k=1, depth=3, total_tokens=3) if family in RECURRENT else dict(top_k=3, depth=3, total_tokens=8)
    proposers = {
        "vanilla": Vanilla(),
        "ngram": NGram(),
        "eagle3": Eagle(loaded["eagle3"], **tree),
        "dflash": DFlash(loaded["dflash"]),
    }
    for name, proposer in proposers.items():
        got, stats = generate(target, proposer, prompt, 16)
        assert torch.equal(got, expected), (family, name)
        assert stats.target_forwards == len(stats.accepted_lengths) <= 16
    for head_type, head in loaded.items():
        arch = head.config.arch
        assert arch.family == family and arch.hidden_act == "silu" and not arch.qkv_bias
        assert arch.intermediate_size == 64  # the target's dense MLP, else head.intermediate_size
        check_export(heads[head_type] / "head", family, target_dir)
    if family in ("mistral", "qwen3_next"):  # the command a user runs: it crashed on both before (issue #39)
        check_the_eval_command(family, target_dir, heads, gsm8k_file, tmp_path)
    # gpt-oss's EAGLE-3 head normalises the fused states before fc (vLLM's norm_before_fc), and imports back.
    assert loaded["eagle3"].config.options.norm_before_fc == (family == "gpt_oss")
    fmt = "sglang" if family in VLLM_UNSERVED_FAMILIES else "vllm"  # the EAGLE repo's layout, either way
    exported = export_head(heads["eagle3"] / "head", fmt, heads["eagle3"] / "export", str(target_dir))
    imported = import_head("eagle3", exported, heads["eagle3"] / "imported", str(target_dir))
    again, ours = load_file(str(imported / WEIGHTS_NAME)), loaded["eagle3"].state_dict()
    assert again.keys() == ours.keys() and all(torch.equal(again[k], v) for k, v in ours.items())


def test_the_draft_layer_is_the_heads_whatever_the_targets_blocks():
    # MoE targets whose every layer routes to experts have no dense width: the head must be told its own.
    for family in EXPERTS_ONLY:
        target = AutoModelForCausalLM.from_config(family_config(family, vocab_size=64))
        with pytest.raises(ValueError, match=rf"eagle3 head for this {family} target needs head.intermediate_size"):
            build_head({"type": "eagle3", "draft_vocab_size": 32, "layer_ids": [1, 3, 4]}, target)
        head = build_head({"type": "dflash", "intermediate_size": 48, "layer_ids": [1, 3, 4]}, target)
        assert head.config.arch.intermediate_size == 48
    # DeepSeek-V3 (MLA): its dense first layers give the width; the draft attends as a Llama layer with heads of the
    # target's value width (hidden / v_head_dim), 8 key/value heads where they divide, as SpecForge's V3 draft.
    deepseek = arch_from_target(family_config("deepseek_v3", vocab_size=64))
    assert (deepseek.intermediate_size, deepseek.num_attention_heads, deepseek.qk_norm) == (64, 4, False)
    assert (deepseek.num_key_value_heads, deepseek.head_dim) == (4, 8)
    published = arch_from_target(hf.deepseek_v3.DeepseekV3Config())  # DeepSeek-V3's own shape
    assert (published.num_attention_heads, published.num_key_value_heads, published.head_dim) == (56, 8, 128)
    assert published.intermediate_size == 18432  # its 3 dense layers' MLP
    # gpt-oss: YaRN rotary kept for the draft, its attention biases are its own layer's (the draft has none).
    gpt_oss = arch_from_target(family_config("gpt_oss", vocab_size=64))
    assert gpt_oss.rope["rope_type"] == "yarn" and gpt_oss.rope["factor"] == 32.0 and not gpt_oss.qkv_bias
    # Qwen3-Next rotates a quarter of each head; the draft rotates its whole head, with Qwen3's q/k norm.
    qwen3_next = arch_from_target(family_config("qwen3_next", vocab_size=64))
    assert "partial_rotary_factor" not in qwen3_next.rope and qwen3_next.qk_norm


def test_sampling_on_a_moe_target_is_lossless():
    # The first two sampled tokens follow the target's exact distribution (chi-square at 0.001, as in
    # test_decoding_sampling.py) with an EAGLE-3 head drafting trees over a qwen3_moe target of 5 tokens.
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(family_config("qwen3_moe", vocab_size=5, eos_token_id=None)).eval()
    target.lm_head.weight.data *= 5  # the target's and the draft's distributions differ, but overlap
    head = build_head(
        {"type": "eagle3", "draft_vocab_size": 5, "layer_ids": [1, 3, 4], "intermediate_size": 32}, target
    )
    sampling = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 2, 3, 4, 2, 1, 3]])
    exact = exact_two_tokens_of(target, prompt, sampling)
    torch.manual_seed(1)
    counts = torch.zeros(25)
    for _ in range(10):
        proposers = [Eagle(head.eval(), top_k=2, depth=2, total_tokens=4) for _ in range(100)]
        outputs, _ = generate_batch(target, proposers, [prompt] * 100, 2, sampling)
        for out in outputs:
            counts[out[0, -2] * 5 + out[0, -1]] += 1
    assert_matches(counts, exact, torch.full((25,), 1 / 25))  # a uniform sampler would fail by far


def test_the_families_by_engine_table_is_the_code_s():
    # docs/EXPORT.md's "Families by engine" table and export/common.py's AUX_CAPTURE say the same.
    text = (REPO / "docs" / "EXPORT.md").read_text()
    section = text[text.index("### Families by engine") :]
    table = next(block for block in section.split("\n\n") if block.startswith("| family"))
    documented = {}
    for line in table.splitlines()[2:]:  # past the header and its rule
        family, vllm, sglang = (cell.strip() for cell in line.strip("|").split("|"))
        documented[family] = tuple(engine for engine, said in (("vllm", vllm), ("sglang", sglang)) if said == "yes")
    assert documented == AUX_CAPTURE
    # vLLM serves the others through its Transformers backend: the serve command says so.
    assert "--model-impl transformers" in vllm_command("T", "D", "eagle3", aux_family="mixtral")
    assert "--model-impl" not in vllm_command("T", "D", "eagle3", aux_family="qwen3_moe")


MOE_TP_WORKER = """
import torch
from headstart.core.models import load_model
from headstart.core.runtime import join_process_group, rank_device
ranks = join_process_group(rank_device("cpu"), 2)
out = load_model({target!r}, "cpu", "fp32", 2)(torch.arange(3, 40)[None], output_hidden_states=True)
if ranks.rank == 0:
    torch.save({{"logits": out.logits, "last": out.hidden_states[-1]}}, {out!r})
"""


@pytest.mark.slow
def test_a_moe_target_splits_across_ranks_and_one_without_a_plan_is_refused(tiny_target_dir, tmp_path):
    # target.tp_size for MoE families: transformers' plan splits Qwen3-MoE's attention and experts over 2 gloo
    # ranks, which give the one-process forward; gpt-oss has no plan in transformers 5.23 and is refused by name.
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    for family in ("qwen3_moe", "gpt_oss"):
        save_target(tmp_path / family, family, tokenizer)
    with pytest.raises(NotImplementedError, match="no tensor-parallel plan for gpt_oss targets"):
        load_model(str(tmp_path / "gpt_oss"), "cpu", "fp32", tp_size=2)
    worker = tmp_path / "worker.py"
    worker.write_text(MOE_TP_WORKER.format(target=str(tmp_path / "qwen3_moe"), out=str(tmp_path / "split.pt")))
    torchrun(str(worker))
    split = torch.load(tmp_path / "split.pt")
    whole = load_model(str(tmp_path / "qwen3_moe"), "cpu")
    out = whole(torch.arange(3, 40)[None], output_hidden_states=True)
    torch.testing.assert_close(split["logits"], out.logits, atol=1e-5, rtol=1e-5)  # fp32 reduction order only
    torch.testing.assert_close(split["last"], out.hidden_states[-1], atol=1e-5, rtol=1e-5)
    # The memory estimate counts every expert: the parameters of the config's meta model are the loaded model's.
    assert TargetSizes.of(whole.config).parameters == sum(p.numel() for p in whole.parameters())


def test_the_kv_cache_estimate_counts_attention_layers_and_mla_heads():
    # The decoding memory check's KV cache: the verifier's cache after a 40-token forward, byte for byte (every
    # position of a sliding layer kept, as rejected rows are rolled back by position: decoding.verify.new_cache).
    for family in ("deepseek_v3", "qwen3_next", "gpt_oss"):
        model = AutoModelForCausalLM.from_config(family_config(family, vocab_size=64)).eval()
        cache = model(torch.arange(40)[None], past_key_values=new_cache(model), use_cache=True).past_key_values
        growing = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]  # not recurrent
        held = sum(t.numel() * t.element_size() for layer in growing for t in (layer.keys, layer.values))
        assert kv_cache_bytes(model.config, 40, torch.float32, 1) == held, family


# The published shapes of the two MoE configs' targets, from transformers' config classes (nothing downloaded).
PUBLISHED = {
    "qwen3-30b-a3b-eagle3": hf.qwen3_moe.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b-eagle3": hf.gpt_oss.GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, tie_word_embeddings=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_moe_configs_figures_are_what_core_memory_computes(name, tmp_path):
    # configs/{qwen3-30b-a3b,gpt-oss-20b}-eagle3.yaml state the disk and per-rank memory in comments: the figures
    # core.memory and storage_estimate give for the published shape (parameters counted with every expert).
    text = (REPO / "configs" / f"{name}.yaml").read_text()
    PUBLISHED[name].save_pretrained(tmp_path / "target")
    config = load_config(REPO / "configs" / f"{name}.yaml")
    config["target"]["path"] = str(tmp_path / "target")
    resolved = resolve_config(config, "eagle")
    hidden = PUBLISHED[name].hidden_size
    assert f"{storage_estimate(1, hidden, 3, torch.bfloat16):,} bytes a token" in text
    training = training_memory(resolved, Process(0, 8, torch.device("cuda")))
    assert f"= {training.total / GB:.2f} GB" in text
    share = TargetSizes.of(PUBLISHED[name]).target_share(torch.bfloat16, 2)
    assert f"{share / GB:.2f} GB of bf16 weights per GPU" in text
    assert resolved.head.intermediate_size == 6 * hidden  # the published drafts' width: the target has no dense MLP


def test_autotune_refuses_a_recurrent_target_naming_why(tiny_target_dir, gsm8k_file, tmp_path):
    save_target(tmp_path / "target", "qwen3_next", AutoTokenizer.from_pretrained(tiny_target_dir))
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    build_head({"type": "eagle3", "layer_ids": [1, 3, 4], "intermediate_size": 64}, target).save_pretrained(
        tmp_path / "head"
    )
    argv = ["--target", str(tmp_path / "target"), "--head", str(tmp_path / "head"), "--bench", str(gsm8k_file)]
    argv += ["--calibration", "1", "--heldout", "1", "--device", "cpu", "--out", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="tunes trees and batch schedules, and qwen3_next targets carry recurrent"):
        autotune.main(argv)
