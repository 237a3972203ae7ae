"""Cost as the work grows: how step time and memory move with the vocabulary, the sequence length and the probe set.

Three sweeps, every run in a fresh forked child (`common.run_forked`), the arms of each point run side by side and in
alternating order, so the ratios at a point are measured under the same load:

- `opd`: OnPolicyDistillTrainer (`reverse_kl`, `continuation`, `divergence`) vs DistillationTrainer(beta=1) at
  vocabularies `V` and completion lengths `T` (the runs of `bench_opd.run_arm`, with the reverse_kl floor);
- `sft`: StateLensSFTTrainer vs SFTTrainer on packed sequences of growing length (the runs of
  `bench_state_logging.run_arm`, with our own code timed directly);
- `probe`: probe drift (`trl_statelens.lens.drift`) against the number of probe states, on lab text: the linear-memory
  path at every size, the exact dense path where it fits, the MMD estimate's error against the exact value; and one
  real probe step (sampling and drift) of 64 probes x 256 tokens inside a training run.

For each sweep: step time and memory per point, ratios side by side, and the fitted growth (the slope of log cost
against log size). Results go to `bench/results/scaling.json` (`scaling_quick.json` with `--quick`) with plots
`scaling_*.png` next to it.

    .venv/bin/python bench/bench_scaling.py [--quick] [--only opd|sft|probe] [--steps 2] [--out DIR]
    .venv/bin/python bench/bench_scaling.py --versus divergence [--repeats 3] [--steps 2]   # one arm vs distill, paired
"""

import argparse
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

import bench_opd
import bench_state_logging
import numpy as np
import torch
from common import (
    CPU_ARGS,
    RESULTS_DIR,
    backbone,
    peak_memory_mb,
    run_forked,
    say,
    scratch_dir,
    start_peak_memory,
    train_and_measure,
    write_results,
)
from datasets import Dataset
from trl import SFTConfig

from trl_statelens import StateLensSFTTrainer, StateLoggingCallback
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain
from trl_statelens.lens import callback as callback_module
from trl_statelens.lens import drift as drift_module
from trl_statelens.lens.drift import PrefixFeatures, drift_metrics, featurize, prefix_states, probe_drift

# Sizes. The full sweep is sized to fit 15 minutes on 2 quiet cores with one torch thread: the OPD models are narrow
# (hidden 64, 2 layers), so the vocabulary projection dominates as it does in the loss (an upper bound on what
# OPD's sampled-token loss saves), with 2 rollouts a step; the SFT model is bench_state_logging's (hidden 256, 4
# layers) at one packed sequence a step; the probe step uses a hidden-128, 2-layer model; 2 measured steps after 1
# warm-up, one run per arm and point.
FULL = dict(
    opd_model=dict(hidden=64, layers=2, ffn=256),
    opd_cells=list(itertools.product((8192, 32768, 151936), (32, 128, 512))),
    opd_rollouts=2,
    sft_model=bench_state_logging.MODEL,
    sft_lengths=(256, 512, 1024, 2048),
    probe_sizes=((8, 50), (16, 50), (32, 50), (64, 100), (64, 200), (128, 200), (256, 200)),  # (probes, words)
    exact_max_states=1600,  # the dense exact path runs up to this many states a side (it is quadratic)
    error_seeds=5,
    probe_step=dict(model=dict(hidden=128, layers=2, ffn=512), probes=64, tokens=256),
)
QUICK = dict(
    opd_model=dict(hidden=32, layers=1, ffn=64),
    opd_cells=[(1024, 8), (2048, 8), (1024, 16)],  # V of at least the tokenizer's 1024
    opd_rollouts=2,
    sft_model=dict(hidden=32, layers=1, ffn=64),
    sft_lengths=(64, 128),
    probe_sizes=((4, 10), (8, 20)),
    exact_max_states=200,
    error_seeds=2,
    probe_step=dict(model=dict(hidden=32, layers=1, ffn=64), probes=4, tokens=16),
)
OPD_ARMS = bench_opd.ARMS  # distill first: the others are divided by it


