"""Cost of state logging: StateLensSFTTrainer vs SFTTrainer and StateLensGRPOTrainer vs GRPOTrainer.

Three arms per trainer, same model, data, seed and steps, each in a fresh forked process, alternating within every
repeat: `stock` (TRL's trainer), `lens` (ours, default StateLoggingCallback: records, aggregates, ledger) and
`lens+probe` (ours with probe drift on 16 probe prompts). Per run: the median step time after a warm-up step, peak
memory, and the backbone's forward calls per step. In the lens arms the time spent in our own code is also timed
directly (`_record_states` in the loss, `StateLoggingCallback.on_step_end` after the step), which resolves overheads
far below the machine's noise. Probe drift runs every `probe_steps` steps; the benchmark sets `probe_steps` so one
probe falls in the measured steps, times it, and reports its cost amortised over the default `probe_steps=50`.

    .venv/bin/python bench/bench_state_logging.py [--repeats 3] [--steps 3] [--size lab|real]

`--size real` runs the same arms on the real SmolLM2-135M-Instruct (`smollm2-135m`: 30 layers, vocab 49,152) with
less work per step (REAL_WORK), and writes `state_logging_real.json`.
"""

import argparse
import statistics
import time

from common import (
    CPU_ARGS,
    backbone,
    count_parameters,
    count_saved_parameters,
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
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from trl_statelens import StateLensGRPOTrainer, StateLensSFTTrainer, StateLoggingCallback
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain
from trl_statelens.real_models import SMOLLM2
from trl_statelens.reports.runs import resolve_model

MODEL = dict(hidden=256, layers=4, ffn=1024)
# Per step: `batch` SFT sequences of at most `sft_max_length` tokens, or `batch` GRPO rollouts (4 per prompt) of
# exactly `completion_tokens` tokens (`min_new_tokens`)
LAB_WORK = dict(batch=8, sft_max_length=256, completion_tokens=32)
REAL_WORK = dict(batch=4, sft_max_length=128, completion_tokens=16)  # a step of the real model costs ~100x more
BATCH, COMPLETION_TOKENS = LAB_WORK["batch"], LAB_WORK["completion_tokens"]  # run_arm's defaults (bench_scaling)
WARMUP_STEPS = 1
NUM_PROBE_PROMPTS = 16
REALISTIC_PROBE_STEPS = 50  # StateLoggingCallback's default
ARMS = ("stock", "lens", "lens+probe")


def digit_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in completion)) for completion in completions]


def run_arm(
    kind,
    arm,
    model_path,
    tokenizer,
    dataset,
    probe_prompts,
    steps,
    max_length=256,
    packing=False,
    batch=BATCH,
    completion_tokens=COMPLETION_TOKENS,
):
    """One training run in a forked child: step times, forwards per step, peak memory, time in our code."""
    output_dir = scratch_dir(f"bench-{kind}-{arm}-")
    total_steps = WARMUP_STEPS + steps
    callbacks = None
    probe_steps = total_steps - 1  # one probe inside the measured steps (the reference sample runs before step 1)
    if arm == "lens+probe":
        callbacks = [StateLoggingCallback(probe_prompts=probe_prompts, probe_steps=probe_steps)]
    if kind == "sft":
        args = SFTConfig(
            output_dir,
            max_steps=total_steps,
            per_device_train_batch_size=batch,
            max_length=max_length,
            packing=packing,
            **CPU_ARGS,
        )
        trainer_cls = SFTTrainer if arm == "stock" else StateLensSFTTrainer
        trainer = trainer_cls(
            model=model_path, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks
        )
    else:
        args = GRPOConfig(
            output_dir,
            max_steps=total_steps,
            per_device_train_batch_size=batch,
            num_generations=4,
            max_completion_length=completion_tokens,
            generation_kwargs={"min_new_tokens": completion_tokens},
            **CPU_ARGS,
        )
        trainer_cls = GRPOTrainer if arm == "stock" else StateLensGRPOTrainer
        trainer = trainer_cls(
            model=model_path,
            reward_funcs=digit_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
        )

    # Time our own code directly: the recording in the loss and the callback at the end of each step
    own_seconds = {"record_states": [], "callback_step_end": []}

    if arm != "stock":
        trainer._record_states = timed(trainer._record_states, own_seconds["record_states"])
        callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StateLoggingCallback))
        callback.on_step_end = timed(callback.on_step_end, own_seconds["callback_step_end"])

    result = train_and_measure(trainer, {"model": backbone(trainer.model)}, WARMUP_STEPS)
    result["own_seconds"] = {name: values[WARMUP_STEPS:] for name, values in own_seconds.items()}
    result["probe_step"] = probe_steps - 1 - WARMUP_STEPS if arm == "lens+probe" else None  # index among measured
    return result


