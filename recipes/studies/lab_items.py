"""The lab study's evaluations item by item, committed, and every Table 2 number recomputed from them.

`pack` reads a study folder (`make study-lab`'s `runs/study-lab`: the base's and every seed's runs'
`eval/after.items.jsonl` and `results.json`) into one file: per run and seed, each test item's score by task (in one
question order, stored once by hash), the run's final scores and its last probe MMD. `check` recomputes from that file
alone Table 2's columns (mean, spread and per-seed values), every paired comparison with its bootstrap interval, and
the retention flips, as `study_lab.py` computes them, and fails, naming each, where a number in the committed summary
(`docs/study/summary.json`) or a comparison row of STUDY.md differs.

    python recipes/studies/lab_items.py pack runs/study-lab --out docs/study/items/table2.json
    python recipes/studies/lab_items.py check docs/study/items/table2.json        # make check-lab
"""

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import study_lab
from study_lab import COMPARISONS, CONTROL_COMPARISONS, SCORES, compare_runs, comparison_table, retention_flips

ROOT = Path(__file__).resolve().parents[2]


def question_key(position: int, question: str) -> str:
    """A question's key in the packed file: its place in the sorted questions, then its text's hash. Keys sort as the
    questions do, so the bootstrap draws the same items as over the texts (`compare_runs` sorts them)."""
    return f"{position:05d}-{hashlib.sha1(question.encode()).hexdigest()[:10]}"


def pack(out: Path, seeds: list[int], names: list[str]) -> dict:
    """The study folder `out`'s item scores and outcomes for `names` over `seeds` (the base's once)."""
    scores_of = study_lab.folder_item_scores(out)
    base = scores_of("base", None)
    questions = {task: sorted(base[task]) for task in SCORES}

    def entry(name: str, seed: int | None) -> dict:
        items = scores_of(name, seed)
        for task in SCORES:
            if sorted(items[task]) != questions[task]:
                raise ValueError(f"{name} (seed {seed}) was scored on other {task} items than the base")
        outcome = study_lab.run_outcome(out, name, seed)
        return {**outcome, "items": {task: [items[task][q] for q in questions[task]] for task in SCORES}}

    return {
        "source": str(out),
        "seeds": seeds,
        "questions": {task: [question_key(i, q) for i, q in enumerate(qs)] for task, qs in questions.items()},
        "base": entry("base", None),
        "runs": {name: {str(seed): entry(name, seed) for seed in seeds} for name in names},
    }


def recompute(packed: dict) -> dict:
    """Table 2's summary, comparisons and flips from a packed file, as `study_lab.py` writes them in `summary.json`."""
    seeds, names = packed["seeds"], list(packed["runs"])

    def entry(name: str, seed: int | None) -> dict:
        return packed["base"] if name == "base" else packed["runs"][name][str(seed)]

    def scores_of(name: str, seed: int | None) -> dict[str, dict[str, float]]:
        items = entry(name, seed)["items"]
        return {task: dict(zip(packed["questions"][task], items[task])) for task in SCORES}

    controls = CONTROL_COMPARISONS if all(run in packed["runs"] for _, run, _ in CONTROL_COMPARISONS) else []
    return {
        "runs": study_lab.summarize(entry, seeds, names),
        "comparisons": compare_runs(scores_of, seeds, COMPARISONS + controls),
        "flips": retention_flips(scores_of, seeds, names),
    }


def differences(recomputed: dict, committed: dict, study_text: str, seeds: list[int]) -> list[str]:
    """Each number of `recomputed` that the committed summary holds otherwise, and each comparison row of it that
    STUDY.md (`study_text`) does not hold as written."""
    found = []
    for name, columns in recomputed["runs"].items():
        for column, value in columns.items():
            theirs = committed["runs"].get(name, {}).get(column)
            if theirs is None or not _close(value["values"], theirs["values"]):
                found.append(
                    f"Table 2 {name} {column}: recomputed {value['values']}, committed {theirs and theirs['values']}"
                )
    committed_comparisons = {(c["run"], c["reference"], c["task"]): c for c in committed["comparisons"]}
    for c in recomputed["comparisons"]:
        theirs = committed_comparisons.get((c["run"], c["reference"], c["task"]))
        if theirs is None or not _close([*c["per_seed"], *c["ci95"]], [*theirs["per_seed"], *theirs["ci95"]]):
            found.append(f"comparison {c['run']} - {c['reference']} ({c['task']}): recomputed {c['mean']:+.3f} "
                         f"{c['ci95']}, committed {theirs and [theirs['mean'], theirs['ci95']]}")  # fmt: skip
    for row in comparison_table(recomputed["comparisons"], seeds).splitlines():
        if row.startswith("| ") and not row.startswith("| comparison") and row not in study_text:
            found.append(f"STUDY.md lacks the row: {row}")
    if recomputed["flips"] != committed["flips"]:
        found.append("the retention flips differ from the committed summary's")
    return found


def _close(ours: list, theirs: list) -> bool:
    return len(ours) == len(theirs) and all(math.isclose(a, b, rel_tol=0, abs_tol=1e-9) for a, b in zip(ours, theirs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="a study folder's item scores into one file")
    packing.add_argument("study", type=Path)
    packing.add_argument("--out", type=Path, required=True)
    packing.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    checking = commands.add_parser("check", help="recompute Table 2 from a packed file; fail where a number differs")
    checking.add_argument("packed", type=Path)
    checking.add_argument("--summary", type=Path, default=ROOT / "docs" / "study" / "summary.json")
    checking.add_argument("--study_md", type=Path, default=ROOT / "STUDY.md")
    args = parser.parse_args()
    if args.command == "pack":
        committed = json.loads((args.study / "summary.json").read_text())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        names = [name for name in committed["runs"] if name != "base"]
        args.out.write_text(json.dumps(pack(args.study, args.seeds, names), separators=(",", ":")))
        print(f"wrote {args.out}")
        return
    packed = json.loads(args.packed.read_text())
    recomputed = recompute(packed)
    found = differences(recomputed, json.loads(args.summary.read_text()), args.study_md.read_text(), packed["seeds"])
    rows = len(recomputed["comparisons"])
    if found:
        sys.exit(f"{len(found)} number(s) differ from {args.packed}:\n" + "\n".join(found))
    print(f"every Table 2 number recomputes from {args.packed}: {len(recomputed['runs'])} rows, {rows} comparisons")


if __name__ == "__main__":
    main()