def lab_tokenizer(world):
    """The lab tokenizer of every sweep, allowed past the lab's 512 tokens (packed SFT sequences, OPD rollouts)."""
    tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    tokenizer.model_max_length = 4096
    return tokenizer


def machine_conditions(start: float, load_before) -> dict:
    """When a sweep ran, how loaded the machine was before and after it, and how long it took."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": round(time.perf_counter() - start),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
    }


def slope(sizes, costs) -> float:
    """Fitted growth: the slope of log(cost) against log(size) (1 = linear, 2 = quadratic)."""
    return float(np.polyfit(np.log(sizes), np.log(costs), 1)[0])


# ----- OPD vs DistillationTrainer --------------------------------------------------------------------------------
def opd_cells(config, tokenizer, world):
    """The OPD sweep's (V, T) cells in order, each as `(V, T, paths, parameters, dataset)`: the student and teacher
    saved once per V (`paths`, with their `parameters`) and the fixed-length prompts."""
    dataset = Dataset.from_dict({"prompt": bench_opd.fixed_length_prompts(tokenizer, world, n=64)})
    model_dir = scratch_dir("bench-scaling-opd-")
    for vocab_size in sorted({v for v, _ in config["opd_cells"]}):
        shape = config["opd_model"]
        paths, parameters = bench_opd.save_models(tokenizer, vocab_size, model_dir, shape, shape)
        for length in sorted(t for v, t in config["opd_cells"] if v == vocab_size):
            yield vocab_size, length, paths, parameters, dataset


def sweep_opd(config, tokenizer, world, steps, on_cell=None) -> dict:
    """Every (V, T) cell; `on_cell(partial_results)` after each one, so an interrupted sweep keeps its cells."""
    cells = []
    for vocab_size, length, paths, parameters, dataset in opd_cells(config, tokenizer, world):
        runs = {}
        order = OPD_ARMS if len(cells) % 2 == 0 else OPD_ARMS[::-1]
        for arm in order:
            start = time.perf_counter()
            runs[arm] = bench_opd.run_arm_forked(
                arm, paths, tokenizer, dataset, steps, rollouts=config["opd_rollouts"], completion_tokens=length
            )
            say(
                f"opd V={vocab_size} T={length} {arm}: step {statistics.median(runs[arm]['step_seconds']):.2f}s, "
                f"train mem {runs[arm]['train_mem_mb']:.0f} MB ({time.perf_counter() - start:.0f}s)"
            )
        cells.append(summarize_opd_cell(vocab_size, length, parameters["student"], runs))
        if on_cell is not None:
            on_cell({"cells": cells, "slopes": opd_slopes(cells), "complete": False})
    return {"cells": cells, "slopes": opd_slopes(cells)}


def summarize_opd_cell(vocab_size, length, parameters, runs) -> dict:
    step = {arm: statistics.median(run["step_seconds"]) for arm, run in runs.items()}
    floor = {part: statistics.median(values) for part, values in runs["reverse_kl"]["floor"].items()}
    cell = {
        "vocab_size": vocab_size,
        "completion_tokens": length,
        "student_parameters": parameters,
        "step_seconds": step,
        "train_mem_mb": {arm: run["train_mem_mb"] for arm, run in runs.items()},
        "peak_rss_mb": {arm: run["peak_rss_mb"] for arm, run in runs.items()},
        "forwards_per_step": {arm: run["forwards_per_step"][0] for arm, run in runs.items()},
        "floor_seconds": floor,
        "reverse_kl_step_over_floor": step["reverse_kl"] / floor["total"],
        # generation is the same work in both trainers: the rest of the step is what the losses differ in
        "reverse_kl_non_generation_ratio": (step["reverse_kl"] - floor["generate"])
        / (step["distill"] - floor["generate"]),
    }
    for arm in OPD_ARMS[1:]:
        cell[f"{arm}_time_ratio"] = step[arm] / step["distill"]
        cell[f"{arm}_memory_ratio"] = runs[arm]["train_mem_mb"] / runs["distill"]["train_mem_mb"]
    return cell


def sweep_opd_pair(config, tokenizer, world, steps, repeats, arm) -> dict:
    """`arm` against DistillationTrainer(beta=1) alone at every (V, T) cell of the OPD sweep, `repeats` pairs per cell
    in alternating order. Per pair the ratio of median step times and of train memory; per cell their median, min
    and max. The one-run sweep cannot resolve a ratio within a few percent; the spread of these pairs says whether
    they do."""
    cells = []
    for vocab_size, length, paths, _, dataset in opd_cells(config, tokenizer, world):
        runs = {"distill": [], arm: []}
        for repeat in range(repeats):
            for name in ("distill", arm) if (len(cells) + repeat) % 2 == 0 else (arm, "distill"):
                run = bench_opd.run_arm_forked(
                    name,
                    paths,
                    tokenizer,
                    dataset,
                    steps,
                    rollouts=config["opd_rollouts"],
                    completion_tokens=length,
                )
                runs[name].append(run)
                say(
                    f"pair V={vocab_size} T={length} {name} #{repeat}: step {statistics.median(run['step_seconds']):.2f}s"
                )
        step = {name: [statistics.median(run["step_seconds"]) for run in values] for name, values in runs.items()}
        memory = {name: [run["train_mem_mb"] for run in values] for name, values in runs.items()}
        time_ratios = [a / d for a, d in zip(step[arm], step["distill"])]
        memory_ratios = [a / d for a, d in zip(memory[arm], memory["distill"])]
        cells.append(
            {
                "vocab_size": vocab_size,
                "completion_tokens": length,
                "step_seconds": step,
                "train_mem_mb": memory,
                "time_ratios": time_ratios,
                "memory_ratios": memory_ratios,
                "time_ratio": [statistics.median(time_ratios), min(time_ratios), max(time_ratios)],
                "memory_ratio": [statistics.median(memory_ratios), min(memory_ratios), max(memory_ratios)],
            }
        )
    return {"arm": arm, "repeats": repeats, "steps": steps, "cells": cells}


def pair_table(results) -> str:
    arm = results["arm"]
    lines = [
        f"| V | T | {arm} / distill time: median [min, max] | memory: median [min, max] | distill s |",
        "|---:|---:|---|---|---:|",
    ]
    for c in results["cells"]:
        time_ratio, memory_ratio = c["time_ratio"], c["memory_ratio"]
        lines.append(
            f"| {c['vocab_size']} | {c['completion_tokens']} | {time_ratio[0]:.3f} [{time_ratio[1]:.3f}, "
            f"{time_ratio[2]:.3f}] | {memory_ratio[0]:.3f} [{memory_ratio[1]:.3f}, {memory_ratio[2]:.3f}] | "
            f"{statistics.median(c['step_seconds']['distill']):.2f} |"
        )
    return "\n".join(lines)


def opd_slopes(cells) -> dict:
    """Growth of each arm's step time and train memory with V (at each T) and with T (at each V)."""
    slopes = {}
    for axis, other in (("vocab_size", "completion_tokens"), ("completion_tokens", "vocab_size")):
        for fixed in sorted({c[other] for c in cells}):
            line = sorted((c for c in cells if c[other] == fixed), key=lambda c: c[axis])
            if len(line) < 2:
                continue
            sizes = [c[axis] for c in line]
            for arm in OPD_ARMS:
                key = f"{arm} vs {axis} at {other}={fixed}"
                slopes[key] = {
                    "step_seconds": slope(sizes, [c["step_seconds"][arm] for c in line]),
                    "train_mem_mb": slope(sizes, [max(c["train_mem_mb"][arm], 1.0) for c in line]),
                }
    return slopes


