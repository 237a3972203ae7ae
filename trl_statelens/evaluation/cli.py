"""``statelens eval``: its arguments and what it runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data import PROMPT_FORMATS
from .mmlu import MMLU_SCORING
from .protocols import PROTOCOLS
from .runner import STUDY_LIMITS, TASK_NAMES, TASKS, evaluate_model, retention_summary, write_results


def parse_limit(text: str | None) -> int | dict | None:
    """``"200"`` -> 200; ``"gsm8k=500,mmlu=500"`` -> a dict; ``"study"`` -> :data:`STUDY_LIMITS`."""
    if text is None:
        return None
    if text == "study":
        return dict(STUDY_LIMITS)
    usage = "--limit takes N, 'study', or per-task counts such as 'gsm8k=500,mmlu=500,truthfulqa=200'"
    try:
        if "=" not in text:
            return int(text)
        limits = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            limits[name.strip()] = int(value)
    except ValueError as err:
        raise ValueError(f"{usage}, got {text!r}") from err
    unknown = [name for name in limits if name not in TASKS]
    if unknown:
        raise ValueError(f"--limit names unknown task(s) {unknown}: choose from {sorted(TASKS)}")
    return limits


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``statelens eval``."""
    parser.add_argument("--model", required=True, help="model folder or hub id (loaded with from_pretrained)")
    parser.add_argument("--tasks", default=",".join(TASK_NAMES), help="comma-separated: gsm8k,truthfulqa,mmlu")
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="statelens",
        help="'lm-eval' reproduces lm-evaluation-harness 0.4.x gsm8k, truthfulqa_mc1/mc2 and mmlu; 'statelens' "
        "(default) is the package's own (plain Question/Answer prompts, numeric answer matching)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder with gsm8k/, truthfulqa/ and mmlu/ data files, or 'lab' for the offline lab "
        "world; default: the hub data sets",
    )
    parser.add_argument(
        "--limit",
        default=None,
        help="items per task: N, or per task 'gsm8k=500,mmlu=500,truthfulqa=200', or 'study' (those); the "
        "first N under lm-eval (its --limit), N chosen by question under statelens",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the item subsets (and statelens shots)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--gsm8k-shots", type=int, default=None, help="default: 0 (statelens), 5 (lm-eval)")
    parser.add_argument("--mmlu-shots", type=int, default=None, help="default: 0 under both protocols")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="gsm8k generation budget")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="plain", help="gsm8k prompt format")
    parser.add_argument(
        "--mmlu-scoring", choices=MMLU_SCORING, default=None, help="default: letter (continuation for the lab)"
    )
    parser.add_argument("--lab-seed", type=int, default=0, help="seed of the lab world with --data-dir lab")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--base", default=None, help="results JSON of the base model: adds forgetting/retention")
    parser.add_argument(
        "--out", required=True, help="results JSON (rewritten as each task finishes); per-item records beside it"
    )
    return parser


def run_eval_cli(args: argparse.Namespace) -> dict:
    """``statelens eval``: evaluate, write the results JSON, print a summary."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown} in --tasks: choose from {sorted(TASKS)}")
    base = json.loads(Path(args.base).read_text()) if args.base is not None else None  # bad paths fail first
    lab = {"lab_seed": args.lab_seed}
    task_kwargs = {
        "gsm8k": {
            "num_shots": args.gsm8k_shots,
            "max_new_tokens": args.max_new_tokens,
            "prompt_format": args.prompt_format,
            **lab,
        },
        "truthfulqa": lab,
        "mmlu": {"num_shots": args.mmlu_shots, "scoring": args.mmlu_scoring, **lab},
    }
    results = evaluate_model(
        args.model,
        [t for t in TASK_NAMES if t in tasks],
        data_dir=args.data_dir,
        limit=parse_limit(args.limit),
        seed=args.seed,
        batch_size=args.batch_size,
        protocol=args.protocol,
        task_kwargs={t: task_kwargs[t] for t in tasks},
        out=args.out,
        device=args.device,
    )
    records = results.pop("records")
    if base is not None:
        results["retention_summary"] = retention_summary(base, results)
        write_results(results, records, args.out)
    for name, score in results["scores"].items():
        print(f"{name:<12} {results['primary_metrics'][name]:<16} {score:.4f}")
    for key, value in results.get("retention_summary", {}).items():
        print(f"{key:<29} {value:.4f}")
    print(f"wrote {args.out} and {results['items_file']} ({args.protocol} protocol)")
    return results
