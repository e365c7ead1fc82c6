"""Draft heads: shapes, the EAGLE-3 vocab mapping and TTT mask, save/load, compatibility, incremental drafting."""

import json

import pytest
import torch
from transformers import LlamaConfig

from headstart.core.models import default_aux_layers
from headstart.heads import KVCache, arch_from_target, build_head, load_head, read_head_config, ttt_attention_mask
from headstart.heads.eagle import EagleHead
from headstart.heads.eagle3 import Eagle3Head, Eagle3Options, build_vocab_mapping
from headstart.heads.layers import DecoderLayer, RotaryEmbedding
from headstart.heads.losses import label_mask
from headstart.heads.medusa import Lora, medusa2_wrap, medusa_loss, medusa_weight_at
from tests.helpers import LAYER_IDS, make_batch, tiny_llama

V, H = 300, 32


@pytest.fixture(scope="module")
def default_tiny_llama():
    return tiny_llama()


def eagle3(target, **options):
    return build_head({"type": "eagle3", "layer_ids": LAYER_IDS, "draft_vocab_size": 200, **options}, target)


def test_decoder_layer_matches_hf_llama_layer():
    # Our rotary attention (GQA) + SwiGLU layer, given the target's layer-0 weights, is the target's layer 0.
    target = tiny_llama(num_hidden_layers=2)
    layer = DecoderLayer(arch_from_target(target.config))
    layer.load_state_dict(target.model.layers[0].state_dict())
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        expected = target(ids, output_hidden_states=True).hidden_states[1]  # output of layer 0
        cos, sin = RotaryEmbedding(arch_from_target(target.config))(torch.arange(9).expand(2, 9), torch.float32)
        ours = layer(target.model.embed_tokens(ids), cos, sin)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


ROPE_TYPES = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},  # attention factor 1 + 0.1 ln 4
    "dynamic": {"factor": 2.0},  # NTK base grows past max_position_embeddings (256)
    "longrope": {  # long factors past original_max_position_embeddings, attention factor from 256 / 64
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_rotary_types_match_transformers_rotary_embedding(rope_type):
    # Our cos/sin (frequencies from transformers' ROPE_INIT_FUNCTIONS, times the type's attention factor) equal
    # transformers' own Llama rotary embedding, within and past the pretraining length.
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_TYPES[rope_type]}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope)
    ours = RotaryEmbedding(arch_from_target(cfg))
    for last in (40, 100, 600):  # within the original 64, within max_position_embeddings, past both
        positions = torch.arange(last - 30, last).expand(2, -1)
        expected = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
        torch.testing.assert_close(ours(positions, torch.float32), expected, atol=1e-5, rtol=1e-5)
    if rope_type in ("yarn", "longrope"):
        assert ours.attention_scaling > 1.1
    with pytest.raises(NotImplementedError, match="'axial'"):
        RotaryEmbedding(arch_from_target(LlamaConfig(rope_parameters={"rope_type": "axial", "rope_theta": 1e4})))


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_eagle_heads_draft_for_long_context_rope_targets(head_type):
    # A yarn target (Qwen2.5/3-style long context) gets a head whose rotary is the target's, scaling included.
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    target = tiny_llama(max_position_embeddings=256, rope_parameters=rope)
    head = build_head({"type": head_type}, target) if head_type == "eagle" else eagle3(target)
    positions = torch.arange(100, 110).expand(2, -1)
    expected = target.model.rotary_emb(torch.zeros(1), positions)
    torch.testing.assert_close(head.rotary(positions, torch.float32), expected, atol=1e-5, rtol=1e-5)
    batch = make_batch(target, seq=8)
    source = batch["aux_hidden"] if head_type == "eagle3" else batch["last_hidden"]
    with torch.no_grad():
        features = head.first_features(source)
        logp, _ = head.draft_step(batch["input_ids"], features, torch.arange(8).expand(2, 8), KVCache())
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 8))