PROFILED_METHODS = (
    "training_step",
    "_generate_and_score_completions",
    "_generate",
    "_compute_loss",
    "_divergence_loss",
    "_token_logps_and_entropy",
    "_record_states",
    "_log_teacher_metrics",
)


def profile_opd(arm, vocab_size, length, steps=1, config=FULL) -> dict:
    """One OPD or distill run with the time of each phase per step (the trainer's methods in PROFILED_METHODS that
    it has, timed where they are defined; nested ones count inside their callers too), to explain a ratio."""
    world = LabWorld(seed=0)
    tokenizer = lab_tokenizer(world)
    dataset = Dataset.from_dict({"prompt": bench_opd.fixed_length_prompts(tokenizer, world, n=64)})
    shape = config["opd_model"]
    paths, _ = bench_opd.save_models(tokenizer, vocab_size, scratch_dir("bench-profile-"), shape, shape)
    phases = {}

    def timed(name, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            value = method(*args, **kwargs)
            phases.setdefault(name, []).append(time.perf_counter() - start)
            return value

        return wrapper

    def run():  # in a forked child: the patched classes do not outlive it
        trainer_class = bench_opd.DistillationTrainer if arm == "distill" else bench_opd.OnPolicyDistillTrainer
        for name in PROFILED_METHODS:
            if hasattr(trainer_class, name):
                setattr(trainer_class, name, timed(name, getattr(trainer_class, name)))
        result = bench_opd.run_arm(
            arm,
            paths["student"],
            paths["teacher"],
            tokenizer,
            dataset,
            steps,
            arm == "reverse_kl",
            rollouts=config["opd_rollouts"],
            completion_tokens=length,
        )
        result["phase_seconds_per_call"] = phases  # in call order: the warm-up step's calls come first
        return result

    return run_forked(run)


# ----- SFT state logging on packed sequences -----------------------------------------------------------------
def sweep_sft(config, tokenizer, world, steps) -> dict:
    rows = world.math("train", n=512)
    dataset = Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows]
    )
    model_path = scratch_dir("bench-scaling-sft-")
    build_qwen3(tokenizer, **config["sft_model"]).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    points = []
    for index, length in enumerate(config["sft_lengths"]):
        runs = {}
        for arm in ("stock", "lens") if index % 2 == 0 else ("lens", "stock"):
            runs[arm] = run_forked(
                bench_state_logging.run_arm,
                "sft",
                arm,
                model_path,
                tokenizer,
                dataset,
                None,
                steps,
                max_length=length,
                packing=True,
                batch=1,
            )
            say(f"sft L={length} {arm}: step {statistics.median(runs[arm]['step_seconds']):.2f}s")
        stock_step = statistics.median(runs["stock"]["step_seconds"])
        lens_step = statistics.median(runs["lens"]["step_seconds"])
        own = runs["lens"]["own_seconds"]
        own_per_step = (sum(own["record_states"]) + sum(own["callback_step_end"])) / len(runs["lens"]["step_seconds"])
        points.append(
            {
                "max_length": length,
                "stock_step_seconds": stock_step,
                "lens_step_seconds": lens_step,
                "own_seconds_per_step": own_per_step,
                "time_ratio": lens_step / stock_step,
                "own_code_ratio": 1 + own_per_step / stock_step,
                "memory_ratio": runs["lens"]["train_mem_mb"] / runs["stock"]["train_mem_mb"],
                "stock_train_mem_mb": runs["stock"]["train_mem_mb"],
                "lens_train_mem_mb": runs["lens"]["train_mem_mb"],
                "extra_forwards": [
                    a["model"] - b["model"]
                    for a, b in zip(runs["lens"]["forwards_per_step"], runs["stock"]["forwards_per_step"])
                ],
            }
        )
    lengths = [p["max_length"] for p in points]
    slopes = {
        name: slope(lengths, [max(p[name], 1e-6) for p in points])
        for name in ("stock_step_seconds", "lens_step_seconds", "own_seconds_per_step", "stock_train_mem_mb")
    }
    return {"points": points, "slopes": slopes}