def main(repeats: int = 3, steps: int = 3, size: str = "lab") -> dict:
    world = LabWorld(seed=0)
    work = REAL_WORK if size == "real" else LAB_WORK
    if size == "real":
        model_path = resolve_model(SMOLLM2)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    else:
        tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
        model_path = scratch_dir("bench-state-logging-model-")
        model = build_qwen3(tokenizer, **MODEL)
        model.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
    rows = world.math("train", n=256)
    sft_data = Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows]
    )
    grpo_data = Dataset.from_dict({"prompt": sft_data["prompt"]})
    probe_prompts = [format_plain(r["question"]) for r in world.math("dev")[:NUM_PROBE_PROMPTS]]

    results = {"setup": {}, "runs": {}, "tables": {}}
    for kind, dataset in (("sft", sft_data), ("grpo", grpo_data)):
        runs = {arm: [] for arm in ARMS}
        for repeat in range(repeats):
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                start = time.perf_counter()
                run = run_forked(
                    run_arm,
                    kind,
                    arm,
                    model_path,
                    tokenizer,
                    dataset,
                    probe_prompts,
                    steps,
                    max_length=work["sft_max_length"],
                    batch=work["batch"],
                    completion_tokens=work["completion_tokens"],
                )
                runs[arm].append(run)
                say(
                    f"{kind} repeat {repeat + 1}/{repeats} {arm}: median step "
                    f"{statistics.median(run['step_seconds']):.3f}s ({time.perf_counter() - start:.0f}s)"
                )
        results["runs"][kind] = runs
        results["tables"][kind] = summarize(kind, runs)

    for kind, rows in results["tables"].items():
        print_table(f"State logging: {kind.upper()} (StateLens / stock, ratios over repeats)", rows)
    results["setup"] = dict(
        size=size,
        model=SMOLLM2 if size == "real" else MODEL,
        parameters=count_saved_parameters(model_path) if size == "real" else count_parameters(model),
        vocab_size=len(tokenizer),
        batch=work["batch"],
        grpo_completion_tokens=work["completion_tokens"],
        sft_max_length=work["sft_max_length"],
        probe_prompts=NUM_PROBE_PROMPTS,
        warmup_steps=WARMUP_STEPS,
        measured_steps=steps,
        repeats=repeats,
    )
    path = write_results("state_logging_real" if size == "real" else "state_logging", results)
    say(f"wrote {path}")
    return results


