"""Replay the run guards over a recorded run: at which step each guard would have fired.

The ledger's `steps.jsonl` and `drift.jsonl` hold the lens's metrics of every step without the `statelens/` prefix the
logs give them; `log_history.json` (TRL's logs, beside the ledger or in the run folder above it) adds the loss, the
gradient norm and TRL's reward metrics. Each step's metrics are fed to [`~trl_statelens.guards.Guards`] in step
order, as `RunGuards` would have received them with `logging_steps=1`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .guards import Guards

NOT_METRICS = ("step", "epoch", "prefix_len_hist", "teacher_kl/exact_by_prefix")


def find_ledger(run_folder) -> Path:
    """The `steps.jsonl` of a run folder (`<run>/statelens/steps.jsonl`, or a ledger folder's own)."""
    folder = Path(run_folder)
    if folder.is_file():
        return folder
    for path in (folder / "statelens" / "steps.jsonl", folder / "steps.jsonl"):
        if path.exists():
            return path
    raise FileNotFoundError(
        f"{folder} holds no state ledger (statelens/steps.jsonl or steps.jsonl): pass a run's output_dir or the "
        "folder of its steps.jsonl"
    )


def step_metrics(steps_jsonl) -> dict[int, dict[str, float]]:
    """Every recorded step's metrics under their log names, from the ledger and TRL's `log_history.json`."""
    steps_jsonl = Path(steps_jsonl)
    by_step: dict[int, dict[str, float]] = {}
    for prefix, path in (("statelens/", steps_jsonl), ("statelens/drift/", steps_jsonl.with_name("drift.jsonl"))):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            metrics = by_step.setdefault(int(row["step"]), {})
            for name, value in row.items():
                if name not in NOT_METRICS and isinstance(value, (int, float)):
                    metrics[prefix + name] = float(value)
                elif name not in NOT_METRICS and value is None and prefix == "statelens/":
                    metrics[prefix + name] = float("nan")  # the ledger writes a non-finite value as null
    for folder in (steps_jsonl.parent, steps_jsonl.parent.parent):
        history = folder / "log_history.json"
        if history.exists():
            for row in json.loads(history.read_text()):
                if "step" in row and "train_runtime" not in row:  # not the run's closing summary
                    metrics = by_step.setdefault(int(row["step"]), {})
                    for name, value in row.items():
                        if isinstance(value, (int, float)) and name not in NOT_METRICS:
                            metrics.setdefault(name, float(value))
            break
    return by_step


def replay_guards(ledger_steps_jsonl, **thresholds) -> list[dict]:
    """The alarms the guards would have raised over a recorded run, in step order (each as [`Guards.observe`] gives
    it: `step`, `guard`, `metric`, `value`, `reference`, `threshold`, `message`).

    Args:
        ledger_steps_jsonl: a run's `statelens/steps.jsonl` (or its run folder).
        **thresholds: the arguments of [`~trl_statelens.guards.Guards`].
    """
    guards = Guards(**thresholds)
    alarms = []
    for step, metrics in sorted(step_metrics(find_ledger(ledger_steps_jsonl)).items()):
        alarms.extend(guards.observe(step, metrics))
    return alarms


def run_replay_cli(args) -> int:
    """`statelens guards replay RUN_FOLDER ...`: print where each guard fires in each run (JSON with `--json`)."""
    thresholds = {
        name: getattr(args, name) for name in ("max_base_kl", "min_retention") if getattr(args, name) is not None
    }
    results = {str(folder): replay_guards(folder, **thresholds) for folder in args.run_folders}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for folder, alarms in results.items():
        print(f"{folder}: " + ("no guard fires" if not alarms else f"{len(alarms)} guard(s) fire"))
        for alarm in alarms:
            print(f"  step {alarm['step']:>5}  {alarm['guard']:<13} {alarm['message']}")
    return 0
