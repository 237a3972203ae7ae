"""`make bench`: every benchmark, one table each, results in bench/results/*.json (about 6.5 minutes on 2 quiet cores
for state_logging and opd, then about 14.5 for the scaling sweep).

.venv/bin/python bench/run.py [--repeats 3] [--steps 3] [--only state_logging|opd|scaling] [--quick] [--size lab|real]

`--size real`: the state-logging and OPD benchmarks on the real SmolLM2-135M-Instruct (results in `*_real.json`).
"""

import argparse
import platform
import time

import bench_opd
import bench_scaling
import bench_state_logging
import torch
from common import TORCH_THREADS, say, write_results

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run, after one warm-up step")
    parser.add_argument("--only", choices=("state_logging", "opd", "scaling"))
    parser.add_argument("--quick", action="store_true", help="the scaling sweep's CI-sized mode")
    parser.add_argument("--size", choices=("lab", "real"), default="lab")
    options = parser.parse_args()

    start = time.perf_counter()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    if options.only in (None, "state_logging"):
        bench_state_logging.main(options.repeats, options.steps, options.size)
    if options.only in (None, "opd"):
        bench_opd.main(options.repeats, options.steps, options.size)
    if options.only in (None, "scaling") and options.size == "lab":
        bench_scaling.main(quick=options.quick)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    machine = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu_cores": len(__import__("os").sched_getaffinity(0)),
        "torch_threads": TORCH_THREADS,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_seconds": round(time.perf_counter() - start),
    }
    write_results("machine_real" if options.size == "real" else "machine", machine)
    say(f"done in {machine['wall_seconds']} s; machine: {machine}")
