"""The training optimizer (``train.optimizer``): torch's AdamW over every trained parameter, or Muon on the draft's
weight matrices beside AdamW on the rest.

Muon (momentum, then the update orthogonalised by Newton-Schulz iterations) is defined on matrices, so it takes the
2-D weights and AdamW keeps the norms, biases, and the embedding-like and vocabulary matrices, whose rows are tokens
rather than directions of one linear map (speculators' split: ``embed_tokens``, ``lm_head``, ``codebook``,
``markov_w1``/``markov_w2``, and matrices with a side of 1), and so do the parts a head type names
(``DraftHead.adamw_under_muon``: Domino's correction), or those ``train.muon_exclude`` names in their place.

It is DeepSpeed's ``MuonWithAuxAdam``, not ``torch.optim.Muon``: ZeRO-1/2/3 hand the optimizer flat fp32 partitions,
on which torch's Muon cannot orthogonalise anything (it refuses 1-D parameters), while DeepSpeed's ZeRO recognises
this optimizer and parameters tagged ``use_muon``, gathers each matrix's whole gradient and orthogonalises it before
the step (``stage_1_and_2.py``, ``stage3.py``; with no ZeRO partitioning the optimizer does it itself). Its AdamW
half is torch's AdamW with the AdamW path's settings, so only the matrices train differently.

Under ZeRO that gathered update is what DeepSpeed then measures and clips as "the gradient", so DeepSpeed's clipping
is off for Muon there (``train.deepspeed_engine.gradient_clipping``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headstart.train.train_config import Train

# Parameter names that stay with AdamW although 2-D (speculators' list: embeddings, token codebooks, the Markov
# head's vocabulary factors, output heads).
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")
MUON_MOMENTUM = 0.95  # Muon's, DeepSpeed's and speculators' default


def takes_muon(name: str, param: torch.Tensor, vocab_size: int, exclude: tuple[str, ...] = ()) -> bool:
    """Whether Muon trains ``param``: a matrix with both sides above 1, not embedding-like by its name, not a
    projection to or from the target's ``vocab_size`` tokens (a Medusa head's lm_head), and not named by
    ``exclude`` (``build_optimizer``'s list)."""
    return (
        param.ndim == 2
        and min(param.shape) > 1
        and vocab_size not in param.shape
        and not any(hint in name for hint in (*ADAMW_NAME_HINTS, *exclude))
    )


def muon_parameters(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that Muon trains (tagged by ``build_optimizer``; none under AdamW): what a
    checkpoint's optimizer state was laid out for."""
    return sorted(name for name, p in module.named_parameters() if getattr(p, "use_muon", False))


def optimizer_settings(train: Train) -> dict[str, Any]:
    """What the optimizer's parameter groups hold of the config: ``lr`` (and ``muon_lr`` under Muon), ``weight_decay``
    and ``betas``. A resume restores the checkpoint's over the config's (the scheduler's ``LambdaLR.base_lrs``, the
    optimizer state's param_groups), so it checks them."""
    rates = {"lr": train.lr} | ({"muon_lr": train.muon_lr} if train.optimizer == "muon" else {})
    return rates | {"weight_decay": train.weight_decay, "betas": list(train.betas)}


def build_optimizer(
    module: nn.Module, train: Train, vocab_size: int, head_exclude: tuple[str, ...] = ()
) -> torch.optim.Optimizer:
    """The optimizer of ``module``'s trainable parameters that ``train.optimizer`` names (the module docstring);
    ``vocab_size``: the target's, whose matrices stay with AdamW; ``head_exclude``: the head type's names that stay
    with AdamW under Muon (``DraftHead.adamw_under_muon``) unless ``train.muon_exclude`` names others."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    betas = (train.betas[0], train.betas[1])
    adamw: dict[str, Any] = {"lr": train.lr, "betas": betas, "weight_decay": train.weight_decay}
    if train.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    # Imported here: importing DeepSpeed's Muon compiles its kernels.
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    exclude = head_exclude if train.muon_exclude is None else tuple(train.muon_exclude)
    unmatched = [hint for hint in exclude if not any(hint in name for name, _ in named)]
    if unmatched:  # a misspelt name would silently train its matrices with Muon
        raise ValueError(
            f"train.muon_exclude: {unmatched} is part of no trained parameter's name (they start with "
            f"{sorted({name.split('.')[0] for name, _ in named})})"
        )
    for name, p in named:
        p.use_muon = takes_muon(name, p, vocab_size, exclude)  # type: ignore[attr-defined]  # what ZeRO reads
    matrices = [p for _, p in named if p.use_muon]  # type: ignore[attr-defined]
    rest = [p for _, p in named if not p.use_muon]  # type: ignore[attr-defined]
    muon = {"lr": train.muon_lr, "momentum": MUON_MOMENTUM, "weight_decay": train.weight_decay}
    groups = [dict(params=matrices, use_muon=True, **muon), dict(params=rest, use_muon=False, eps=1e-8, **adamw)]
    return MuonWithAuxAdam([g for g in groups if g["params"]], adam_optimizer=torch.optim.AdamW)