def test_eagle_shapes(default_tiny_llama):
    head = build_head({"type": "eagle"}, default_tiny_llama)
    batch = make_batch(default_tiny_llama)
    logits, features = head(batch["input_ids"], head.first_features(batch["last_hidden"]))
    assert logits.shape == (2, 16, V) and logits.dtype == torch.float32
    assert features.shape == (2, 16, H) and features.dtype == torch.float32
    # No input norm on the first EAGLE layer, as vLLM's llama_eagle.py: the layer's input passes through unscaled.
    x = torch.randn(2, 3, H) * 7
    assert torch.equal(head.layers[0].input_layernorm(x), x)
    assert not any(name.startswith("layers.0.input_layernorm") for name in head.state_dict())
    loss, metrics = head.loss(batch)
    assert loss.dim() == 0 and set(metrics) == {"vloss", "ploss", "acc"}
    assert all(not k.startswith(("embed", "lm_head", "model.")) for k in head.state_dict())


def test_eagle3_shapes_and_target_vocab_log_probs(default_tiny_llama):
    head = eagle3(default_tiny_llama)
    batch = make_batch(default_tiny_llama)
    features = head.first_features(batch["aux_hidden"])
    assert features.shape == (2, 16, H)
    logits, out = head(batch["input_ids"], features)
    assert logits.shape == (2, 16, 200) and out.shape == (2, 16, H)
    assert head.midlayer.self_attn.q_proj.in_features == 2 * H and head.fc.in_features == 3 * H
    logp, _ = head.draft_step(batch["input_ids"][:, :4], features[:, :4], torch.arange(4).expand(2, 4), KVCache())
    assert logp.shape == (2, 4, V)
    assert torch.isinf(logp[..., ~head.t2d]).all() and torch.isfinite(logp[..., head.t2d]).all()
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 4))
    loss, metrics = head.loss(batch)
    assert set(metrics) == {f"{m}_{j}" for m in ("loss", "acc") for j in range(7)}
    assert sorted(head.state_dict()) == sorted(
        ["d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight"]
        + [f"midlayer.{n}" for n in head.midlayer.state_dict()]
    )


def test_medusa_shapes_and_init(default_tiny_llama):
    head = build_head({"type": "medusa"}, default_tiny_llama)
    batch = make_batch(default_tiny_llama)
    assert head(batch["last_hidden"]).shape == (2, 16, 4, V)
    logp = head.draft(batch["last_hidden"][:, -1])
    assert logp.shape == (2, 4, V)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 4))
    for seq in head.medusa_head:
        assert torch.equal(seq[-1].weight, default_tiny_llama.lm_head.weight) and not seq[0].linear.weight.any()


def test_vocab_mapping_keeps_most_frequent_and_round_trips():
    counts = torch.tensor([5, 0, 9, 1, 7, 7, 0, 3])
    d2t, t2d = build_vocab_mapping(counts, 4)
    targets = torch.arange(4) + d2t
    assert targets.tolist() == [0, 2, 4, 5]  # counts 9, 7, 7, 5: the four most frequent, in id order
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 2, 2]
    assert t2d.tolist() == [True, False, True, False, True, True, False, False]
    assert t2d[targets].all() and t2d.sum() == 4
    d2t, t2d = build_vocab_mapping(counts, 32000)  # larger than the vocab: the whole vocab, zero offsets
    assert not d2t.any() and d2t.numel() == 8 and t2d.all()


def test_eagle3_head_uses_the_mapping(default_tiny_llama):
    head = eagle3(default_tiny_llama)
    counts = torch.zeros(V)
    counts[100:300] = 1.0
    head.set_vocab_mapping(counts)
    assert head.target_ids(torch.tensor([0, 199])).tolist() == [100, 299]
    logp = head.to_target_vocab(torch.zeros(1, 200))
    assert torch.isinf(logp[0, :100]).all() and not logp[0, 100:].any()