# ----- probe drift against the number of states ----------------------------------------------------------------
def lab_completions(world, num_probes, num_words, seed, math_share):
    """Probe-like completions of exactly `num_words` words: lab corpus documents, with a `math_share` of the
    completions made of math answers instead (two sets with different shares drift apart)."""
    rng = random.Random(seed)
    math_rows = world.math("train", n=200, seed=seed)
    completions = []
    for index in range(num_probes):
        text = []
        while len(text) < num_words:
            if index < math_share * num_probes:
                text += rng.choice(math_rows)["answer"].split()
            else:
                text += world.corpus_document(rng).split()
        completions.append(" ".join(text[:num_words]))
    return completions


def measure_drift(world, num_probes, num_words, path, error_seeds=0) -> dict:
    """One probe-drift computation in a forked child: `linear` (PrefixFeatures, every distance on the linear path),
    `default` (what the callback runs: exact up to MAX_EXACT_STATES) or `exact` (featurize + drift_metrics, dense)."""
    reference = lab_completions(world, num_probes, num_words, seed=0, math_share=0.25)
    current = lab_completions(world, num_probes, num_words, seed=1, math_share=0.5)
    rss_at_start = start_peak_memory()
    start = time.perf_counter()
    if path == "exact":
        values = drift_metrics(featurize(prefix_states(reference)), featurize(prefix_states(current)))
    else:
        features = PrefixFeatures(reference), PrefixFeatures(current)
        values = probe_drift(*features, max_states=0 if path == "linear" else drift_module.MAX_EXACT_STATES)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "values": values, **peak_memory_mb(rss_at_start)}
    if error_seeds:  # the MMD estimate at other seeds, for its spread against the exact value
        result["mmd_by_seed"] = [drift_module.mmd2_random_features(*features, seed=s) for s in range(error_seeds)]
    return result


