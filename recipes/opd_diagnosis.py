"""Why on-policy distillation moves its target slowly on the lab: each signal, and stock TRL, run long on the dev split
with the lens watching (STUDY.md, "Diagnosis").

    python recipes/opd_diagnosis.py --out runs/opd-diagnosis --jobs 2       # about 45 minutes on 2 cores
    statelens report runs/opd-diagnosis/* --out runs/opd-diagnosis/report   # written at the end anyway

Every arm distils the lab math teacher into the lab base (lab seed 0) with the demo's settings (8 prompts x 4
rollouts a step, lr 3e-4 or the pre-registered 1e-3, temperature 1), only longer, and is scored on the 100 dev problems every `--eval_every`
steps, greedy and on 4 temperature-1 samples per problem. Every `--eval_every` steps the probes (32 dev prompts)
also measure where the student still disagrees with its teacher: exact reverse KL on its own samples and on its
step-0 samples, on number tokens and the rest, by prefix position (`statelens/drift.jsonl`). A run whose
`results.json` exists is skipped.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trl_statelens.report import write_report

RECIPES = Path(__file__).resolve().parent
ARMS = {
    "reverse_kl": ["--signal", "reverse_kl"],
    "divergence": ["--signal", "divergence"],
    "continuation": ["--signal", "continuation"],
    "stock": ["--baseline", "stock"],  # TRL's DistillationTrainer: full-vocabulary JSD, beta 1 (= jsd_beta)
    # the pre-registered second learning rate (STUDY.md)
    "reverse_kl_lr1e-3": ["--signal", "reverse_kl", "--learning_rate", "1e-3"],
    "divergence_lr1e-3": ["--signal", "divergence", "--learning_rate", "1e-3"],
    "continuation_lr1e-3": ["--signal", "continuation", "--learning_rate", "1e-3"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/opd-diagnosis")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--jobs", type=int, default=1, help="arms run at once, one process (one torch thread) each")
    parser.add_argument(
        "extra", nargs="*", help="more recipe flags for every arm, after --, e.g. -- --learning_rate 1e-3"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--eval_split", "dev", "--max_steps", str(args.steps), "--target_eval_steps", str(args.eval_every),
        "--target_eval_limit", "100", "--eval_samples", "4", "--probe_steps", str(args.eval_every),
        "--num_probes", "32", "--seed", "0", "--lab_seed", "0", *args.extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else dict(os.environ)
    todo = [arm for arm in args.arms if not (out / arm / "results.json").exists()]
    started, running = time.perf_counter(), []
    for arm in todo:
        while len(running) >= args.jobs:
            running = [(a, p) for a, p in running if p.poll() is None or _check(a, p)]
            time.sleep(5)
        folder = out / arm
        shutil.rmtree(folder / "statelens", ignore_errors=True)  # an unfinished run (no checkpoints) starts over
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(RECIPES / "opd.py"), "--output_dir", str(folder), *ARMS[arm], *common]
        print(f"{arm}: {' '.join(command)}", flush=True)
        running.append((arm, subprocess.Popen(command, env=env, stdout=(folder / "log.txt").open("w"),
                                              stderr=subprocess.STDOUT)))  # fmt: skip
    for arm, process in running:
        process.wait()
        _check(arm, process)
    print(f"all arms done in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    report = write_report([out / arm for arm in args.arms], out / "report")
    print(f"report: {report}")


def _check(arm: str, process) -> bool:
    if process.returncode:
        sys.exit(f"{arm} failed ({process.returncode}); see its log.txt")
    return False


if __name__ == "__main__":
    main()