def summarize(kind: str, runs: dict) -> list[dict]:
    def median_step(run, skip_probe=False):
        times = [t for i, t in enumerate(run["step_seconds"]) if not (skip_probe and i == run["probe_step"])]
        return statistics.median(times)

    def forwards(run, skip_probe=False):
        return [
            s["model"] for i, s in enumerate(run["forwards_per_step"]) if not (skip_probe and i == run["probe_step"])
        ]

    stock, lens, probe = runs["stock"], runs["lens"], runs["lens+probe"]
    rows = [
        ratio_row(
            "lens / stock: median step time", [median_step(a) / median_step(b) for a, b in zip(lens, stock)], "<= 1.02"
        ),
        ratio_row(
            "lens / stock: peak RSS", [a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(lens, stock)], "<= 1.02"
        ),
        ratio_row(
            "lens / stock: train memory (peak - start RSS)",
            [a["train_mem_mb"] / b["train_mem_mb"] for a, b in zip(lens, stock)],
            "<= 1.02",
        ),
        ratio_row(
            "lens: 1 + own code time per step / stock step",
            [
                1
                + (sum(a["own_seconds"]["record_states"]) + sum(a["own_seconds"]["callback_step_end"]))
                / len(a["step_seconds"])
                / median_step(b)
                for a, b in zip(lens, stock)
            ],
            "<= 1.02",
        ),
        ratio_row("stock: forwards per step", [float(c) for run in stock for c in forwards(run)]),
        ratio_row("lens: forwards per step", [float(c) for run in lens for c in forwards(run)]),
        ratio_row(
            "lens - stock: extra forwards per step",
            [float(a - b) for ra, rb in zip(lens, stock) for a, b in zip(forwards(ra), forwards(rb))],
            "== 0",
        ),
    ]
    # Probe drift: the probe step's extra callback time is the cost of one probe; amortise it over probe_steps=50
    probe_costs = []
    for run in probe:
        callback_times = run["own_seconds"]["callback_step_end"]
        others = [t for i, t in enumerate(callback_times) if i != run["probe_step"]]
        probe_costs.append(callback_times[run["probe_step"]] - statistics.median(others))
    rows += [
        ratio_row(
            "lens+probe / stock: median step time (non-probe steps)",
            [median_step(a, skip_probe=True) / median_step(b) for a, b in zip(probe, stock)],
        ),
        ratio_row(
            "lens+probe: one probe, in stock median steps", [c / median_step(b) for c, b in zip(probe_costs, stock)]
        ),
        ratio_row(
            f"lens+probe: 1 + (own code + probe / {REALISTIC_PROBE_STEPS}) / stock step",
            [
                1
                + (
                    sum(a["own_seconds"]["record_states"]) / len(a["step_seconds"])
                    + statistics.median(
                        t for i, t in enumerate(a["own_seconds"]["callback_step_end"]) if i != a["probe_step"]
                    )
                    + c / REALISTIC_PROBE_STEPS
                )
                / median_step(b)
                for a, b, c in zip(probe, stock, probe_costs)
            ],
            "<= 1.02",
        ),
        ratio_row(
            f"lens+probe / stock: mean step time at probe_steps={REALISTIC_PROBE_STEPS}",
            [
                (median_step(a, skip_probe=True) + c / REALISTIC_PROBE_STEPS) / median_step(b)
                for a, b, c in zip(probe, stock, probe_costs)
            ],
        ),
        ratio_row("lens+probe / stock: peak RSS", [a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(probe, stock)]),
        ratio_row(
            "lens+probe / stock: train memory (peak - start RSS)",
            [a["train_mem_mb"] / b["train_mem_mb"] for a, b in zip(probe, stock)],
        ),
        ratio_row(
            "lens+probe - stock: extra forwards per non-probe step",
            [
                float(a - b)
                for ra, rb in zip(probe, stock)
                for i, (a, b) in enumerate(zip(forwards(ra), forwards(rb)))
                if i != ra["probe_step"]
            ],
            "== 0",
        ),
        ratio_row(
            "lens+probe: extra forwards on the probe step",
            [float(forwards(a)[a["probe_step"]] - forwards(b)[a["probe_step"]]) for a, b in zip(probe, stock)],
        ),
        ratio_row("stock: median step seconds", [median_step(run) for run in stock]),
        ratio_row("stock: train memory MB", [run["train_mem_mb"] for run in stock]),
    ]
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run, after one warm-up step")
    parser.add_argument("--size", choices=("lab", "real"), default="lab")
    options = parser.parse_args()
    main(options.repeats, options.steps, options.size)