def test_a_frozen_lm_head_is_the_targets_rows_and_never_trains(default_tiny_llama, tmp_path):
    counts = torch.zeros(V)
    counts[100:300] = 1.0
    frozen, trained = eagle3(default_tiny_llama, frozen_lm_head=True), eagle3(default_tiny_llama)
    for head in (frozen, trained):
        head.set_vocab_mapping(counts)
        head.loss(make_batch(default_tiny_llama))[0].backward()
    assert torch.equal(frozen.lm_head.weight, default_tiny_llama.lm_head.weight[100:300])
    assert frozen.lm_head.weight.grad is None and frozen.fc.weight.grad.abs().sum() > 0
    assert trained.lm_head.weight.grad.abs().sum() > 0
    assert not torch.equal(trained.lm_head.weight, default_tiny_llama.lm_head.weight[100:300])
    # Written only when set: heads saved before the option read and save the same.
    frozen.save_pretrained(tmp_path / "frozen")
    trained.save_pretrained(tmp_path / "trained")
    assert json.loads((tmp_path / "frozen" / "config.json").read_text())["frozen_lm_head"] is True
    assert "frozen_lm_head" not in json.loads((tmp_path / "trained" / "config.json").read_text())


def test_ttt_mask_matches_hand_built_reference():
    c = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]  # causal over the true prefix
    d = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]  # the chain's own key at its index
    z = [[0] * 4] * 4
    blocks = [[c, z, z], [c, d, z], [c, d, d]]  # row: query step j; column: key step m
    reference = torch.tensor([sum((blocks[j][m][i] for m in range(3)), []) for j in range(3) for i in range(4)])
    assert torch.equal(ttt_attention_mask(4, 3), reference.bool())