def sweep_probe(config, world) -> dict:
    points = []
    for num_probes, num_words in config["probe_sizes"]:
        states = num_probes * num_words
        point = {"probes": num_probes, "words": num_words, "states_per_side": states}
        # the callback's default path is the exact one up to MAX_EXACT_STATES, and the linear one above
        paths = ("linear",) + (("default",) if states <= drift_module.MAX_EXACT_STATES else ())
        paths += ("exact",) if states <= config["exact_max_states"] else ()
        for path in paths:
            seeds = config["error_seeds"] if path == "linear" and "exact" in paths else 0
            point[path] = run_forked(measure_drift, world, num_probes, num_words, path, seeds)
            say(
                f"probe {num_probes}x{num_words} ({states} states a side) {path}: "
                f"{point[path]['seconds']:.2f}s, {point[path]['train_mem_mb']:.0f} MB"
            )
        if "exact" in point:
            exact = point["exact"]["values"]["mmd"]
            point["mmd_relative_errors"] = [m / exact - 1 for m in point["linear"]["mmd_by_seed"]]
            point["other_distances_max_relative_error"] = max(
                abs(point["linear"]["values"][k] / exact_value - 1) if exact_value else 0.0
                for k, exact_value in point["exact"]["values"].items()
                if k != "mmd"
            )
        points.append(point)
    return {
        "points": points,
        "slopes": probe_slopes(points),
        "probe_step": run_forked(measure_probe_step, config, world),
    }


def probe_slopes(points) -> dict:
    """Growth of the exact path over the sizes it ran at, and of the linear path above the exact budget (below it,
    its fixed cost, the random frequencies, dominates)."""
    slopes = {}
    for path, keep in (
        ("exact", lambda p: True),
        ("linear", lambda p: p["states_per_side"] > drift_module.MAX_EXACT_STATES),
    ):
        line = [p for p in points if path in p and keep(p)]
        if len(line) >= 2:
            sizes = [p["states_per_side"] for p in line]
            slopes[path] = {
                "seconds": slope(sizes, [p[path]["seconds"] for p in line]),
                "train_mem_mb": slope(sizes, [max(p[path]["train_mem_mb"], 1.0) for p in line]),
            }
    return slopes


