"""The real-model study's SFT arm at the K1 OPD run's FLOPs as they ran, scored against the committed arms.

The K1 comparison (`docs/study/real/ends-test/`) stopped LoRA SFT at the OPD run's counted FLOPs, 1.712e14 (117
steps); counted as it ran, OPD spent 9.1622e13 (`honest_flops.py`, `docs/study/real/honest-flops.md`), which SFT
reaches at step 64. `run` trains that arm with the committed SFT settings and `--max_flops 9.1622e13`; `compare`
scores it against the committed OPD, SFT-at-117 and base answers (paired over the same 250 GSM8K test problems and
200 TruthfulQA questions) and writes `docs/study/real/honest-sft/`.

    python recipes/studies/real_opd_study.py data --data ../shared/data --out runs/real-study   # the test folder
    python recipes/studies/honest_sft.py run       # about 25 minutes on 2 CPU cores
    python recipes/studies/honest_sft.py compare
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_opd_study import arm_scores, paired  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "study" / "real" / "ends-test"
HONEST_BUDGET = 9.1622e13  # docs/study/real/honest-flops.md: the K1 OPD run's FLOPs as they ran
METRICS = ("clean", "strict", "format", "repeats", "mc1", "mc2")


def run(out: Path) -> None:
    command = [sys.executable, str(ROOT / "recipes" / "sft.py"), "--config", str(RECORDS / "sft.yaml"),
               "--max_flops", str(HONEST_BUDGET), "--output_dir", str(out)]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT)


def compare(sft: Path, records: Path) -> str:
    arms = {
        "base": arm_scores(RECORDS / "opd" / "eval" / "before.items.jsonl", None),
        "opd": arm_scores(RECORDS / "opd" / "eval" / "after.items.jsonl", None),
        "sft@117": arm_scores(RECORDS / "sft" / "eval" / "after.items.jsonl", None),
        "sft@honest": arm_scores(sft / "eval" / "after.items.jsonl", None),
    }
    result = json.loads((sft / "results.json").read_text())
    lines = [
        f"LoRA SFT stopped at {result['global_steps']} steps, {result['compute']['flops']:.4g} FLOPs (budget "
        f"{HONEST_BUDGET:.4g}: the K1 OPD run as it ran); the committed arm ran 117 steps, 1.712e14.",
        "",
        "| arm | " + " | ".join(METRICS) + " |",
        "|---|" + "---:|" * len(METRICS),
    ]
    for name, scores in arms.items():
        means = [sum(scores[m].values()) / len(scores[m]) for m in METRICS]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in means) + " |")
    lines += ["", "| paired difference | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
    for a, b in (("opd", "sft@honest"), ("sft@honest", "base"), ("sft@117", "sft@honest")):
        cells = []
        for m in METRICS:
            d = paired(arms[a][m], arms[b][m])
            cells.append(f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]")
        lines.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    records.mkdir(parents=True, exist_ok=True)
    (records / "result.md").write_text(text)
    for name in ("results.json", "log_history.json"):
        if (sft / name).exists():
            shutil.copy(sft / name, records / name)
    (records / "eval").mkdir(exist_ok=True)
    for path in (sft / "eval").glob("after*"):
        shutil.copy(path, records / "eval" / path.name)
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("run", "compare"))
    parser.add_argument("--sft", type=Path, default=ROOT / "runs" / "real-honest" / "sft", help="the SFT run folder")
    parser.add_argument("--records", type=Path, default=ROOT / "docs" / "study" / "real" / "honest-sft")
    args = parser.parse_args(argv)
    if args.phase == "run":
        run(args.sft)
    else:
        print(compare(args.sft, args.records))


if __name__ == "__main__":
    main()