def test_ttt_steps_equal_drafting_a_chain(default_tiny_llama):
    # What TTT trains at step j, index i is exactly what drafting computes: prefix 0..i with true
    # features, then j draft steps feeding back the head's own features and the next real tokens.
    head = eagle3(default_tiny_llama)
    batch = make_batch(default_tiny_llama, batch=1, seq=10)
    ids = batch["input_ids"]
    with torch.no_grad():
        features = head.first_features(batch["aux_hidden"])
        steps = list(head.ttt_features(features, ids, 3))
        i = 5
        cache = KVCache()
        _, out = head(ids[:, 1 : i + 2], features[:, : i + 1], cache=cache)
        chain = out[:, -1:]
        torch.testing.assert_close(chain, steps[0][:, i : i + 1], atol=1e-5, rtol=1e-5)
        for j in (1, 2):
            _, chain = head(ids[:, i + j + 1 : i + j + 2], chain, torch.tensor([[i + j]]), cache=cache)
            torch.testing.assert_close(chain, steps[j][:, i : i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_draft_step_with_cache_equals_full_forward(default_tiny_llama, kind):
    head = build_head({"type": "eagle"}, default_tiny_llama) if kind == "eagle" else eagle3(default_tiny_llama)
    batch = make_batch(default_tiny_llama, seq=12)
    source = batch["last_hidden"] if kind == "eagle" else batch["aux_hidden"]
    with torch.no_grad():
        features = head.first_features(source)
        ids = batch["input_ids"]
        full_logits, full_features = head(ids, features)
        full_logp = head.draft_step(ids, features, torch.arange(12).expand(2, 12), KVCache())[0]
        cache, logps, outs = KVCache(), [], []
        for start, end in [(0, 5), (5, 6), (6, 7), (7, 12)]:
            positions = torch.arange(start, end).expand(2, -1)
            logp, out = head.draft_step(ids[:, start:end], features[:, start:end], positions, cache)
            logps.append(logp)
            outs.append(out)
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(outs, 1), full_features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(logps, 1), full_logp, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(full_logits).all()


def test_kv_cache_writes_in_place_and_doubles_when_outgrown():
    torch.manual_seed(0)
    chunks = [torch.randn(2, 2, n, 4) for n in (3, 1, 2, 5)]
    cache = KVCache(min_capacity=4)
    k, _ = cache.append(chunks[0], -chunks[0])
    storage, capacity = k.untyped_storage(), k.untyped_storage().nbytes() // (2 * 2 * 4 * 4)
    assert capacity == 4
    k, v = cache.append(chunks[1], -chunks[1])  # fits: written into the same buffer, no copy of the cache
    assert k.untyped_storage().data_ptr() == storage.data_ptr() and cache.length == 4
    k, v = cache.append(chunks[2], -chunks[2])  # 6 > 4: the buffer doubles, the cached keys move over
    assert k.untyped_storage().nbytes() // (2 * 2 * 4 * 4) == 8
    assert torch.equal(k, torch.cat(chunks[:3], 2)) and torch.equal(v, -torch.cat(chunks[:3], 2))
    cache.crop(2)  # the rejected slots are overwritten by the next append
    k, v = cache.append(chunks[3], -chunks[3])  # 7 fits in 8
    assert torch.equal(k, torch.cat((chunks[0][:, :, :2], chunks[3]), 2)) and cache.length == 7
    cache.keep(torch.tensor([[0, 6], [1, 2]]))  # per-row slots
    assert torch.equal(cache.k[0], torch.stack((chunks[0][0, :, 0], chunks[3][0, :, 4]), 1))
    assert torch.equal(cache.v[1], -torch.stack((chunks[0][1, :, 1], chunks[3][1, :, 0]), 1))
    with pytest.raises(ValueError, match="negative length"):
        cache.crop(-1)


def test_drafting_through_cache_growth_equals_a_full_forward(default_tiny_llama):
    head = eagle3(default_tiny_llama)
    batch = make_batch(default_tiny_llama, seq=12)
    with torch.no_grad():
        features = head.first_features(batch["aux_hidden"])
        full_logp, full_out = head.draft_step(batch["input_ids"], features, torch.arange(12).expand(2, 12), KVCache())
        cache, logps, outs = KVCache(min_capacity=2), [], []
        for start in range(0, 12, 3):  # the buffer grows 3 -> 6 -> 12
            positions = torch.arange(start, start + 3).expand(2, -1)
            logp, out = head.draft_step(
                batch["input_ids"][:, start : start + 3], features[:, start : start + 3], positions, cache
            )
            logps.append(logp)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(logps, 1), full_logp, atol=1e-5, rtol=1e-5)


def test_tree_mask_and_keep_commit_a_branch(default_tiny_llama):
    # Prefix of 6, then a tree a -> {b1, b2} drafted in one step; b2's output equals drafting a, b2 in a line,
    # and keeping the prefix + a + b2 slots leaves the cache a linear drafting would have.
    head = build_head({"type": "eagle"}, default_tiny_llama)
    batch = make_batch(default_tiny_llama, batch=1, seq=9)
    ids, feats = batch["input_ids"], head.first_features(batch["last_hidden"])
    with torch.no_grad():
        tree = KVCache()
        head.draft_step(ids[:, :6], feats[:, :6], torch.arange(6)[None], tree)
        allowed = torch.ones(3, 9, dtype=torch.bool)
        allowed[0, 7:] = False  # a sees the prefix and itself
        allowed[1, 8] = False  # b1 sees prefix, a, b1
        allowed[2, 7] = False  # b2 sees prefix, a, b2
        mask = torch.zeros(1, 1, 3, 9).masked_fill(~allowed, float("-inf"))
        tree_ids, tree_feats = ids[:, 6:9], feats[:, 6:9]
        tree_logp, _ = head.draft_step(tree_ids, tree_feats, torch.tensor([[6, 7, 7]]), tree, mask)
        line = KVCache()
        head.draft_step(ids[:, :6], feats[:, :6], torch.arange(6)[None], line)
        line_logp, _ = head.draft_step(tree_ids[:, [0, 2]], tree_feats[:, [0, 2]], torch.tensor([[6, 7]]), line)
        torch.testing.assert_close(tree_logp[:, [0, 2]], line_logp, atol=1e-5, rtol=1e-5)
        tree.keep(torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))
        torch.testing.assert_close(tree.k, line.k)
        tree.crop(6)
        assert tree.length == 6 and torch.equal(tree.v, line.v[:, :, :6])


