"""One command for a lent GPU machine: every trainer against stock TRL on the same batch, a teacher of another
tokenizer, FSDP2 and ZeRO-3, and where an OPD step's extra time goes; written as markdown tables (BENCHMARKS.md
section 7's form) and JSON.

The models are `bench/gpu_smoke.py`'s (random-init, built here from configs with the lab tokenizer, nothing to
download: a student shaped like Qwen3-0.6B and a teacher like Qwen3-1.7B, bf16), plus a teacher of the teacher's
shape whose tokenizer is a second lab tokenizer (`tests/conftest.py`'s `other_teacher_path`). Sections, in order,
each skipped (and said so in the tables) once the time budget is spent:

- launched: SFT, GRPO and OPD one step each under `accelerate launch --num_processes 1` with
  `recipes/accelerate/fsdp2.yaml` and with `zero3.yaml` (ZeRO-3 only where `deepspeed` imports): the distributed
  type that ran, the step, its loss, and the teacher's device;
- A/B: `StateLensSFTTrainer` vs `SFTTrainer`, `StateLensGRPOTrainer` vs `GRPOTrainer`, and `OnPolicyDistillTrainer`
  with `reverse_kl`, `continuation`, `divergence` and `reverse_kl` with the other tokenizer's teacher vs
  `DistillationTrainer(beta=1)`, all on the same prompts of one length with rollouts of one length (equal work per
  step): median step time over `--steps` steps after `--warmup` warm-up steps, its ratio to stock's, and peak memory
  (`torch.cuda.max_memory_allocated`; peak RSS on a CPU);
- profile: one more step of `reverse_kl`, `continuation` and stock under `torch.profiler`, after the timed ones (not
  counted in them): the ops with the most extra self time against stock's, by CPU and (on a GPU) by CUDA time, and
  the trainers' regions (`_generate`, `_generate_and_score_completions`, `compute_loss`) by total time.

    python bench/gpu_check.py [OUT_DIR] [--steps 4] [--warmup 1] [--budget 420]    # one CUDA GPU
    python bench/gpu_check.py OUT_DIR --quick       # CPU, tiny float32 models, 1 step each, no launches (seconds)

OUT_DIR defaults to $OUT when set, else bench/results/gpu_check/. It writes `gpu_check.md` (the tables) and
`gpu_check.json` (everything, the profiles' full top lists included). `bench/gpu_check.sh` runs it on the device
machine from carried wheels (see there).
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import say
from datasets import Dataset
from gpu_smoke import (
    SIZES,
    build_models,
    common_args,
    fixed_length_prompt_dataset,
    id_reward,
    launch_workers,
    measure,
    release,
)
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import TrainerCallback
from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLensGRPOTrainer, StateLensSFTTrainer
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"
LAUNCHES = {"FSDP2": "fsdp2.yaml", "ZeRO-3": "zero3.yaml"}
# (trainer, arm): the stock arm of each trainer first
ARMS = (
    ("SFT", "stock"),
    ("SFT", "statelens"),
    ("GRPO", "stock"),
    ("GRPO", "statelens"),
    ("OPD", "stock"),
    ("OPD", "reverse_kl"),
    ("OPD", "continuation"),
    ("OPD", "divergence"),
    ("OPD", "reverse_kl_other_tokenizer"),
)
PROFILED = ("stock", "reverse_kl", "continuation")  # OPD arms
REGIONS = ("_generate", "_generate_and_score_completions", "compute_loss")
TOP_OPS = 8


class ProfileLastStep(TrainerCallback):
    """`torch.profiler` over the run's last step only, with the trainer's regions marked (`REGIONS`)."""

    def __init__(self, trainer, last_step: int):
        self.last_step, self.profiler = last_step, None
        for name in REGIONS:
            method = getattr(trainer, name, None)
            if method is not None:
                setattr(trainer, name, in_region(name, method))

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.last_step:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and state.global_step == self.last_step:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)


def in_region(name, method):
    def marked(*args, **kwargs):
        with record_function(f"region:{name}"):
            return method(*args, **kwargs)

    return marked


def profile_summary(profiler) -> dict:
    """Per clock (CPU, and CUDA on a GPU), in milliseconds: each op's self time and each marked region's total time."""
    events = profiler.key_averages()
    clocks = {"CPU": ("self_cpu_time_total", "cpu_time_total")}
    if torch.cuda.is_available():
        clocks["CUDA"] = ("self_device_time_total", "device_time_total")
    summary = {}
    for clock, (self_time, total_time) in clocks.items():
        ops = {e.key: getattr(e, self_time) / 1e3 for e in events if not e.key.startswith("region:")}
        summary[clock] = {
            "ops_ms": dict(sorted(((k, v) for k, v in ops.items() if v > 0), key=lambda kv: -kv[1])[:40]),
            "regions_ms": {e.key.removeprefix("region:"): getattr(e, total_time) / 1e3 for e in events
                           if e.key.startswith("region:")},
        }  # fmt: skip
    return summary


def make_trainer(trainer_name, arm, paths, tokenizer, data, common, size, max_steps):
    output_dir = tempfile.mkdtemp(prefix=f"gpu-check-{trainer_name}-{arm}-")
    if trainer_name == "SFT":
        args = SFTConfig(output_dir, max_steps=max_steps, per_device_train_batch_size=size["rollouts"],
                         max_length=size["sft_max_length"], **common)  # fmt: skip
        cls = SFTTrainer if arm == "stock" else StateLensSFTTrainer
        return cls(model=paths["student"], args=args, train_dataset=data["sft"], processing_class=tokenizer)
    rollouts = dict(
        max_steps=max_steps,
        per_device_train_batch_size=size["rollouts"],
        max_completion_length=size["completion_tokens"],
        generation_kwargs={"min_new_tokens": size["completion_tokens"]},  # equal work: every rollout full length
        **common,
    )
    if trainer_name == "GRPO":
        args = GRPOConfig(output_dir, num_generations=size["num_generations"], **rollouts)
        cls = GRPOTrainer if arm == "stock" else StateLensGRPOTrainer
        return cls(model=paths["student"], reward_funcs=id_reward, args=args, train_dataset=data["prompts"],
                   processing_class=tokenizer)  # fmt: skip
    teacher_kwargs = {"teacher_model_init_kwargs": {"dtype": common["model_init_kwargs"]["dtype"]}, "temperature": 1.0}
    if arm == "stock":
        args = DistillationConfig(output_dir, beta=1.0, **teacher_kwargs, **rollouts)
        return DistillationTrainer(model=paths["student"], teacher_model=paths["teacher"], args=args,
                                   train_dataset=data["prompts"], processing_class=tokenizer)  # fmt: skip
    signal = arm.removesuffix("_other_tokenizer")
    args = OnPolicyDistillConfig(
        output_dir,
        signal=signal,
        num_generations=size["num_generations"],
        **({"continuation_length": size["continuation_tokens"]} if signal == "continuation" else {}),
        **teacher_kwargs,
        **rollouts,
    )
    teacher = paths["other_teacher" if arm.endswith("_other_tokenizer") else "teacher"]
    return OnPolicyDistillTrainer(model=paths["student"], teacher_model=teacher, args=args,
                                  train_dataset=data["prompts"], processing_class=tokenizer)  # fmt: skip


def run_arm(trainer_name, arm, paths, tokenizer, data, common, size, warmup, steps) -> dict:
    profiled = trainer_name == "OPD" and arm in PROFILED
    max_steps = warmup + steps + profiled
    trainer = make_trainer(trainer_name, arm, paths, tokenizer, data, common, size, max_steps)
    profiler = ProfileLastStep(trainer, max_steps) if profiled else None
    if profiler is not None:
        trainer.add_callback(profiler)
    run = measure(trainer, {}, warmup_steps=warmup)
    release(trainer)
    step_seconds = run["step_seconds"][:steps]  # the profiled step is not timed
    result = {
        "median_step_seconds": statistics.median(step_seconds),
        "step_seconds": step_seconds,
        "peak_memory_mb": run["peak_memory_mb"],
        "losses": [log["loss"] for log in run["logs"]],
    }
    if profiler is not None:
        result["profile"] = profile_summary(profiler.profiler)
    return result


def run_launch(name, mode, model_dir) -> dict:
    """One `accelerate launch --num_processes 1` of gpu_smoke's worker (SFT, GRPO, OPD one step each)."""
    if name == "ZeRO-3":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"skipped": "deepspeed is not installed"}
    launched = launch_workers(mode, model_dir, ACCELERATE_CONFIGS / LAUNCHES[name], processes=1)
    return launched


