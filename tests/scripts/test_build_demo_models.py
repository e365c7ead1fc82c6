"""The script that trains the bundled models: tokenizer, packing, schedule and exact resume."""

import pytest
import torch
from transformers import LlamaForCausalLM

from headstart.scripts.dev.build_demo_models import (
    DemoModel,
    ModelTraining,
    batch_for_step,
    build_tokenizer,
    encode,
    learning_rate,
    model_config,
    pack,
    read_gsm8k,
    to_messages,
    train_model,
)

ROWS = [
    {
        "question": f"Sam has {i} pens and buys {i + 2} more. How many pens?",
        "answer": f"{i}+{i + 2} = {2 * i + 2}\n#### {2 * i + 2}",
    }
    for i in range(40)
]
HP = ModelTraining(
    seq_len=32,
    batch_size=4,
    steps=6,
    lr=1e-2,
    min_lr_ratio=0.1,
    warmup_steps=2,
    weight_decay=0.1,
    grad_clip=1.0,
    dtype="fp32",
    ckpt_every=3,
)
ARCH = DemoModel(
    name="tiny",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    train=HP,
)


@pytest.fixture(scope="module")
def tiny():
    conversations = [to_messages(row, "Be brief." if i % 3 == 0 else None) for i, row in enumerate(ROWS)]
    tokenizer = build_tokenizer(conversations, vocab_size=400, min_frequency=1)
    blocks = pack([encode(tokenizer, c) for c in conversations], HP.seq_len)
    return tokenizer, blocks


def test_tokenizer_is_byte_level_with_split_digits_and_specials(tiny):
    tokenizer, _ = tiny
    text = "Ünïcode 12345 ✓"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode([i]) for i in tokenizer(" 123")["input_ids"]][-3:] == ["1", "2", "3"]
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def test_encode_masks_only_assistant_tokens(tiny):
    tokenizer, _ = tiny
    sample = encode(tokenizer, to_messages(ROWS[1], None))
    answer = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["assistant_masks"]) if m])
    assert answer == ROWS[1]["answer"] + "<|im_end|>"


def test_pack_cuts_equal_blocks(tiny):
    assert pack([{"input_ids": list(range(10))}, {"input_ids": list(range(7))}], 4).tolist() == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
        [2, 3, 4, 5],
    ]


def test_learning_rate_warms_up_then_decays_to_floor():
    hp = HP.model_copy(update={"lr": 1.0, "warmup_steps": 10, "steps": 110, "min_lr_ratio": 0.1})
    assert learning_rate(0, hp) == pytest.approx(0.1)
    assert learning_rate(9, hp) == pytest.approx(1.0)
    assert learning_rate(60, hp) == pytest.approx(0.55)
    assert learning_rate(110, hp) == pytest.approx(0.1)


def test_batches_depend_only_on_seed_and_step_and_cover_each_epoch():
    blocks = torch.arange(20).view(10, 2)
    assert torch.equal(batch_for_step(blocks, 7, 2, seed=0), batch_for_step(blocks, 7, 2, seed=0))
    epoch0 = torch.cat([batch_for_step(blocks, s, 2, seed=0) for s in range(5)])
    epoch1 = torch.cat([batch_for_step(blocks, s, 2, seed=0) for s in range(5, 10)])
    assert sorted(epoch0[:, 0].tolist()) == sorted(epoch1[:, 0].tolist()) == list(range(0, 20, 2))
    assert not torch.equal(epoch0, epoch1)


def test_seed_0_keeps_the_order_the_bundled_models_were_trained_in():
    # The bundled models were built with seed 0, each epoch's order seeded by its epoch number.
    blocks = torch.arange(20).view(10, 2)
    for step in (0, 3, 5, 9):
        epoch, index = divmod(step, 5)
        order = torch.randperm(10, generator=torch.Generator().manual_seed(epoch))
        assert torch.equal(batch_for_step(blocks, step, 2, seed=0), blocks[order[index * 2 : (index + 1) * 2]])


def test_killed_training_resumes_to_identical_weights(tiny, tmp_path):
    tokenizer, blocks = tiny

    def fresh_model():
        torch.manual_seed(0)
        return LlamaForCausalLM(model_config(ARCH, tokenizer))

    straight = fresh_model()
    train_model(straight, blocks, HP, tmp_path / "a" / "ckpt.pt", seed=0, device=torch.device("cpu"))

    interrupted = fresh_model()
    train_model(
        interrupted,
        blocks,
        HP.model_copy(update={"steps": 3}),
        tmp_path / "b" / "ckpt.pt",
        seed=0,
        device=torch.device("cpu"),
    )
    resumed = fresh_model()
    stats = train_model(resumed, blocks, HP, tmp_path / "b" / "ckpt.pt", seed=0, device=torch.device("cpu"))

    assert len(stats["loss_history"]) == HP.steps
    assert stats["loss_history"][-1] < stats["loss_history"][0]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["ckpt.pt"]


def test_malformed_gsm8k_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a GSM8K row"):
        read_gsm8k(path)


def test_a_gsm8k_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "a"}\n' + '{"question": "Café?", "answer": "a"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at byte 18"):
        read_gsm8k(path)
