"""Test-wide settings: no network, no wandb, seeded, one place for the bundled model paths."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "assets" / "demo-target"
DRAFT = REPO / "assets" / "demo-draft"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is much faster than two fighting over cores shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TARGET).eval(), AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="session")
def draft():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DRAFT).eval(), AutoTokenizer.from_pretrained(DRAFT)


GSM8K_ROWS = [
    {
        "question": f"Ann has {i} apples and buys {i + 3} more. How many apples does she have?",
        "answer": f"She has {i}+{i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}",
    }
    for i in range(48)
]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama with the bundled tokenizer's design, saved like a real HF model folder."""
    from transformers import LlamaForCausalLM

    from scripts.build_demo_models import build_tokenizer, model_config, to_messages

    out = tmp_path_factory.mktemp("tiny-target")
    tokenizer = build_tokenizer([to_messages(r, None) for r in GSM8K_ROWS], vocab_size=400, min_frequency=1)
    arch = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(model_config(arch, tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return path