def over_budget(started, budget) -> bool:
    return time.perf_counter() - started > budget


def build_other_teacher(mode, world, model_dir) -> str:
    """The teacher's shape with a second lab tokenizer (other merges, digit runs kept whole)."""
    size = SIZES[mode]
    other = build_tokenizer(world, vocab_size=700, num_documents=500, individual_digits=False)
    with torch.device("cuda" if mode == "gpu" else "cpu"):
        model = build_qwen3(other, **size["teacher"], vocab_size=size["vocab_size"] or 1024, seed=1)
    path = f"{model_dir}/other_teacher"
    model.to(torch.bfloat16 if mode == "gpu" else torch.float32).save_pretrained(path)
    other.save_pretrained(path)
    return path


def fmt(value, digits=2) -> str:
    return "skipped" if value is None else f"{value:,.{digits}f}"


def markdown(results: dict) -> str:
    """The tables, in BENCHMARKS.md section 7's form."""
    setup = results["setup"]
    memory = "peak GPU memory (MB)" if setup["mode"] == "gpu" else "peak RSS (MB)"
    lines = [
        f"# gpu_check: {setup['device']}, {setup['dtype']}, {setup['date']}",
        "",
        f"torch {setup['torch']}, transformers {setup['transformers']}, trl {setup['trl']}; student "
        f"{setup['student_parameters']:,} and teacher {setup['teacher_parameters']:,} parameters, "
        f"{setup['rollouts']} rollouts of {setup['completion_tokens']} tokens a step; median of {setup['steps']} steps "
        f"after {setup['warmup']} warm-up; {results['wall_seconds']:.0f} s in all.",
        "",
        f"| trainer | arm | median step (s) | {memory} | x stock step time | x stock peak memory |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in results["table"]:
        lines.append(
            f"| {row['trainer']} | {row['arm']} | {fmt(row['median_step_seconds'], 3)} | "
            f"{fmt(row['peak_memory_mb'], 0)} | {fmt(row['step_time_ratio'])} | {fmt(row['peak_memory_ratio'])} |"
        )
    lines += [
        "",
        "| launch (1 process) | trainer | ran as | steps | loss | teacher on |",
        "|---|---|---|---:|---:|---|",
    ]
    for name, launched in results["launched"].items():
        ranks = launched.get("ranks") or []
        if not ranks:
            reason = launched.get("skipped") or f"failed (exit {launched.get('returncode')}): see gpu_check.json"
            lines.append(f"| {name} | all | {reason} | | | |")
            continue
        for kind in ("sft", "grpo", "opd"):
            run = ranks[0][kind]
            ran = f"{run['distributed_type']}" + (f" v{run['fsdp_version']}" if run["fsdp_version"] else "")
            loss = run["losses"][0] if run["losses"] else float("nan")
            lines.append(f"| {name} | {kind.upper()} | {ran} | {run['global_step']} | {loss:.4g} | "
                         f"{run.get('teacher_device', '')} |")  # fmt: skip
    for arm in PROFILED[1:]:
        ours, stock = results["profiles"].get(arm), results["profiles"].get("stock")
        if ours is None or stock is None:
            continue
        lines += ["", f"Profile, one step: {arm} against stock (ms; ops by self time, regions by total time)", ""]
        lines += ["| clock | region or op | ours | stock | ours - stock |", "|---|---|---:|---:|---:|"]
        for clock in ours:
            mine, theirs = ours[clock], stock[clock]
            for name in REGIONS:
                a, b = mine["regions_ms"].get(name), theirs["regions_ms"].get(name)
                if a is not None or b is not None:
                    lines.append(
                        f"| {clock} | region {name} | {fmt(a, 1)} | {fmt(b, 1)} | {fmt((a or 0) - (b or 0), 1)} |"
                    )
            extra = sorted(mine["ops_ms"], key=lambda op: theirs["ops_ms"].get(op, 0.0) - mine["ops_ms"][op])
            for op in extra[:TOP_OPS]:
                a, b = mine["ops_ms"][op], theirs["ops_ms"].get(op, 0.0)
                lines.append(f"| {clock} | `{op}` | {a:,.1f} | {b:,.1f} | {a - b:,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.environ.get("OUT") or str(Path(__file__).parent / "results" / "gpu_check")
    parser.add_argument("out", nargs="?", type=Path, default=Path(default_out), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny float32 models on the CPU, 1 step each")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm (4; 1 quick)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (1)")
    parser.add_argument("--budget", type=float, default=420, help="seconds; later sections are skipped past it")
    options = parser.parse_args(argv)
    mode = "tiny" if options.quick else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: this check needs one (or pass --quick for the CPU version)")
    steps = options.steps or (1 if options.quick else 4)
    warmup = options.warmup if options.warmup is not None else 1
    started = time.perf_counter()
    if mode == "gpu":
        torch.set_num_threads(os.cpu_count())  # bench/common.py pins one thread for its CPU benchmarks

    world = LabWorld(seed=0)
    tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    model_dir = tempfile.mkdtemp(prefix="gpu-check-models-")
    paths, setup = build_models(mode, tokenizer, model_dir)
    paths["other_teacher"] = build_other_teacher(mode, world, model_dir)
    size, common = SIZES[mode], common_args(mode)
    rows = world.math("train", n=8 * size["rollouts"], seed=5)
    sft_rows = [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows]
    data = {"sft": Dataset.from_list(sft_rows), "prompts": fixed_length_prompt_dataset(tokenizer, world, size)}
    say(f"models built: {setup}")

    launched = {}
    for name in LAUNCHES:
        if options.quick:
            launched[name] = {"skipped": "not in --quick runs"}
        elif over_budget(started, options.budget):
            launched[name] = {"skipped": "time budget spent"}
        else:
            launched[name] = run_launch(name, mode, model_dir)
            say(f"{name}: exit {launched[name].get('returncode')} {launched[name].get('stderr_frames', '')}")

    runs = {}
    for trainer_name, arm in ARMS:
        if over_budget(started, options.budget):
            say(f"{trainer_name} {arm}: skipped, time budget spent")
            continue
        runs[trainer_name, arm] = run_arm(trainer_name, arm, paths, tokenizer, data, common, size, warmup, steps)
        say(f"{trainer_name} {arm}: {runs[trainer_name, arm]['median_step_seconds']:.3f} s a step")

    table = []
    for trainer_name, arm in ARMS:
        run, stock = runs.get((trainer_name, arm)), runs.get((trainer_name, "stock"))

        def ratio(key, run=run, stock=stock):
            return run[key] / stock[key] if run and stock else None

        table.append({
            "trainer": trainer_name,
            "arm": arm,
            "median_step_seconds": run and run["median_step_seconds"],
            "peak_memory_mb": run and run["peak_memory_mb"],
            "step_time_ratio": ratio("median_step_seconds"),
            "peak_memory_ratio": ratio("peak_memory_mb"),
        })  # fmt: skip
    setup.update(
        mode=mode,
        device=torch.cuda.get_device_name() if mode == "gpu" else platform.processor() or "cpu",
        dtype="bfloat16" if mode == "gpu" else "float32",
        rollouts=size["rollouts"],
        completion_tokens=size["completion_tokens"],
        steps=steps,
        warmup=warmup,
        torch=torch.__version__,
        transformers=sys.modules["transformers"].__version__,
        trl=sys.modules["trl"].__version__,
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    results = {
        "setup": setup,
        "table": table,
        "launched": launched,
        "profiles": {arm: runs["OPD", arm]["profile"] for arm in PROFILED if ("OPD", arm) in runs},
        "runs": {f"{trainer_name} {arm}": run for (trainer_name, arm), run in runs.items()},
        "wall_seconds": time.perf_counter() - started,
    }
    results["finite_losses"] = all(math.isfinite(loss) for run in runs.values() for loss in run["losses"])
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    (options.out / "gpu_check.md").write_text(markdown(results))
    say(f"wrote {options.out}/gpu_check.md and gpu_check.json in {results['wall_seconds']:.0f}s")
    return results


if __name__ == "__main__":
    main()
