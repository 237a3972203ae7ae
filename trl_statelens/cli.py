"""The ``statelens`` command: ``statelens lab build``, ``statelens lab info``, ``statelens eval``, ``statelens report``,
``statelens preflight``, ``statelens guards replay``.

Each command imports what it needs when it runs: ``statelens --help``, ``statelens lab info`` and ``statelens report
--help`` never import torch, transformers or pandas (``tests/test_cli.py`` checks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RECIPES = ("opd", "self_distill", "grpo", "sft")  # the recipes whose trainer `statelens preflight` builds


def _lab_build(args: argparse.Namespace) -> int:
    from .lab import build_lab, build_teacher, lab_info

    pretrain = {} if args.max_steps is None else {"max_steps": args.max_steps}  # none: the shipped lab may be copied
    root = build_lab(seed=args.seed, size=args.size, force=args.force, **pretrain)
    build_teacher(seed=args.seed, steps=args.teacher_steps, force=args.force)
    info = lab_info(args.seed)
    print(f"lab ready at {root}")
    _print_info(info)
    return 0


def _lab_info(args: argparse.Namespace) -> int:
    from .lab import lab_dir, lab_info

    info = lab_info(args.seed)
    if info is None:
        print(f"no lab built at {lab_dir(args.seed)}: run `statelens lab build --seed {args.seed}`")
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"lab at {lab_dir(args.seed)}")
        _print_info(info)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .evaluation import run_eval_cli
    from .reports.runs import LAB, LAB_TEACHER, SMOLLM2, resolve_model

    if args.model in (LAB, LAB_TEACHER, SMOLLM2):  # the named models: built or converted on first use
        args.model = resolve_model(args.model, args.lab_seed)
    run_eval_cli(args)
    return 0


def _report(args: argparse.Namespace) -> int:
    from .reports.pages import run_report_cli

    return run_report_cli(args)


def recipe_of(config: Path) -> str | None:
    """The recipe a config file is named for: the one its name starts with ("opd_from_mild_sft" is OPD's), else the
    one it ends with ("stress_sft"); `None` when neither."""
    for matches in (config.stem.startswith, config.stem.endswith):
        found = [recipe for recipe in RECIPES if matches(recipe)]
        if found:
            return found[0]
    return None


def recipe_file(recipe: str) -> Path:
    """`recipes/<recipe>.py` of the checkout this package runs from, else of the current folder."""
    for folder in (Path(__file__).resolve().parents[1] / "recipes", Path.cwd() / "recipes"):
        if (folder / f"{recipe}.py").is_file():
            return folder / f"{recipe}.py"
    raise FileNotFoundError(
        f"recipes/{recipe}.py not found beside this package or in the current folder: the recipes ship with the "
        "repository, not the wheel; run `statelens preflight` from a checkout of the repository"
    )


def _preflight(args: argparse.Namespace) -> int:
    import logging
    import runpy

    config = Path(args.config)
    recipe = args.recipe or recipe_of(config)
    try:
        if not config.is_file():
            raise FileNotFoundError(f"no config file {config}")
        if recipe is None:
            raise ValueError(f"{config.name} names no recipe: say which builds the run, --recipe {'|'.join(RECIPES)}")
        namespace = runpy.run_path(str(recipe_file(recipe)))  # the recipe's functions, without running its main
        script_args, training_args, model_args = namespace["parse_arguments"](
            ["--config", str(config), *args.overrides]
        )
        if script_args.baseline == "stock":
            raise ValueError("the preflight checks StateLens trainers: leave --baseline at 'statelens'")
        ledger = Path(training_args.output_dir) / "statelens" / "steps.jsonl"
        if ledger.is_file() and ledger.stat().st_size:
            raise ValueError(
                f"{ledger.parent} holds a trained run's records, and its preflight.json is that run's: pass another "
                "--output_dir"
            )
        trainer = namespace["build_trainer"](script_args, training_args, model_args)[0]
    except (OSError, ValueError) as error:
        print(f"statelens preflight: error: {error}", file=sys.stderr)
        return 2
    from .preflight import PREFLIGHT_FILE, run_preflight
    from .preflight.verdicts import readable_block

    logger = logging.getLogger("trl_statelens.preflight")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its block is printed below, once
    try:
        result = run_preflight(trainer, mode="warn")  # whatever the config's `preflight`: it was asked for
    finally:
        logger.setLevel(level)
    print(readable_block(result))
    print(f"written: {Path(training_args.output_dir) / 'statelens' / PREFLIGHT_FILE}")
    return 1 if result["verdict"] == "fail" else 0


def _guards_replay(args: argparse.Namespace) -> int:
    from .guards_replay import run_replay_cli

    return run_replay_cli(args)


def _print_info(info: dict) -> None:
    scores = info["test_scores"]
    print(
        f"  base model (lab v{info.get('lab_version', 1)}): {info['size']} Qwen3, {info['parameters'] / 1e6:.2f}M parameters, "
        f"{info['pretrain_steps']} pretraining steps, built in {info['build_seconds']:.0f} s"
    )
    if "copied_from" in info:
        print(f"  copied from the repository's built lab, {info['copied_from']}")
    print(
        f"  test scores: math {scores['math']:.3f}  kb (MMLU analog) {scores['kb']:.3f}  "
        f"truth (TruthfulQA analog) {scores['truth']:.3f}  in band: {info['in_band']}"
    )
    if "math_band" in info:
        print(f"  bands: math {tuple(info['math_band'])}, kb and truth {tuple(info['retention_band'])}")
    if "teacher" in info:
        teacher = info["teacher"]["test_scores"]
        print(
            f"  teacher (base fine-tuned on lab math): math {teacher['math']:.3f}  kb {teacher['kb']:.3f}  "
            f"truth {teacher['truth']:.3f}"
        )


class _Subcommand(argparse.ArgumentParser):
    """A subcommand parser that can add its arguments when it is used (`add_arguments`), so a command whose
    arguments live in a heavy module (`eval`: torch) costs nothing to the other commands and to `statelens --help`."""

    def __init__(self, *args, add_arguments=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def parse_known_args(self, args=None, namespace=None):
        if self._add_arguments is not None:
            add_arguments, self._add_arguments = self._add_arguments, None
            add_arguments(self)
        return super().parse_known_args(args, namespace)


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    from .evaluation import add_eval_arguments

    add_eval_arguments(parser)


def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of `statelens report` (here, not in `reports/`, so `--help` does not import pandas)."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders written by the recipes")
    parser.add_argument(
        "--out", required=True, help="folder for report.md, report.html, states.html and the PNG plots"
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="RUN_DIR",
        help="run folder whose `after` scores form the Base row (e.g. an eval of the base model); "
        "default: the first run's `before` scores",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statelens", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)

    lab = commands.add_parser("lab", help="the offline lab world").add_subparsers(dest="lab_command", required=True)
    build = lab.add_parser(
        "build", help="build the lab data, tokenizer, pretrained base model and math teacher (cached)"
    )
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--size", default="lab", help="model size: 'lab' (default) or 'test'")
    build.add_argument(
        "--max-steps", type=int, default=None, help="pretraining step limit (cosine schedule length; default 500)"
    )
    build.add_argument("--teacher-steps", type=int, default=300, help="fine-tuning steps of the lab math teacher")
    build.add_argument("--force", action="store_true", help="rebuild even if a cached lab exists")
    build.set_defaults(func=_lab_build)
    info = lab.add_parser("info", help="print what is cached and the base model's measured scores")
    info.add_argument("--seed", type=int, default=0)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_lab_info)

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a model on gsm8k, truthfulqa and mmlu (or the lab's tasks)",
        add_arguments=_eval_arguments,
    )
    evaluate.set_defaults(func=_eval)

    report = commands.add_parser(
        "report", help="compare run folders: the study's Table 2, state statistics, plots and the states page"
    )
    add_report_arguments(report)
    report.set_defaults(func=_report)

    preflight = commands.add_parser(
        "preflight",
        help="build a recipe's trainer from its config and run the preflight checks, without training",
        usage="statelens preflight [-h] [--recipe RECIPE] CONFIG [--key value ...]",
        description="Build the trainer exactly as recipes/<recipe>.py would from CONFIG and the flags after it "
        "(`--key value`, as the recipe takes them: `--max_completion_length 2`), run the preflight's measured checks "
        "(docs/preflight.md) without training, print the verdict of each check and write "
        "<output_dir>/statelens/preflight.json. Exit status: 0 when every check passes or warns, 1 when a check "
        "fails, 2 when the run cannot be built (a bad config or flag).",
        allow_abbrev=False,  # a recipe flag must never be read as an abbreviation of --recipe
    )
    preflight.add_argument("config", metavar="CONFIG", help="a recipe's YAML config (recipes/configs/...)")
    preflight.add_argument(
        "--recipe",
        choices=RECIPES,
        default=None,
        help="the recipe that builds the run; default: the one the config's file name starts (else ends) with",
    )
    preflight.set_defaults(func=_preflight, takes_overrides=True)

    guards = commands.add_parser("guards", help="the run guards (docs/guards.md)")
    replay = guards.add_subparsers(dest="guards_command", required=True).add_parser(
        "replay", help="run the guards over recorded runs' ledgers: the step at which each would fire"
    )
    replay.add_argument("run_folders", nargs="+", metavar="RUN_FOLDER", help="a run's output_dir or ledger folder")
    replay.add_argument("--max_base_kl", type=float, default=None, help="forgetting budget on probe base_kl")
    replay.add_argument("--min_retention", type=float, default=None, help="forgetting budget on forecast Retention")
    replay.add_argument("--json", action="store_true", help="print the alarms as JSON")
    replay.set_defaults(func=_guards_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if overrides and not getattr(args, "takes_overrides", False):  # only `preflight` passes flags on (to the recipe)
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
