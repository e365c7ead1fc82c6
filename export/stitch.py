"""A copy of the target with a head's tensors in place of the checkpoint's own (``export --stitch``): for a head
that is part of the target's checkpoint (an MTP head: its tensors are the checkpoint's MTP layer), a target an
engine serves as it would the original, with the tuned layer.

Every file of the target is copied as it is, except the safetensors files holding a replaced tensor, which are
written again with the head's values in the stored dtype (the index, when there is one, stays right: no tensor moves
to another file). A head tensor the checkpoint does not hold, or holds in another shape, is refused before anything
is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headstart.core.io import atomic_dir
from headstart.core.weights import checkpoint_folder, first_names, tensor_files


def check_stitchable(files: dict[str, Path], tensors: dict[str, torch.Tensor], target: str) -> None:
    """ValueError naming the head's tensors that the checkpoint lacks or stores in another shape."""
    foreign = [name for name in tensors if name not in files]
    if foreign:
        raise ValueError(
            f"the head's tensors {first_names(sorted(foreign))} are not tensors of {target}'s checkpoint: only a "
            "head that is part of the target's checkpoint (an MTP head) can be stitched into it"
        )
    for file in {files[name] for name in tensors}:
        with safe_open(str(file), framework="pt") as f:
            for name in (n for n in tensors if files[n] == file):
                stored = tuple(f.get_slice(name).get_shape())
                if stored != tuple(tensors[name].shape):
                    raise ValueError(f"{file}: {name} has shape {list(stored)}, the head's {list(tensors[name].shape)}")


def stitch_target(target: str, tensors: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write ``target``'s checkpoint folder to ``out`` with ``tensors`` (checkpoint name -> value) in place."""
    folder = checkpoint_folder(target)
    files = {name: file.resolve() for name, file in tensor_files(folder).items()}
    check_stitchable(files, tensors, target)
    rewritten = {files[name] for name in tensors}
    with atomic_dir(out) as tmp:
        for item in sorted(folder.iterdir()):
            if not item.is_file():
                continue
            if item.resolve() in rewritten:
                with safe_open(str(item), framework="pt") as f:
                    stored = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iter
                    metadata = f.metadata()
                replaced = {name: tensors[name].to(stored[name].dtype) for name in stored if name in tensors}
                save_file({**stored, **replaced}, str(tmp / item.name), metadata=metadata)
            else:
                shutil.copy2(item, tmp / item.name)
    return Path(out)