def measure_probe_step(config, world, base_kl: bool = True) -> dict:
    """One probe step inside a StateLensSFTTrainer run (sampling the probes, then drift and `base_kl`), timed by
    parts, with the peak memory of the run, and the training step it is measured against. `base_kl=False` runs the
    probe as it was before `base_kl`: no scoring of the step-0 completions, at step 0 or at the probe."""
    setting = config["probe_step"]
    tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    model_path = scratch_dir("bench-scaling-probe-")
    build_qwen3(tokenizer, **setting["model"]).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    prompts = [format_plain(r["question"]) for r in world.math("dev")[: setting["probes"]]]
    rows = world.math("train", n=64)
    dataset = Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows]
    )
    # Steps 2 and 4 train only, step 3 also probes (the reference is sampled before step 1)
    callback = StateLoggingCallback(probe_prompts=prompts, probe_steps=3, probe_max_new_tokens=setting["tokens"])
    args = SFTConfig(
        scratch_dir("bench-scaling-probe-run-"),
        max_steps=4,
        per_device_train_batch_size=bench_state_logging.BATCH,
        max_length=256,
        **CPU_ARGS,
    )
    trainer = StateLensSFTTrainer(
        model=model_path, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback]
    )
    parts = {"sample": [], "drift": [], "states": [], "reference": [], "base_kl": []}
    sample, drift = callback._sample_probes, drift_module.probe_drift
    reference, divergences = callback._load_or_make_reference, callback._reference_divergences

    def timed_sample():
        start = time.perf_counter()
        completions = sample()
        parts["sample"].append(time.perf_counter() - start)
        return completions

    def timed_drift(reference, current, **kwargs):
        start = time.perf_counter()
        values = drift(reference, current, **kwargs)
        parts["drift"].append(time.perf_counter() - start)
        parts["states"].append(current.num_states)
        return values

    def timed_reference(state):  # sampling the step-0 completions, then scoring them (base_kl's step 0)
        start = time.perf_counter()
        values = reference(state) if base_kl else (callback._sample_probes(), [])
        parts["reference"].append(time.perf_counter() - start)
        return values

    def timed_divergences():  # base_kl's forward over the step-0 completions at the probe
        start = time.perf_counter()
        values = divergences() if base_kl else {}
        parts["base_kl"].append(time.perf_counter() - start)
        return values

    callback._sample_probes = timed_sample
    callback._load_or_make_reference, callback._reference_divergences = timed_reference, timed_divergences
    callback_module.probe_drift = timed_drift  # this forked child's copy of the module
    result = train_and_measure(trainer, {"model": backbone(trainer.model)}, warmup_steps=0)
    steps = result["step_seconds"]
    return {
        **setting,
        "sample_seconds": parts["sample"],  # the reference at train begin, then the probe at step 3
        "drift_seconds": parts["drift"],
        "base_kl": base_kl,
        "base_kl_seconds": parts["base_kl"],  # at the probe step
        "reference_scoring_seconds": parts["reference"][0] - parts["sample"][0],  # at train begin (step 0)
        "states": parts["states"],
        "training_step_seconds": statistics.median([steps[1], steps[3]]),  # the steps without a probe or warm-up
        "probe_step_seconds": steps[2],
        "peak_rss_mb": result["peak_rss_mb"],
        "train_mem_mb": result["train_mem_mb"],
    }