@pytest.mark.parametrize("cfg", [{"type": "eagle"}, {"type": "eagle3"}, {"type": "medusa", "num_layers": 2}])
def test_save_load_round_trip(default_tiny_llama, tmp_path, cfg):
    head = eagle3(default_tiny_llama) if cfg["type"] == "eagle3" else build_head(cfg, default_tiny_llama)
    for p in head.parameters():  # make every weight matter (Medusa's blocks start at zero)
        p.data.normal_(0, 0.1)
    if cfg["type"] == "eagle3":
        head.set_vocab_mapping(torch.arange(V, dtype=torch.float))
    head.save_pretrained(tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_head(tmp_path / "head", default_tiny_llama)
    assert type(loaded) is type(head) and loaded.config == head.config
    batch = make_batch(default_tiny_llama, seq=8)
    with torch.no_grad():
        if cfg["type"] == "medusa":
            assert torch.equal(loaded(batch["last_hidden"]), head(batch["last_hidden"]))
        else:
            source = batch["aux_hidden"] if cfg["type"] == "eagle3" else batch["last_hidden"]
            a = head.draft_step(
                batch["input_ids"], head.first_features(source), torch.arange(8).expand(2, 8), KVCache()
            )
            b = loaded.draft_step(
                batch["input_ids"], loaded.first_features(source), torch.arange(8).expand(2, 8), KVCache()
            )
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    config = head.config
    assert config.type == cfg["type"] and config.target_hidden_size == H and config.vocab_size == V
    if cfg["type"] == "eagle3":
        assert config.options.layer_ids == LAYER_IDS and config.options.draft_vocab_size == 200
        assert torch.equal(loaded.d2t, head.d2t) and loaded.d2t[0] == 100


def test_loading_on_the_wrong_target_names_the_mismatch(default_tiny_llama, tmp_path):
    eagle3(default_tiny_llama).save_pretrained(tmp_path / "e3")
    build_head({"type": "eagle"}, default_tiny_llama).save_pretrained(tmp_path / "e1")
    with pytest.raises(ValueError, match="hidden size 32 vs 64"):
        load_head(tmp_path / "e1", tiny_llama(hidden_size=64))
    with pytest.raises(ValueError, match="vocab size 300 vs 320"):
        load_head(tmp_path / "e3", tiny_llama(vocab_size=320))
    with pytest.raises(ValueError, match="head type 'eagle3' vs 'eagle'"):
        EagleHead.from_pretrained(tmp_path / "e3", default_tiny_llama)
    with pytest.raises(ValueError, match=r"layer ids \[5\] outside the target's 4 layers"):
        Eagle3Head.from_pretrained(tmp_path / "e3", tiny_llama(num_hidden_layers=4))
    with pytest.raises(ValueError, match="three distinct target layers"):
        build_head({"type": "eagle3"}, default_tiny_llama)  # (2, L//2, L-3) collide for 6 layers
    with pytest.raises(ValueError, match="unknown eagle head options"):
        build_head({"type": "eagle", "ttt_steps": 3}, default_tiny_llama)


def test_eagle3_default_layers_are_the_captures_default():
    # One rule (core.models.default_aux_layers) for what the capture stores and the head fuses.
    head = build_head({"type": "eagle3"}, tiny_llama(num_hidden_layers=10))
    assert head.config.options.layer_ids == default_aux_layers(10) == [2, 5, 7]
    assert head.hidden_layers == (2, 5, 7)
    for layers in (3, 6):  # (2, 1, 0) would fuse the embeddings; (2, 3, 3) has two layers
        with pytest.raises(ValueError, match="too few for EAGLE-3's default layers"):
            build_head({"type": "eagle3"}, tiny_llama(num_hidden_layers=layers))


def test_heads_read_the_final_hidden_state_unless_they_fuse_layers(default_tiny_llama):
    assert build_head({"type": "eagle"}, default_tiny_llama).hidden_layers == (
        6,
    )  # hidden_states[6]: after the final norm
    assert build_head({"type": "medusa"}, default_tiny_llama).hidden_layers == (6,)
    assert eagle3(default_tiny_llama).hidden_layers == tuple(LAYER_IDS)


def test_medusa2_takes_the_lora_section_with_the_schema_defaults():
    # The config's whole lora: section (loss weights included), its defaults from heads.medusa.Lora.
    model = medusa2_wrap(tiny_llama(), {"r": 4, "head_weight": 0.5, "head_weight_warmup": 10})
    peft = model.peft_config["default"]
    defaults = Lora()
    assert peft.r == 4 and peft.lora_alpha == defaults.alpha and peft.lora_dropout == defaults.dropout
    assert peft.target_modules == set(defaults.target_modules)
    with pytest.raises(ValueError, match=r"lora: unknown key 'rank' \(known: alpha, dropout"):
        medusa2_wrap(tiny_llama(), {"rank": 4})


def test_head_config_is_typed_and_keeps_the_config_json_layout(default_tiny_llama, tmp_path):
    head = eagle3(default_tiny_llama)
    head.config.training = {"step": 3}
    head.save_pretrained(tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert list(saved) == [
        "type", "target", "target_hidden_size", "vocab_size",
        "layer_ids", "draft_vocab_size", "ttt_steps", "ttt_decay", "draft_layer", "norm_before_fc", "fc_norm",
        "norm_output", "arch", "training",
    ]  # fmt: skip
    assert saved["layer_ids"] == LAYER_IDS and saved["arch"]["num_key_value_heads"] == 2
    assert list(saved["arch"]) == [
        "family", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope", "vocab_size", "num_hidden_layers",
        "qkv_bias", "qk_norm",
    ]  # fmt: skip
    config = read_head_config(tmp_path / "head")
    assert isinstance(config.options, Eagle3Options) and config.arch.head_dim == 8 and config == head.config
    path = tmp_path / "head" / "config.json"
    path.write_text(json.dumps({**saved, "ttt_steps": 0}))
    with pytest.raises(ValueError, match=r"config\.json: ttt_steps must be >= 1, got 0"):
        read_head_config(tmp_path / "head")
    path.write_text(json.dumps({**saved, "type": "hydra"}))
    with pytest.raises(ValueError, match=r"config\.json: unknown head type 'hydra'"):
        load_head(tmp_path / "head", default_tiny_llama)


def test_medusa2_trains_only_lora_and_heads():
    target = tiny_llama()
    head = build_head({"type": "medusa"}, target)
    model = medusa2_wrap(target, {"r": 4, "alpha": 8})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.requires_grad for p in head.parameters())
    batch = make_batch(target, seq=8)
    out = model(input_ids=batch["input_ids"], output_hidden_states=True)
    weight = medusa_weight_at(step=5, warmup_steps=10, final_weight=0.2)
    loss, metrics = medusa_loss(head(out.hidden_states[-1]), batch, lm_logits=out.logits, medusa_weight=weight)
    heads_only, _ = medusa_loss(head(out.hidden_states[-1]), batch)
    torch.testing.assert_close(loss, metrics["lm_loss"] + 0.1 * heads_only)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    assert head.medusa_head[3][0].linear.weight.grad is not None
    assert [medusa_weight_at(s, 10, 0.2) for s in (0, 5, 10, 50)] == [0.0, 0.1, 0.2, 0.2]


def test_label_mask_counts_a_label_by_its_own_position():
    batch = {"loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}
    assert label_mask(batch, 1).int().tolist() == [[0, 1, 1, 1, 0, 0]]  # position i predicts token i+1
    assert label_mask(batch, 2).int().tolist() == [[1, 1, 1, 0, 0, 0]]  # EAGLE step 0 / Medusa head 0


@pytest.mark.parametrize("cfg", [{"type": "eagle"}, {"type": "eagle3", "ttt_steps": 3}, {"type": "medusa"}])
def test_right_padding_does_not_change_the_loss(default_tiny_llama, cfg):
    head = eagle3(default_tiny_llama, ttt_steps=3) if cfg["type"] == "eagle3" else build_head(cfg, default_tiny_llama)
    batch = make_batch(default_tiny_llama, seq=12)
    batch["loss_mask"][:, :3] = 0
    padded = {
        k: torch.cat((v, torch.randn_like(v[:, :4]) if v.is_floating_point() else v[:, :4]), 1)
        for k, v in batch.items()
    }
    padded["attention_mask"][:, 12:] = 0
    padded["loss_mask"][:, 12:] = 1  # even a stray loss_mask on padding must not count
    with torch.no_grad():
        loss, metrics = head.loss(batch)
        padded_loss, padded_metrics = head.loss(padded)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(padded_metrics, metrics)


def peagle(target, **options):
    return eagle3(target, **{"parallel_drafting": True, **options})


def test_peagle_steps_equal_one_forward_as_vllm_feeds_the_draft(default_tiny_llama):
    # vLLM's parallel drafting (vllm/v1/spec_decode/utils.py copy_and_expand_eagle_inputs): one causal forward
    # over the context pairs (token i+1, fc(aux_i)) at positions 0..i, the last one holding the next token,
    # then j mask slots (the mask token, fc(mask_hidden)) at positions i+1..i+j. Training step j at index i
    # must be that forward's last output.
    head = peagle(default_tiny_llama)
    batch = make_batch(default_tiny_llama, batch=1, seq=10)
    ids, i = batch["input_ids"], 5
    with torch.no_grad():
        features = head.first_features(batch["aux_hidden"])
        steps = list(head.ttt_features(features, ids, 4))
        mask_token = head.config.options.parallel_drafting.mask_token_id
        mask_feature = batch["aux_hidden"].new_zeros(1, 1, 3 * H) + head.mask_hidden  # before fc, like vLLM
        for j in range(4):
            served_ids = torch.cat((ids[:, 1 : i + 2], torch.full((1, j), mask_token)), 1)
            served_features = torch.cat((features[:, : i + 1], head.fc(mask_feature).expand(1, j, H)), 1)
            _, out = head(served_ids, served_features, torch.arange(i + 1 + j)[None])
            torch.testing.assert_close(out[:, -1], steps[j][:, i], atol=1e-5, rtol=1e-5)
    # EAGLE-3's steps 1.. read the next token and the previous output instead: another computation.
    regular = eagle3(default_tiny_llama)
    regular.load_state_dict({k: v for k, v in head.state_dict().items() if k != "mask_hidden"})
    with torch.no_grad():
        ttt = list(regular.ttt_features(features, ids, 2))
    torch.testing.assert_close(ttt[0], steps[0])
    assert (ttt[1] - steps[1]).abs().max() > 1e-2


def test_peagle_records_its_mask_token_and_round_trips(default_tiny_llama, tmp_path):
    head = peagle(default_tiny_llama)
    # The target's config has no pad token: its eos (2) is the mask token.
    assert head.config.options.parallel_drafting.mask_token_id == 2
    assert head.mask_hidden.shape == (1, 3 * H)
    head.save_pretrained(tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["parallel_drafting"] == {"mask_token_id": 2}
    loaded = load_head(tmp_path / "head", default_tiny_llama)
    assert loaded.config == head.config and torch.equal(loaded.mask_hidden, head.mask_hidden)
    assert peagle(tiny_llama(pad_token_id=7)).config.options.parallel_drafting.mask_token_id == 7
    given = peagle(default_tiny_llama, parallel_drafting={"mask_token_id": 299})
    assert given.config.options.parallel_drafting.mask_token_id == 299
    with pytest.raises(ValueError, match=r"mask_token_id 300 is not a token of the target's 300-token vocabulary"):
        peagle(default_tiny_llama, parallel_drafting={"mask_token_id": 300})
    with pytest.raises(ValueError, match=r"unknown key parallel_drafting\.mask_token"):
        peagle(default_tiny_llama, parallel_drafting={"mask_token": 3})


def test_a_head_used_before_it_is_attached_to_a_target_says_so(default_tiny_llama):
    head = build_head({"type": "eagle"}, default_tiny_llama)
    detached = type(head)(head.config)  # as a head is between __init__ and attach
    batch = make_batch(default_tiny_llama, seq=4)
    with pytest.raises(RuntimeError, match="this eagle head is not attached to a target: make it with build_head"):
        detached(batch["input_ids"], detached.first_features(batch["last_hidden"]))
    assert head.target.lm_head is default_tiny_llama.lm_head


def test_mask_slots_of_an_eagle3_head_without_parallel_drafting_are_refused(default_tiny_llama):
    with pytest.raises(ValueError, match="mask slots are P-EAGLE's: this EAGLE-3 head has no head.parallel_drafting"):
        eagle3(default_tiny_llama).mask_slots(1, 2)


CONFIG_EDITS = [
    # A config.json edited by hand: refused naming the file, the key, its value and the target's (or the
    # weights') side, never torch's size-mismatch, missing-key or index error, nor a head that loads wrong.
    ("eagle3", {"target_hidden_size": 64}, r"head/config\.json: .*target_hidden_size 64 vs 32"),
    ("eagle3", {"vocab_size": 320}, r"head/config\.json: .*vocab_size 320 vs 300 \(head vs target\)"),
    (
        "eagle3",
        {"draft_vocab_size": 400},
        r"head/config\.json: .*draft_vocab_size 400 vs vocab size 300: the draft vocabulary must not be larger",
    ),
    (
        "eagle3",
        {"layer_ids": [5, 1, 3]},
        r"head/config\.json: not what a eagle3 head's build makes: layer_ids \[5, 1, 3\] \(a build for this "
        r"target makes \[1, 3, 5\]\)",
    ),
    (
        "peagle",
        {"parallel_drafting": {"mask_token_id": 300}},
        r"head/config\.json: head\.parallel_drafting\.mask_token_id 300 is not a token of the target's 300-token",
    ),
    ("medusa", {"target_hidden_size": 16}, r"head/config\.json: .*target_hidden_size 16 vs 32"),
    (
        "medusa",
        {"num_layers": 2},
        r"head/model\.safetensors does not fit .*head/config\.json \(target_hidden_size 32, vocab_size 300, "
        r"num_heads 4, num_layers 2\): missing medusa_head\.0\.1\.linear\.bias; .*; and \d+ more",
    ),
]


@pytest.mark.parametrize(("kind", "edit", "message"), CONFIG_EDITS)
def test_an_edited_config_json_is_refused_naming_the_file_the_key_and_both_sides(
    default_tiny_llama, tmp_path, kind, edit, message
):
    head = {"eagle3": eagle3, "peagle": peagle}.get(kind, lambda t: build_head({"type": kind}, t))(default_tiny_llama)
    head.save_pretrained(tmp_path / "head")
    path = tmp_path / "head" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))
    with pytest.raises(ValueError, match=message):
        load_head(tmp_path / "head", default_tiny_llama)
