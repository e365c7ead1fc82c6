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


@pytest.fixture(scope="session")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TARGET).eval(), AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="session")
def draft():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DRAFT).eval(), AutoTokenizer.from_pretrained(DRAFT)