# ----- plots ---------------------------------------------------------------------------------------------------
def plot(results, directory: Path, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "opd" in results:
        cells = results["opd"]["cells"]
        lengths = sorted({c["completion_tokens"] for c in cells})
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for length in lengths:
            line = sorted((c for c in cells if c["completion_tokens"] == length), key=lambda c: c["vocab_size"])
            vocab = [c["vocab_size"] for c in line]
            axes[0].plot(vocab, [c["reverse_kl_time_ratio"] for c in line], "o-", label=f"step time, T={length}")
            axes[1].plot(vocab, [c["reverse_kl_memory_ratio"] for c in line], "o-", label=f"train memory, T={length}")
        for ax, title in zip(axes, ("step time", "train memory")):
            ax.set_xscale("log")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_xlabel("vocabulary V")
            ax.set_title(f"OPD reverse_kl / DistillationTrainer: {title}")
            ax.legend(fontsize=8)
        written.append(save(fig, directory / f"scaling_opd{suffix}.png"))
    if "sft" in results:
        points = results["sft"]["points"]
        lengths = [p["max_length"] for p in points]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].loglog(lengths, [p["stock_step_seconds"] for p in points], "o-", label="SFTTrainer step")
        axes[0].loglog(lengths, [p["lens_step_seconds"] for p in points], "s--", label="StateLensSFTTrainer step")
        axes[0].loglog(lengths, [p["own_seconds_per_step"] for p in points], "^-", label="our code per step")
        axes[0].set_xlabel("packed sequence length")
        axes[0].set_ylabel("seconds")
        axes[0].legend(fontsize=8)
        axes[1].plot(lengths, [p["time_ratio"] for p in points], "o-", label="step time (A/B)")
        axes[1].plot(lengths, [p["own_code_ratio"] for p in points], "^-", label="1 + own code / stock step")
        axes[1].plot(lengths, [p["memory_ratio"] for p in points], "s-", label="train memory")
        axes[1].axhline(1.02, color="red", lw=0.5, label="target 1.02")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("packed sequence length")
        axes[1].set_title("StateLens / stock")
        axes[1].legend(fontsize=8)
        written.append(save(fig, directory / f"scaling_sft{suffix}.png"))
    if "probe" in results:
        points = results["probe"]["points"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for path, style in (("linear", "o-"), ("default", "s--"), ("exact", "^-")):
            line = [p for p in points if path in p]
            states = [p["states_per_side"] for p in line]
            axes[0].loglog(states, [p[path]["seconds"] for p in line], style, label=path)
            axes[1].loglog(states, [max(p[path]["train_mem_mb"], 1.0) for p in line], style, label=path)
        axes[0].set_ylabel("seconds per drift computation")
        axes[1].set_ylabel("peak memory above start (MB)")
        for ax in axes:
            ax.set_xlabel("probe states a side")
            ax.legend(fontsize=8)
        written.append(save(fig, directory / f"scaling_probe{suffix}.png"))
    return written


def save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def main(quick: bool = False, only: str | None = None, steps: int = 2, out: Path = RESULTS_DIR) -> dict:
    """Run the sweeps (probe, then sft, then opd; or `only` one of them) and write the JSON and plots after each
    one, so an interrupted run keeps what it measured. With `only`, the other sweeps already in the JSON are kept."""
    config = QUICK if quick else FULL
    suffix = "_quick" if quick else ""
    path = out / f"scaling{suffix}.json"
    results = json.loads(path.read_text()) if only and path.exists() else {}
    results.update(quick=quick, steps=steps, config=config)
    results.setdefault("machine", {})
    world = LabWorld(seed=0)
    tokenizer = lab_tokenizer(world)

    def keep_partial(partial):
        results["opd"] = partial
        write_results(f"scaling{suffix}", results, directory=out)

    sweeps = {
        "probe": lambda: sweep_probe(config, world),
        "sft": lambda: sweep_sft(config, tokenizer, world, steps),
        "opd": lambda: {**sweep_opd(config, tokenizer, world, steps, keep_partial), "complete": True},
    }
    for name, sweep in sweeps.items():
        if only not in (None, name):
            continue
        start = time.perf_counter()
        load_before = os.getloadavg()
        results[name] = sweep()
        results["machine"][name] = machine_conditions(start, load_before)
        results["plots"] = plot(results, out, suffix)
        write_results(f"scaling{suffix}", results, directory=out)
        say(f"{name} sweep done in {results['machine'][name]['wall_seconds']} s; wrote {path}")
    return results


def markdown_tables(results) -> str:
    """The tables of BENCHMARKS.md's scaling section, from a results JSON."""
    lines = []
    if "opd" in results:
        lines += [
            "| V | T | distill s | reverse_kl time | memory | continuation time | memory | divergence time | memory "
            "| distill train MB | rkl step / floor | rkl non-generation |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in results["opd"]["cells"]:
            lines.append(
                f"| {c['vocab_size']} | {c['completion_tokens']} | {c['step_seconds']['distill']:.2f} "
                + "".join(f"| {c[f'{a}_time_ratio']:.3f} | {c[f'{a}_memory_ratio']:.3f} " for a in OPD_ARMS[1:])
                + f"| {c['train_mem_mb']['distill']:.0f} | {c['reverse_kl_step_over_floor']:.3f} "
                f"| {c['reverse_kl_non_generation_ratio']:.3f} |"
            )
        lines += ["", "| growth (log-log slope) | " + " | ".join(OPD_ARMS) + " |", "|---|" + "---:|" * len(OPD_ARMS)]
        keys = sorted({k.split(" ", 1)[1] for k in results["opd"]["slopes"]})
        for key in keys:
            for measure in ("step_seconds", "train_mem_mb"):
                row = [results["opd"]["slopes"].get(f"{arm} {key}", {}).get(measure) for arm in OPD_ARMS]
                lines.append(f"| {measure} {key} | " + " | ".join("" if v is None else f"{v:.2f}" for v in row) + " |")
        lines.append("")
    if "sft" in results:
        lines += [
            "| packed length | stock step s | lens / stock step | 1 + own code / stock step | train memory | "
            "stock train MB | extra forwards |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in results["sft"]["points"]:
            lines.append(
                f"| {p['max_length']} | {p['stock_step_seconds']:.2f} | {p['time_ratio']:.3f} | "
                f"{p['own_code_ratio']:.4f} | {p['memory_ratio']:.3f} | {p['stock_train_mem_mb']:.0f} | "
                f"{max(p['extra_forwards'])} |"
            )
        lines += ["", "slopes: " + ", ".join(f"{k} {v:.2f}" for k, v in results["sft"]["slopes"].items()), ""]
    if "probe" in results:
        lines += [
            "| probes x words | states a side | linear s | linear MB | default s | default MB | exact s | exact MB "
            "| MMD estimate error (seeds) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for p in results["probe"]["points"]:

            def cell(path, p=p):
                if path in p:
                    return f"{p[path]['seconds']:.2f} | {p[path]['train_mem_mb']:.0f}"
                return "= linear | = linear" if path == "default" else "not run | not run"

            errors = ", ".join(f"{e:+.1%}" for e in p.get("mmd_relative_errors", []))
            lines.append(
                f"| {p['probes']} x {p['words']} | {p['states_per_side']} | {cell('linear')} | {cell('default')} "
                f"| {cell('exact')} | {errors} |"
            )
        lines += ["", "slopes: " + json.dumps(results["probe"]["slopes"]), ""]
        step = results["probe"].get("probe_step")
        if step:
            lines.append("probe step: " + json.dumps(step))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: tiny models and sizes, about a minute")
    parser.add_argument("--only", choices=("opd", "sft", "probe"))
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run, after one warm-up step")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and the plots go")
    parser.add_argument(
        "--tables", action="store_true", help="print the markdown tables of the JSON in --out and exit"
    )
    parser.add_argument("--profile", nargs=3, metavar=("ARM", "V", "T"), help="time one run's phases and exit")
    parser.add_argument(
        "--versus",
        choices=bench_opd.ARMS[1:],
        help="only this OPD arm against DistillationTrainer at every OPD cell, --repeats pairs each; writes "
        "scaling_versus_<arm>.json and prints the table",
    )
    parser.add_argument("--repeats", type=int, default=3, help="pairs per cell with --versus")
    options = parser.parse_args()
    if options.versus:
        world = LabWorld(seed=0)
        start, load_before = time.perf_counter(), os.getloadavg()
        results = sweep_opd_pair(
            QUICK if options.quick else FULL,
            lab_tokenizer(world),
            world,
            options.steps,
            options.repeats,
            options.versus,
        )
        results["machine"] = machine_conditions(start, load_before)
        suffix = "_quick" if options.quick else ""
        write_results(f"scaling_versus_{options.versus}{suffix}", results, directory=options.out)
        print(pair_table(results))
    elif options.profile:
        arm, vocab_size, length = options.profile
        print(json.dumps(profile_opd(arm, int(vocab_size), int(length), options.steps), indent=1))
    elif options.tables:
        name = "scaling_quick.json" if options.quick else "scaling.json"
        print(markdown_tables(json.loads((options.out / name).read_text())))
    else:
        main(options.quick, options.only, options.steps, options.out)
