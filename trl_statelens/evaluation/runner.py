"""Running tasks on a model: results with every setting, written per task as it finishes; Forgetting and
Retention."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..provenance import provenance
from .gsm8k import GSM8KTask
from .mmlu import MMLUTask
from .protocols import check_protocol
from .scoring import context_window, mean
from .truthfulqa import TruthfulQATask

TASK_NAMES = ("gsm8k", "truthfulqa", "mmlu")
RETENTION_TASKS = ("truthfulqa", "mmlu")
# Subset sizes of `--limit study`: the study's numbers fit them; it does not state its own.
STUDY_LIMITS = {"gsm8k": 500, "mmlu": 500, "truthfulqa": 200}


# ----- running tasks ----------------------------------------------------------------------------------------------
TASKS = {"gsm8k": GSM8KTask, "truthfulqa": TruthfulQATask, "mmlu": MMLUTask}


def task_source(name: str, data_dir: str | Path | None) -> str | None:
    """Where a task's rows come from: ``None`` (its hub id), ``"lab"``, or ``data_dir/<name>``."""
    if data_dir is None:
        return None
    if str(data_dir) == "lab":
        return "lab"
    folder = Path(data_dir).expanduser() / name
    if not folder.exists():
        raise ValueError(
            f"--data-dir {str(data_dir)!r} has no {name}/ folder: put the {name} files in {folder} "
            "or leave --data-dir out to load from the hub"
        )
    return str(folder)


def make_task(name: str, *, data_dir: str | Path | None = None, **kwargs):
    """A task by name (``gsm8k``, ``truthfulqa``, ``mmlu``) reading from ``data_dir`` (see :func:`task_source`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {sorted(TASKS)}")
    source = task_source(name, data_dir)
    if source is not None:
        kwargs["source"] = source
    return TASKS[name](**kwargs)


def build_tasks(
    tasks, *, data_dir=None, limit=None, seed=0, batch_size=16, protocol="statelens", task_kwargs=None
) -> list:
    """Task instances from names (built with these settings; ``task_kwargs[name]`` overrides them) or instances,
    with every task's data loaded: a missing file or split fails here, before any task runs."""
    check_protocol(protocol)
    task_kwargs = task_kwargs or {}
    unknown = [t for t in task_kwargs if t not in TASKS]
    if unknown:
        raise ValueError(f"task_kwargs names unknown tasks {unknown}: choose from {sorted(TASKS)}")
    common = {"seed": seed, "batch_size": batch_size, "protocol": protocol}
    built = [
        make_task(t, data_dir=data_dir, **{**common, "limit": _limit_for(limit, t), **task_kwargs.get(t, {})})
        if isinstance(t, str)
        else t
        for t in tasks
    ]
    for task in built:
        task.load()
    return built


def scalar_metrics(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "num_items"}


def run_tasks(model, tokenizer, tasks: list, progress: bool = True, on_task_done=None) -> dict[str, dict]:
    """Evaluate ``model`` on ``tasks`` without gradients and in eval mode, restoring its training mode after;
    ``on_task_done(outputs so far)`` is called after each task."""
    was_training = getattr(model, "training", False)
    model.eval()
    outputs = {}
    try:
        with torch.no_grad():
            for task in tasks:
                outputs[task.name] = task.evaluate(model, tokenizer, progress=progress)
                if on_task_done is not None:
                    on_task_done(outputs)
        return outputs
    finally:
        if was_training:
            model.train()


