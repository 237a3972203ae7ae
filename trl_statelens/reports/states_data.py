"""What `states.html` shows, gathered from run folders (:func:`page_data`): sequences sampled evenly from each run's
`statelens/states.jsonl` within a budget of sequences and tokens, their per-token values rounded for the page, and each
run's per-step metrics, prefix-length histograms and probe drift. :mod:`.states_page` renders it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..answers import repeats_itself
from .endings import sample_ended

STATE_SOURCES = ("dataset", "learner", "teacher")  # as in lens/records.py, which imports torch: not imported here
MAX_SEQUENCES = 2000
MAX_TOKENS = 300_000
MAX_PROMPT_CHARS = 2000  # longer prompts keep their end, where the state begins
STEP_METRICS = (
    ("state_nll", "state_nll (nats)"),
    ("offpolicy_gap", "offpolicy_gap (nats)"),
    ("teacher_kl/supervised", "teacher_kl/supervised (nats)"),
    ("source_frac/learner", "share of learner states"),
)
DRIFT_METRICS = (("mmd", "probe drift MMD²"), ("sliced_wasserstein", "probe drift sliced Wasserstein"))


def rounded(values, decimals: int = 3) -> list | None:
    """Floats rounded for the page; NaN and inf become null. None stays None."""
    if values is None:
        return None
    array = np.round(np.asarray(values, dtype=float), decimals)
    return [float(v) if math.isfinite(v) else None for v in array]


def compact_prefix_len(prefix_len: list[int]) -> int | list[int]:
    """The first prefix length when they count up by one (the usual case), else the whole list."""
    start = prefix_len[0] if prefix_len else 0
    return start if prefix_len == list(range(start, start + len(prefix_len))) else prefix_len


def sequence_entry(line: dict, run_index: int) -> dict | None:
    """One ledger line as the page needs it, with the per-sequence numbers it sorts by; None if unusable."""
    logp = line.get("logp")
    if not isinstance(logp, list) or not logp:
        return None
    logp_array = np.asarray([np.nan if v is None else v for v in logp], dtype=float)
    entropy = line.get("entropy") or [None] * len(logp)
    entropy_array = np.asarray([np.nan if v is None else v for v in entropy], dtype=float)
    teacher = line.get("teacher_logp")
    weight = line.get("weight") or [1.0] * len(logp)
    source = line.get("source")
    tokens = line.get("tokens")
    if not (isinstance(tokens, list) and len(tokens) == len(logp)):
        tokens = None  # a ledger from before per-token text: the page shows the completion text and value cells
    gap = -logp_array - entropy_array
    teacher_kl = None
    if teacher is not None and source == "learner":  # the sampled reverse KL is an estimate on the learner's tokens
        diff = logp_array - np.asarray([np.nan if v is None else v for v in teacher], dtype=float)
        teacher_kl = float(np.nanmean(diff)) if np.isfinite(diff).any() else None
    prompt = _prompt_text(line.get("prompt"))
    teacher_prompt = line.get("teacher_prompt")
    context_len = line.get("teacher_context_len")
    reward = line.get("reward")
    teacher_name = line.get("teacher")  # runs with several teachers only
    # State selection (`skip_correct_rollouts`): why the teacher did not score the sequence, or that it rechecked it
    selection = line.get("skipped") or ("recheck" if line.get("recheck") else None)
    # Offline teacher cache (`teacher_cache_steps`): trained from a reused batch, and that batch's age in steps
    cache_age = line.get("cache_age") if line.get("from_cache") else None
    # How it ended and whether it loops (`lens.endings`); a ledger line from before those fields: read off its text
    completion = "".join(tokens) if tokens is not None else str(line.get("completion") or "")
    ended = line.get("end") or ("end_token" if sample_ended(line) else None)
    repeats = line.get("repeats") if isinstance(line.get("repeats"), bool) else repeats_itself(completion)
    return {
        "r": run_index,
        "te": teacher_name if isinstance(teacher_name, str) else None,
        "sk": selection if isinstance(selection, str) else None,
        "ca": cache_age if isinstance(cache_age, int) else None,
        "ed": ended if isinstance(ended, str) else None,
        "rp": repeats,
        "s": int(line.get("step", 0)),
        "src": STATE_SOURCES.index(source) if source in STATE_SOURCES else -1,
        "rw": float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else None,
        "p": prompt,
        "tp": None if teacher_prompt is None else _prompt_text(teacher_prompt),
        "tc": context_len if isinstance(context_len, int) else None,
        "t": tokens,
        "c": None if tokens is not None else str(line.get("completion") or ""),
        "pl": compact_prefix_len(list(line.get("prefix_len") or range(len(logp)))),
        "lp": rounded(logp_array),
        "en": rounded(entropy_array, 2),
        "tl": rounded(teacher),
        # a teacher of another tokenizer: the supervised tokens whose teacher log-prob is a chunk's share, not exact
        "ne": [i for i, exact in enumerate(line.get("teacher_exact") or []) if not exact] or None,
        "w": rounded(weight[:1], 3)[0] if len(set(weight)) == 1 else rounded(weight),
        "gap": float(np.nanmean(gap)) if np.isfinite(gap).any() else None,
        "kl": teacher_kl,
    }


def _prompt_text(prompt) -> str:
    """A prompt for the page: longer ones keep their end, where the state begins."""
    prompt = str(prompt or "")
    return "…" + prompt[-MAX_PROMPT_CHARS:] if len(prompt) > MAX_PROMPT_CHARS else prompt


def evenly_spaced(count: int, budget: int) -> set[int]:
    """`budget` indices spread evenly over `range(count)` (all of them when they fit)."""
    if count <= budget:
        return set(range(count))
    return set(np.linspace(0, count - 1, budget).round().astype(int).tolist())


def read_ledger_sample(path: Path, budget: int, run_index: int) -> tuple[list[dict], int, int]:
    """At most `budget` sequences spread evenly over the ledger, parsing only those lines.

    Returns (entries, lines in the ledger, lines that were not valid JSON or had no per-token values)."""
    with path.open(encoding="utf-8") as file:
        count = sum(1 for line in file if line.strip())
    chosen = evenly_spaced(count, budget)
    entries, bad, index = [], 0, 0
    with path.open(encoding="utf-8") as file:
        for line in file:
            if not line.strip():
                continue
            if index in chosen:
                try:
                    entry = sequence_entry(json.loads(line), run_index)
                except (json.JSONDecodeError, TypeError, ValueError):
                    entry = None
                if entry is None:
                    bad += 1
                else:
                    entries.append(entry)
            index += 1
    return entries, count, bad


def frame_columns(frame, names) -> dict:
    """The named columns of a per-step frame that exist, as rounded lists, plus `step`."""
    if frame is None or "step" not in frame:
        return {}
    columns = {"step": [int(s) for s in frame["step"]]}
    for name in names:
        if name in frame:
            values = rounded(np.asarray(frame[name].astype(float)), 5)
            if any(v is not None for v in values):
                columns[name] = values
    return columns


def page_data(runs, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_TOKENS) -> dict:
    """What the page embeds: per run its label, step metrics, prefix histograms and drift; the sampled sequences."""
    budget = max(1, max_sequences // max(1, len(runs)))
    run_entries, sequences = [], []
    for index, run in enumerate(runs):
        ledger = Path(run.path) / "statelens" / "states.jsonl"
        notes, entries, count = [], [], 0
        if ledger.is_file():
            entries, count, bad = read_ledger_sample(ledger, budget, index)
            if bad:
                notes.append(f"{bad} ledger line(s) left out: not valid JSON or no per-token values")
        else:
            notes.append("no statelens/states.jsonl: no sequences")
        steps = frame_columns(run.steps, [name for name, _ in STEP_METRICS])
        hists = []
        if run.steps is not None and "prefix_len_hist" in run.steps:
            hists = [h if isinstance(h, list) else [] for h in run.steps["prefix_len_hist"]]
        run_entries.append(
            {
                "label": run.label,
                "ledger_sequences": count,
                "steps": steps,
                "hist": hists if any(hists) else None,
                "drift": frame_columns(run.drift, [name for name, _ in DRIFT_METRICS]),
                "notes": notes,
            }
        )
        sequences += entries
    total_tokens = sum(len(entry["lp"]) for entry in sequences)
    if total_tokens > max_tokens:  # long sequences: keep fewer of them, still spread evenly
        keep = evenly_spaced(len(sequences), max(1, len(sequences) * max_tokens // total_tokens))
        sequences = [entry for i, entry in enumerate(sequences) if i in keep]
    return {
        "runs": run_entries,
        "sequences": sequences,
        "sources": list(STATE_SOURCES),
        "teachers": sorted({entry["te"] for entry in sequences if entry["te"] is not None}),
        "step_metrics": [list(pair) for pair in STEP_METRICS],
        "drift_metrics": [list(pair) for pair in DRIFT_METRICS],
    }
