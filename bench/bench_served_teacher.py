"""In-process teacher vs a teacher behind a server (`teacher_model_server_url`), side by side in one run.

The student is bench_opd's shape; the teacher is about 7x its parameters (wider and deeper), as real OPD teachers are
several times their students. The served arm talks to `tests/vllm_test_server.py` (the CPU stand-in for `vllm serve`,
one torch thread) started once as its own process on this machine, so its compute competes for the same cores: the
step-time ratio here prices the HTTP round trips and JSON on top of the same teacher forward, not a GPU deployment,
where the teacher runs on its own device. Both arms train `reverse_kl` with the same seed, so they sample the same
rollouts: their logged `teacher_kl/sampled` must agree (a parity check on the lab-like run, printed with the table).

Training-process memory is the peak RSS of the training process (teacher weights included when in-process); the
server's own peak RSS is reported beside it.

    .venv/bin/python bench/bench_served_teacher.py [--repeats 3] [--steps 4]

`--overlap` times the served teacher with `teacher_server_overlap` on against off instead (the same run otherwise;
their `teacher_kl/sampled` must be equal), with the server's answers delayed by `--latency` seconds each (the test server's
`--latency`, a sleep that uses no core: a remote GPU server's round trip), and `--gradient-accumulation-steps` micro-
batches per generation.

`--multi` times several served teachers against one (issue 27): the same rows, half routed (`teacher_id`) to each of
two test servers of the same teacher, against all of them sent to one server (`teacher_model_server_url`). The same
teacher behind both, so their `teacher_kl/sampled` must be equal; the ratio prices the router (a request per teacher per step,
the answers put back in row order). Both servers share the 2 cores with the trainer here.

    .venv/bin/python bench/bench_served_teacher.py --multi [--repeats 3] [--steps 4]   # 3-4 minutes
    .venv/bin/python bench/bench_served_teacher.py --multi --smoke --out /tmp/r   # tiny models, 1 repeat (the test)
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    CPU_ARGS,
    RESULTS_DIR,
    count_parameters,
    print_table,
    ratio_row,
    run_forked,
    say,
    scratch_dir,
    timed,
    train_and_measure,
    write_results,
)
from datasets import Dataset

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain

STUDENT = dict(hidden=256, layers=4, ffn=1024)
TEACHER = dict(hidden=512, layers=8, ffn=2048)
SMOKE_MODEL = dict(hidden=64, layers=2, ffn=128)
ROLLOUTS_PER_STEP = 8
NUM_GENERATIONS = 2
COMPLETION_TOKENS = 32
WARMUP_STEPS = 1
ARMS = ("in_process", "served")
OVERLAP_ARMS = ("overlap", "no_overlap")
MULTI_ARMS = ("one_teacher", "two_teachers")
SERVER = Path(__file__).resolve().parents[1] / "tests" / "vllm_test_server.py"


def run_arm(arm, student_path, teacher_path, url, dataset, steps, gradient_accumulation_steps=1, url2=None):
    teacher, server_url = (teacher_path, None) if arm == "in_process" else (None, url)
    if arm == "two_teachers":  # the same rows, half routed to each server
        teacher, server_url = {"a": url, "b": url2}, None
        dataset = dataset.add_column("teacher_id", ["a", "b"] * (len(dataset) // 2))
    trainer = OnPolicyDistillTrainer(
        model=student_path,
        teacher_model=teacher,
        args=OnPolicyDistillConfig(
            output_dir=scratch_dir(f"bench-served-{arm}-"),
            max_steps=WARMUP_STEPS + steps,
            per_device_train_batch_size=ROLLOUTS_PER_STEP // gradient_accumulation_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            teacher_server_overlap=arm != "no_overlap",
            num_generations=NUM_GENERATIONS,
            max_completion_length=COMPLETION_TOKENS,
            temperature=1.0,
            generation_kwargs={"min_new_tokens": COMPLETION_TOKENS},
            teacher_model_server_url=server_url,
            **CPU_ARGS,
        ),
        train_dataset=dataset,
    )
    timings = {"request_seconds": [], "wait_seconds": []}
    server = getattr(trainer.teacher, "server", None)  # a served teacher's client
    if server is not None:  # the scoring request's own time, and how long the loss waited for it
        logps, resolve = server.logps, trainer._resolve_teacher_logps
        server.logps = timed(logps, timings["request_seconds"])
        trainer._resolve_teacher_logps = timed(resolve, timings["wait_seconds"])
    result = train_and_measure(trainer, {}, WARMUP_STEPS)
    result.update({key: values[WARMUP_STEPS:] for key, values in timings.items()})
    result["teacher_kl"] = [e["teacher_kl/sampled"] for e in trainer.state.log_history if "teacher_kl/sampled" in e]
    return result


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def main(
    repeats: int = 3,
    steps: int = 4,
    overlap: bool = False,
    latency: float = 0.0,
    gradient_accumulation_steps: int = 1,
    multi: bool = False,
    smoke: bool = False,
    out: str = str(RESULTS_DIR),
) -> dict:
    world = LabWorld(seed=0)
    tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    rows = world.math("train", n=256, seed=7)
    dataset = Dataset.from_dict({"prompt": [format_plain(r["question"]) for r in rows]})
    model_dir = scratch_dir("bench-served-models-")
    paths, setup = {}, {}
    shapes = (SMOKE_MODEL, SMOKE_MODEL) if smoke else (STUDENT, TEACHER)
    for (name, seed), shape in zip((("student", 0), ("teacher", 1)), shapes):
        model = build_qwen3(tokenizer, **shape, seed=seed)
        paths[name] = f"{model_dir}/{name}"
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        setup[f"{name}_params"] = count_parameters(model)

    servers = [
        subprocess.Popen(
            [sys.executable, str(SERVER), paths["teacher"], "--threads", "1", "--latency", str(latency)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2 if multi else 1)
    ]
    arms = MULTI_ARMS if multi else OVERLAP_ARMS if overlap else ARMS
    setup.update(latency_s=latency, gradient_accumulation_steps=gradient_accumulation_steps)
    try:
        url, *url2 = [server.stdout.readline().strip() for server in servers]
        say(f"teacher servers at {url} {url2}, latency {latency}s")
        runs = {arm: [] for arm in arms}
        for repeat in range(repeats):
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                start = time.perf_counter()
                args = (
                    arm,
                    paths["student"],
                    paths["teacher"],
                    url,
                    dataset,
                    steps,
                    gradient_accumulation_steps,
                    *url2,
                )
                runs[arm].append(run_forked(run_arm, *args))
                say(f"repeat {repeat} {arm}: {time.perf_counter() - start:.0f}s")
        setup["server_peak_rss_mb"] = peak_rss_mb(servers[0].pid)
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    if overlap:
        return overlap_report(setup, runs, out)
    if multi:
        return multi_report(setup, runs, out)

    median = {arm: [statistics.median(r["step_seconds"]) for r in runs[arm]] for arm in ARMS}
    rss = {arm: [r["peak_rss_mb"] for r in runs[arm]] for arm in ARMS}
    rows = [
        ratio_row("step time, served / in-process", [s / i for s, i in zip(median["served"], median["in_process"])]),
        ratio_row("training-process peak RSS, served / in-process", [s / i for s, i in zip(rss["served"], rss["in_process"])]),
        ratio_row("step seconds, in-process", median["in_process"]),
        ratio_row("step seconds, served", median["served"]),
        ratio_row("training-process peak RSS MB, in-process", rss["in_process"]),
        ratio_row("training-process peak RSS MB, served", rss["served"]),
    ]  # fmt: skip
    print_table(f"served teacher ({setup})", rows)
    kl_gap = max(
        abs(a - b)
        for i, s in zip(runs["in_process"], runs["served"])
        for a, b in zip(i["teacher_kl"], s["teacher_kl"])
    )
    print(f"largest |teacher_kl served - in-process| over all steps and repeats: {kl_gap:.2e}")
    results = {"setup": setup, "runs": runs, "rows": rows, "teacher_kl_max_abs_diff": kl_gap}
    say(f"results: {write_results('served_teacher', results, Path(out))}")
    return results


def overlap_report(setup: dict, runs: dict, out: str) -> dict:
    median = {arm: [statistics.median(r["step_seconds"]) for r in runs[arm]] for arm in OVERLAP_ARMS}
    rows = [
        ratio_row("step time, overlap / no overlap", [o / n for o, n in zip(median["overlap"], median["no_overlap"])]),
        ratio_row("step seconds, overlap", median["overlap"]),
        ratio_row("step seconds, no overlap", median["no_overlap"]),
    ]
    for arm in OVERLAP_ARMS:  # per step: the request's wall time, the time the loss then still waited for it
        rows.append(
            ratio_row(f"scoring request s, {arm}", [statistics.median(r["request_seconds"]) for r in runs[arm]])
        )
        rows.append(ratio_row(f"loss waited s, {arm}", [statistics.median(r["wait_seconds"]) for r in runs[arm]]))
    print_table(f"served teacher, teacher_server_overlap on / off ({setup})", rows)
    kl_gap = max(
        abs(a - b)
        for o, n in zip(runs["overlap"], runs["no_overlap"])
        for a, b in zip(o["teacher_kl"], n["teacher_kl"])
    )
    print(f"largest |teacher_kl overlap - no overlap| over all steps and repeats: {kl_gap:.2e}")
    results = {"setup": setup, "runs": runs, "rows": rows, "teacher_kl_max_abs_diff": kl_gap}
    name = f"served_teacher_overlap_latency{setup['latency_s']:g}_ga{setup['gradient_accumulation_steps']}"
    say(f"results: {write_results(name, results, Path(out))}")
    return results


def multi_report(setup: dict, runs: dict, out: str) -> dict:
    median = {arm: [statistics.median(r["step_seconds"]) for r in runs[arm]] for arm in MULTI_ARMS}
    rows = [
        ratio_row("step time, two served teachers / one", [t / o for t, o in zip(median["two_teachers"], median["one_teacher"])]),
        ratio_row("step seconds, one served teacher", median["one_teacher"]),
        ratio_row("step seconds, two served teachers", median["two_teachers"]),
    ]  # fmt: skip
    print_table(f"two served teachers (rows split by teacher_id) / one ({setup})", rows)
    kl_gap = max(
        abs(a - b)
        for o, t in zip(runs["one_teacher"], runs["two_teachers"])
        for a, b in zip(o["teacher_kl"], t["teacher_kl"])
    )
    print(f"largest |teacher_kl two - one| over all steps and repeats (the same teacher behind both): {kl_gap:.2e}")
    results = {"setup": setup, "runs": runs, "rows": rows, "teacher_kl_max_abs_diff": kl_gap}
    say(f"results: {write_results('served_multi_teacher', results, Path(out))}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--overlap", action="store_true", help="teacher_server_overlap on vs off, both served")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the test server adds to each answer")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--multi", action="store_true", help="two served teachers (rows routed) vs one")
    parser.add_argument("--smoke", action="store_true", help="tiny models (the test); with --repeats 1 --steps 1")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder of the results file")
    main(**vars(parser.parse_args()))