def load_model_and_tokenizer(path: str | Path, device: str | None = None):
    """A causal LM and its tokenizer from a local folder or hub id; fp32 on CPU, the checkpoint's dtype on GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _limit_for(limit, name: str) -> int | None:
    return limit.get(name) if isinstance(limit, dict) else limit


def evaluate_model(
    model_or_path,
    tasks=TASK_NAMES,
    *,
    tokenizer=None,
    data_dir: str | Path | None = None,
    limit: int | dict | None = None,
    seed: int = 0,
    batch_size: int = 16,
    protocol: str = "statelens",
    task_kwargs: dict | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    progress: bool = True,
    extra: dict | None = None,
) -> dict:
    """Evaluate one model on several tasks; optionally write ``out`` (results JSON) and ``<out>.items.jsonl``.

    Every task's data is loaded before the model is (a missing file fails at once), and ``out`` is rewritten after
    each task, so finished tasks' results survive a later failure.

    Args:
        model_or_path: a loaded causal LM (then pass ``tokenizer``) or a path / hub id for ``from_pretrained``.
        tasks: task names or task instances.
        data_dir: ``None`` (hub ids), ``"lab"``, or a folder with ``gsm8k/``, ``truthfulqa/`` and ``mmlu/``.
        limit: rows per task (an int for all, or ``{"gsm8k": 500, ...}``, e.g. :data:`STUDY_LIMITS`).
        seed: seed of the row subsets (and of the ``statelens`` protocol's fixed shots).
        protocol: ``"statelens"`` or ``"lm-eval"`` (see :mod:`trl_statelens.evaluation.protocols`).
        task_kwargs: extra arguments per task name, e.g. ``{"mmlu": {"num_shots": 5}}``.
        extra: more top-level entries for the results (written with them).

    Returns:
        ``{"model", "protocol", "scores": {task: primary metric}, "metrics": {task: {...}}, "settings": {task:
        {...}}, "records": {task: [...]}, "provenance", ...}``; ``settings`` holds every setting each task used,
        ``provenance`` the code, library versions and a hash of the evaluated model's weights as evaluated
        (:func:`trl_statelens.provenance.provenance`, role ``"model"``).
    """
    started = time.perf_counter()
    task_objects = build_tasks(
        tasks,
        data_dir=data_dir,
        limit=limit,
        seed=seed,
        batch_size=batch_size,
        protocol=protocol,
        task_kwargs=task_kwargs,
    )
    if isinstance(model_or_path, (str, Path)):
        model_name = str(model_or_path)
        model, loaded_tokenizer = load_model_and_tokenizer(model_or_path, device)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model, model_name = model_or_path, getattr(getattr(model_or_path, "config", None), "_name_or_path", "")
        if tokenizer is None:
            raise ValueError("evaluate_model got a model object without a tokenizer: pass tokenizer=...")
    by_name = {t.name: t for t in task_objects}
    record = provenance({"model": model})  # before any task: the weights as evaluated

    def summary(outputs: dict) -> dict:
        return {
            "model": model_name,
            "protocol": protocol,
            "tasks_done": list(outputs),
            "scores": {name: output["metrics"][by_name[name].primary_metric] for name, output in outputs.items()},
            "primary_metrics": {name: by_name[name].primary_metric for name in outputs},
            "metrics": {name: output["metrics"] for name, output in outputs.items()},
            "subjects": {name: output["subjects"] for name, output in outputs.items() if "subjects" in output},
            "settings": {t.name: t.settings() for t in task_objects},
            "seed": seed,
            "context_window": context_window(model, tokenizer),  # longer prompts keep their last tokens
            "elapsed_s": round(time.perf_counter() - started, 1),
            "provenance": record,
            **(extra or {}),
        }

    def write_partial(outputs: dict) -> None:
        if out is not None:
            write_results(summary(outputs), {name: output["records"] for name, output in outputs.items()}, out)

    outputs = run_tasks(model, tokenizer, task_objects, progress, on_task_done=write_partial)
    results = summary(outputs)
    results["records"] = {name: output["records"] for name, output in outputs.items()}
    if out is not None:
        results["items_file"] = Path(out).stem + ".items.jsonl"
    return results


def write_results(results: dict, records: dict[str, list[dict]], out: str | Path) -> Path:
    """``out``: the results JSON (without records); ``<out stem>.items.jsonl``: one line per evaluated item."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    items_path = write_items(records, out.with_name(out.stem + ".items.jsonl"))
    results["items_file"] = items_path.name
    out.write_text(json.dumps({k: v for k, v in results.items() if k != "records"}, indent=2))
    return items_path


def write_items(records: dict[str, list[dict]], path: Path) -> Path:
    """One line per evaluated item: ``{"task", "index", **record}`` (what :func:`item_scores` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for name, task_records in records.items():
            for index, record in enumerate(task_records):
                f.write(json.dumps({"task": name, "index": index, **record}) + "\n")
    return path


def _task_scores(results: dict) -> dict:
    """Accept a flat ``{task: score}`` mapping or a results dict of :func:`evaluate_model` (its ``scores``)."""
    return results["scores"] if isinstance(results.get("scores"), dict) else results


def paired_interval(differences, samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean paired difference, resampling items.

    ``differences`` is `(items,)` or `(seeds, items)` (each seed's run minus its reference on the same items); the
    items are resampled together across seeds, so the interval covers which items the test set happens to hold.
    """
    differences = np.atleast_2d(np.asarray(differences, dtype=float))
    resampled = np.random.default_rng(seed).integers(0, differences.shape[1], size=(samples, differences.shape[1]))
    means = differences.mean(0)[resampled].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def item_scores(items_file: str | Path, task: str, field: str) -> dict[str, float]:
    """``{question: score}`` of one task from an ``.items.jsonl`` file of :func:`evaluate_model`."""
    scores = {}
    with Path(items_file).open() as f:
        for line in f:
            item = json.loads(line)
            if item["task"] == task:
                scores[item["question"]] = float(item[field])
    return scores


def retention_summary(base: dict, post: dict, tasks=RETENTION_TASKS) -> dict[str, float]:
    """Forgetting ``mean(base - post)`` and Retention ``mean(post / base)`` over the ``tasks`` scored in both.

    ``base`` and ``post`` are ``{task: score}`` mappings or results of :func:`evaluate_model`.
    """
    base, post = _task_scores(base), _task_scores(post)
    present = [t for t in tasks if base.get(t) is not None and post.get(t) is not None]
    if not present:
        raise ValueError(
            f"no retention task among {list(tasks)} was scored for both models "
            f"(base has {sorted(base)}, post has {sorted(post)})"
        )
    zero = [t for t in present if base[t] == 0]
    if zero:
        raise ValueError(f"base score of {zero} is 0: retention (post / base) is undefined")
    return {
        "forgetting": mean([base[t] - post[t] for t in present]),
        "retention": mean([post[t] / base[t] for t in present]),
    }
