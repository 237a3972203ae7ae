"""GPU smoke check: the StateLens trainers and OnPolicyDistillTrainer at Qwen3-0.6B / 1.7B size on one CUDA GPU, bf16.

Random-init models built from configs (nothing is downloaded): a student shaped like Qwen3-0.6B (hidden 1024, 28
layers, 16/8 heads of 128, vocabulary 151936, tied head) and a teacher shaped like Qwen3-1.7B (hidden 2048), with the
lab tokenizer (ids past its 1024 tokens decode to nothing). It runs, writing one JSON file:

- SFT and GRPO, one step each, stock TRL vs StateLens on the same data and seed: loss, grad_norm and entropy (and
  GRPO's reward) must be equal, and the backbone's forward calls per step too (0 extra forwards);
- on-policy distillation, 1 warm-up + `steps` steps per signal (`reverse_kl`, `continuation`, `divergence`) and for
  TRL's `DistillationTrainer(beta=1)`, equal work per step (the same number of rollouts of exactly the same length):
  median step time, completion tokens/s, peak GPU memory (`torch.cuda.max_memory_allocated`), forwards per step, and
  each arm's ratios to the stock one. Losses must be finite.

- FSDP2: SFT, GRPO and OPD (with its teacher) one step each under `accelerate launch` with
  `recipes/accelerate/fsdp2.yaml`, one process per GPU, each process recording what ran: the distributed type,
  the FSDP version, whether every parameter of the trained model is a sharded DTensor, the steps, the losses and
  the ledger. Not in `--tiny` runs: on a CPU accelerate runs DDP instead of FSDP (`--fsdp2-only --tiny` runs the
  case anyway, and its `fsdp2_sharded` check fails, as it should).

It exits with status 1 when a check fails (the JSON says which), after writing the file. `--tiny` runs the same on
CPU at tiny sizes in float32, in seconds (tests/test_gpu_smoke.py runs it that way). On an H200 it should take a few
minutes (an estimate; the budget is 8).

    python bench/gpu_smoke.py OUT.json [--steps 3]          # one CUDA GPU
    python bench/gpu_smoke.py OUT.json --tiny              # CPU, tiny models
    python bench/gpu_smoke.py OUT.json --fsdp2-only        # only the FSDP2 case

On the project's device machine (see the `device` tool's README): it has torch, accelerate and peft, but not trl,
datasets or transformers 5.24. Carry them as wheels (about 20 MB), fetched here from the repository root for its
Python 3.12:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        trl==1.16.0 transformers==5.24.0 datasets==5.2.0 huggingface_hub==2.4.0 tokenizers==0.23.3 \\
        safetensors==0.8.0 dill==0.4.1 multiprocess==0.70.19 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    for w in .whl/*.whl; do unzip -p $w '*/METADATA' | grep ^Requires-Dist | grep -v extra; done

The rest of their requirements (click>=8.4.2, hf-xet>=1.6, pyarrow>=24, fsspec<=2026.9.0, regex>=2025.10.22,
accelerate>=1.10.1, pandas, psutil, xxhash, jinja2) were listed in the device image on 2026-11-17, versions unread:
the command below prints them first; carry a wheel for any that is too old. This package travels with the working
tree (`PYTHONPATH=$PWD`). Then one `run` call with `carry=[".whl"]` and `timeout_s=540`:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 || exit; \\
        python3 -m pip list 2>/dev/null | grep -iE "^(click|hf-xet|pyarrow|fsspec|regex|accelerate|torch) "; \\
        python3 bench/gpu_smoke.py $OUT/gpu_smoke.json

First run on an H200 on 2026-12-04 (BENCHMARKS.md, section 7): with transformers 5.24.0 (5.25.0 asks that machine for
the `kernels` package); the FSDP2 case failed there: the OPD teacher was left on the CPU (fixed since in
`prepare_teacher_model`; not yet rerun). `bench/gpu_check.py` (`bench/gpu_check.sh`) runs this check's launched
case beside timings and profiles.
"""

import argparse
import gc
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_opd import fixed_length_prompts
from common import CPU_ARGS, StepMeter, backbone, count_parameters, peak_memory_mb, say, start_peak_memory
from datasets import Dataset
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer
from transformers.trainer_callback import PrinterCallback
from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLensGRPOTrainer, StateLensSFTTrainer
from trl_statelens.lab import LabWorld, build_qwen3, build_tokenizer, format_plain

# Qwen3-0.6B and Qwen3-1.7B shapes (their config.json), and tiny ones for --tiny
SIZES = {
    "gpu": dict(
        student=dict(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, head_dim=128),
        teacher=dict(hidden=2048, layers=28, ffn=6144, heads=16, kv_heads=8, head_dim=128),
        vocab_size=151936,
        rollouts=16,  # per step: OPD and GRPO 4 prompts x 4 generations, DistillationTrainer 16 prompts x 1
        num_generations=4,
        completion_tokens=128,
        continuation_tokens=32,
        sft_max_length=256,
    ),
    "tiny": dict(
        student=dict(hidden=32, layers=2, ffn=64),
        teacher=dict(hidden=64, layers=2, ffn=128),
        vocab_size=None,  # the tokenizer's
        rollouts=4,
        num_generations=2,
        completion_tokens=8,
        continuation_tokens=4,
        sft_max_length=256,
    ),
}
OPD_ARMS = ("distill", "reverse_kl", "continuation", "divergence")
FSDP2_CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "fsdp2.yaml"
FSDP2_KINDS = ("sft", "grpo", "opd")
# Equal loss: exact up to float32 rounding on CPU; on a GPU, bf16 kernels may reorder sums between two processes' runs
LOSS_RTOL = {"gpu": 1e-3, "tiny": 1e-6}


def id_reward(completion_ids, **kwargs) -> list[float]:
    """A reward that varies between rollouts of a random-init model (whose text mostly decodes to nothing), so GRPO's
    advantages and gradient are not zero."""
    return [(sum(ids) % 97) / 97 for ids in completion_ids]


class SyncedStepMeter(StepMeter):
    """`StepMeter` that waits for the GPU's queued work before reading the clock at each step's end."""

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        super().on_step_end(args, state, control, **kwargs)


def measure(trainer, modules: dict, warmup_steps: int) -> dict:
    """Train; return logged metrics per step, step times and forwards per step (warm-up dropped), peak memory."""
    meter = SyncedStepMeter(modules)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(meter)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        memory_at_start = torch.cuda.memory_allocated()
    else:
        rss_at_start = start_peak_memory()
    trainer.train()
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        memory = {"peak_memory_mb": peak / 2**20, "train_memory_mb": (peak - memory_at_start) / 2**20}
    else:
        rss = peak_memory_mb(rss_at_start)
        memory = {"peak_memory_mb": rss["peak_rss_mb"], "train_memory_mb": rss["train_mem_mb"]}
    logs = [log for log in trainer.state.log_history if "loss" in log]
    keys = ("loss", "grad_norm", "entropy", "reward", "teacher_kl/sampled")
    return {
        "logs": [{key: log[key] for key in keys if key in log} for log in logs],
        "step_seconds": meter.step_seconds[warmup_steps:],
        "forwards_per_step": meter.forwards_per_step[warmup_steps:],
        **memory,
    }


def release(trainer) -> None:
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(stock: dict, lens: dict, keys, rtol: float) -> dict:
    """Stock vs StateLens, step by step: the largest relative difference of each logged metric, and forwards."""
    differences = {}
    for key in keys:
        pairs = [(a[key], b[key]) for a, b in zip(stock["logs"], lens["logs"], strict=True)]
        differences[key] = max(abs(a - b) / max(abs(a), 1e-12) if a != b else 0.0 for a, b in pairs)
    # Every rollout has the same length, so generation costs the same forwards in both arms
    extra = [
        lens_step["student"] - stock_step["student"]
        for stock_step, lens_step in zip(stock["forwards_per_step"], lens["forwards_per_step"], strict=True)
    ]
    return {
        "max_relative_difference": differences,
        "equal_loss": all(d <= rtol for d in differences.values()),
        "extra_forwards_per_step": extra,
    }


def fixed_length_prompt_dataset(tokenizer, world, size) -> Dataset:
    """Prompts of exactly the same token length (bench_opd's), enough for every step of the longest run."""
    prompts = fixed_length_prompts(tokenizer, world, n=256)
    if len(prompts) < 8 * size["rollouts"]:
        raise RuntimeError(f"only {len(prompts)} fixed-length prompts, {8 * size['rollouts']} needed")
    return Dataset.from_dict({"prompt": prompts})


def run_sft_and_grpo(mode, paths, tokenizer, world, common) -> dict:
    size = SIZES[mode]
    sft_rows = world.math("train", n=4 * size["rollouts"], seed=5)
    sft_data = Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in sft_rows]
    )
    prompts = fixed_length_prompt_dataset(tokenizer, world, size)
    results = {}
    for kind in ("sft", "grpo"):
        arms = {}
        for arm, trainer_cls in (
            (("stock", SFTTrainer), ("statelens", StateLensSFTTrainer))
            if kind == "sft"
            else (
                ("stock", GRPOTrainer),
                ("statelens", StateLensGRPOTrainer),
            )
        ):
            output_dir = tempfile.mkdtemp(prefix=f"gpu-smoke-{kind}-{arm}-")
            start = time.perf_counter()
            if kind == "sft":
                args = SFTConfig(
                    output_dir,
                    max_steps=1,
                    per_device_train_batch_size=size["rollouts"],
                    max_length=size["sft_max_length"],
                    **common,
                )
                trainer = trainer_cls(
                    model=paths["student"], args=args, train_dataset=sft_data, processing_class=tokenizer
                )
            else:
                args = GRPOConfig(
                    output_dir,
                    max_steps=1,
                    per_device_train_batch_size=size["rollouts"],
                    num_generations=size["num_generations"],
                    max_completion_length=size["completion_tokens"],
                    generation_kwargs={"min_new_tokens": size["completion_tokens"]},
                    **common,
                )
                trainer = trainer_cls(
                    model=paths["student"],
                    reward_funcs=id_reward,
                    args=args,
                    train_dataset=prompts,
                    processing_class=tokenizer,
                )
            arms[arm] = measure(trainer, {"student": backbone(trainer.model)}, warmup_steps=0)
            release(trainer)
            say(f"{kind} {arm}: {arms[arm]['logs']} ({time.perf_counter() - start:.0f}s)")
        keys = ("loss", "grad_norm", "entropy") + (("reward",) if kind == "grpo" else ())
        results[kind] = {**arms, **compare(arms["stock"], arms["statelens"], keys, LOSS_RTOL[mode])}
    return results


def run_opd(mode, paths, tokenizer, world, common, steps: int) -> dict:
    size = SIZES[mode]
    prompts = fixed_length_prompt_dataset(tokenizer, world, size)
    arms = {}
    for arm in OPD_ARMS:
        output_dir = tempfile.mkdtemp(prefix=f"gpu-smoke-opd-{arm}-")
        start = time.perf_counter()
        shared = dict(
            max_steps=1 + steps,
            per_device_train_batch_size=size["rollouts"],
            max_completion_length=size["completion_tokens"],
            temperature=1.0,
            generation_kwargs={"min_new_tokens": size["completion_tokens"]},
            teacher_model_init_kwargs={"dtype": common["model_init_kwargs"]["dtype"]},
            **common,
        )
        if arm == "distill":
            trainer = DistillationTrainer(
                model=paths["student"],
                teacher_model=paths["teacher"],
                args=DistillationConfig(output_dir, beta=1.0, **shared),
                train_dataset=prompts,
                processing_class=tokenizer,
            )
        else:
            args = OnPolicyDistillConfig(
                output_dir,
                signal=arm,
                num_generations=size["num_generations"],
                **({"continuation_length": size["continuation_tokens"]} if arm == "continuation" else {}),
                **shared,
            )
            trainer = OnPolicyDistillTrainer(
                model=paths["student"],
                teacher_model=paths["teacher"],
                args=args,
                train_dataset=prompts,
                processing_class=tokenizer,
            )
        teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
        run = measure(trainer, {"student": backbone(trainer.model), "teacher": backbone(teacher)}, warmup_steps=1)
        release(trainer)
        del teacher
        tokens = size["rollouts"] * size["completion_tokens"]
        run["median_step_seconds"] = statistics.median(run["step_seconds"])
        run["completion_tokens_per_second"] = tokens / run["median_step_seconds"]
        arms[arm] = run
        say(
            f"opd {arm}: median step {run['median_step_seconds']:.3f}s, {run['completion_tokens_per_second']:.0f} "
            f"tokens/s, peak {run['peak_memory_mb']:.0f} MB ({time.perf_counter() - start:.0f}s)"
        )
    stock = arms["distill"]
    arms["ratios_to_distill"] = {
        arm: {
            "step_time": arms[arm]["median_step_seconds"] / stock["median_step_seconds"],
            "tokens_per_second": arms[arm]["completion_tokens_per_second"] / stock["completion_tokens_per_second"],
            "peak_memory": arms[arm]["peak_memory_mb"] / stock["peak_memory_mb"],
        }
        for arm in OPD_ARMS[1:]
    }
    return arms


def launch_workers(mode, model_dir: str, config: Path, processes: int) -> dict:
    """`fsdp2_worker` launched with accelerate's `config` on `processes` processes: each rank's record, the exit
    status and, on a failure, the end of stderr and the frames of the project's code and TRL's in it."""
    ranks_dir = Path(tempfile.mkdtemp(prefix=f"gpu-smoke-{config.stem}-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
        "--num_processes", str(processes), "--main_process_port", str(port),
        __file__, str(ranks_dir), "--fsdp2-worker", model_dir, *(["--tiny"] if mode == "tiny" else []),
    ]  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])  # this checkout's trl_statelens, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    return {
        "processes": processes,
        "returncode": done.returncode,
        "stderr_tail": done.stderr[-3000:] if done.returncode else "",
        # the frames of the project's own code and TRL's in a failure, which the tail cuts off (2026-12-04's run)
        "stderr_frames": [line for line in done.stderr.splitlines() if "trl_statelens" in line or "/trl/" in line]
        if done.returncode
        else [],
        "ranks": [json.loads(path.read_text()) for path in sorted(ranks_dir.glob("rank*.json"))],
    }


def run_fsdp2(mode, model_dir: str) -> dict:
    """The FSDP2 case: launch `fsdp2_worker` on one process per GPU (2 on CPU) and check what each rank wrote."""
    processes = torch.cuda.device_count() if mode == "gpu" else 2
    start = time.perf_counter()
    launched = launch_workers(mode, model_dir, FSDP2_CONFIG, processes)
    checks = {"fsdp2_exit_ok": launched["returncode"] == 0, **fsdp2_checks(launched["ranks"], processes)}
    say(f"fsdp2: {checks} ({time.perf_counter() - start:.0f}s)")
    return {**launched, "checks": checks}


def fsdp2_checks(ranks: list[dict], processes: int) -> dict:
    """Every rank wrote its record; each trainer ran under FSDP2 with every parameter a sharded DTensor (a silent
    DDP or one-process fallback fails here); one step with finite losses; the main process wrote the ledger."""
    runs = [rank[kind] for rank in ranks for kind in FSDP2_KINDS]
    return {
        "fsdp2_all_ranks": len(ranks) == processes
        and [rank["process_index"] for rank in ranks] == [*range(processes)],
        "fsdp2_sharded": bool(runs)
        and all(
            (run["distributed_type"], run["fsdp_version"], run["num_processes"]) == ("FSDP", 2, processes)
            and run["dtensor_parameters"] == run["parameters"] > 0
            for run in runs
        ),
        "fsdp2_trained": bool(runs)
        and all(run["global_step"] == 1 and run["losses"] and all(map(math.isfinite, run["losses"])) for run in runs),
        "fsdp2_ledger": bool(ranks) and all(ranks[0][kind]["ledger_steps"] == [1] for kind in FSDP2_KINDS),
    }


def fsdp2_worker(ranks_dir: Path, model_dir: str, mode: str) -> None:
    """One process of the FSDP2 case: SFT, GRPO and OPD one step each; writes `rank<i>.json` with what ran."""
    size = SIZES[mode]
    paths = {name: f"{model_dir}/{name}" for name in ("student", "teacher")}
    tokenizer = AutoTokenizer.from_pretrained(paths["student"])
    rows = LabWorld(seed=0).math("train", n=32, seed=5)
    sft_data = Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows]
    )
    prompts = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
    # FSDP shards activations' checkpointing itself (fsdp_activation_checkpointing), not through the Trainer
    common = {**common_args(mode), "gradient_checkpointing": False}
    rollouts = dict(
        max_steps=1,
        per_device_train_batch_size=size["num_generations"],
        num_generations=size["num_generations"],
        max_completion_length=min(size["completion_tokens"], 16),
    )
    record = {}
    for kind in FSDP2_KINDS:
        output_dir = str(ranks_dir / kind)  # shared: the main process writes the ledger there
        if kind == "sft":
            args = SFTConfig(output_dir, max_steps=1, per_device_train_batch_size=4, max_length=128, **common)
            trainer = StateLensSFTTrainer(
                model=paths["student"], args=args, train_dataset=sft_data, processing_class=tokenizer
            )
        elif kind == "grpo":
            trainer = StateLensGRPOTrainer(
                model=paths["student"],
                reward_funcs=id_reward,
                args=GRPOConfig(output_dir, **rollouts, **common),
                train_dataset=prompts,
                processing_class=tokenizer,
            )
        else:
            args = OnPolicyDistillConfig(
                output_dir,
                teacher_model_init_kwargs={"dtype": common["model_init_kwargs"]["dtype"]},
                **rollouts,
                **common,
            )
            trainer = OnPolicyDistillTrainer(
                model=paths["student"],
                teacher_model=paths["teacher"],
                args=args,
                train_dataset=prompts,
                processing_class=tokenizer,
            )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        accelerator = trainer.accelerator
        parameters = list(trainer.model.parameters())
        ledger = Path(output_dir) / "statelens" / "steps.jsonl"
        record[kind] = {
            "distributed_type": accelerator.distributed_type.value,
            "fsdp_version": getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
            "num_processes": accelerator.num_processes,
            "model_class": type(trainer.model_wrapped).__name__,
            "parameters": len(parameters),
            "dtensor_parameters": sum(isinstance(p, DTensor) for p in parameters),
            "global_step": trainer.state.global_step,
            "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "ledger_steps": [json.loads(line)["step"] for line in ledger.read_text().splitlines()]
            if accelerator.is_main_process
            else None,
        }
        if kind == "opd":  # prepared as TRL's DistillationTrainer prepares its teacher
            teacher = list(trainer.teacher_model.parameters())
            record[kind]["teacher_class"] = type(trainer.teacher_model).__name__
            record[kind]["teacher_dtensor_parameters"] = sum(isinstance(p, DTensor) for p in teacher)
            record[kind]["teacher_device"] = str(teacher[0].device)
        record["process_index"] = accelerator.process_index
        say(f"fsdp2 rank {accelerator.process_index} {kind}: {record[kind]}")
        release(trainer)
    (ranks_dir / f"rank{record['process_index']}.json").write_text(json.dumps(record, indent=2))
    if torch.distributed.is_initialized():  # before exit: a gloo thread alive at shutdown can abort the process
        torch.distributed.destroy_process_group()


def common_args(mode) -> dict:
    """The CPU benchmarks' settings (no reporting, checkpoints or progress bars, seed 0); on a GPU, TRL's defaults of
    bf16 and gradient checkpointing, what a GPU user gets."""
    common = dict(CPU_ARGS, model_init_kwargs={"dtype": "bfloat16" if mode == "gpu" else "float32"})
    if mode == "gpu":
        common.update(use_cpu=False, bf16=True, gradient_checkpointing=True)
    return common


def build_models(mode, tokenizer, model_dir: str) -> dict:
    size, dtype = SIZES[mode], torch.bfloat16 if mode == "gpu" else torch.float32
    paths, setup = {}, {}
    for name, seed in (("student", 0), ("teacher", 1)):
        with torch.device("cuda" if mode == "gpu" else "cpu"):  # initialised on the GPU: seconds, not minutes
            model = build_qwen3(tokenizer, **size[name], vocab_size=size["vocab_size"], seed=seed).to(dtype)
        paths[name] = f"{model_dir}/{name}"
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        setup[f"{name}_parameters"] = count_parameters(model)
        setup[f"{name}_shape"] = size[name]
        del model
    setup["vocab_size"] = size["vocab_size"] or len(tokenizer)
    return paths, setup


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where to write the JSON results")
    parser.add_argument("--tiny", action="store_true", help="tiny float32 models on CPU (a quick end-to-end check)")
    parser.add_argument("--steps", type=int, default=None, help="measured OPD steps after one warm-up (3; 1 tiny)")
    parser.add_argument("--fsdp2-only", action="store_true", help="run the FSDP2 case only")
    parser.add_argument("--fsdp2-worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)  # one launched process
    options = parser.parse_args(argv)
    mode = "tiny" if options.tiny else "gpu"
    if options.fsdp2_worker:
        fsdp2_worker(options.out, options.fsdp2_worker, mode)
        return {"ok": True}
    if mode == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: this check needs one (or pass --tiny for the CPU version)")
    steps = options.steps or (1 if options.tiny else 3)
    started = time.perf_counter()
    if mode == "gpu":
        torch.set_num_threads(os.cpu_count())  # bench/common.py pins one thread for its CPU benchmarks

    common = common_args(mode)
    world = LabWorld(seed=0)
    tokenizer = build_tokenizer(world, vocab_size=1024, num_documents=2000)
    model_dir = tempfile.mkdtemp(prefix="gpu-smoke-models-")
    paths, setup = build_models(mode, tokenizer, model_dir)
    say(f"models built: {setup}")
    results, checks = {"setup": setup}, {}
    if not options.fsdp2_only:
        results.update(run_sft_and_grpo(mode, paths, tokenizer, world, common))
        results["opd"] = run_opd(mode, paths, tokenizer, world, common, steps)
        for kind in ("sft", "grpo"):
            checks[f"{kind}_equal_loss"] = results[kind]["equal_loss"]
            checks[f"{kind}_no_extra_forwards"] = all(extra == 0 for extra in results[kind]["extra_forwards_per_step"])
        checks["opd_finite_losses"] = all(
            math.isfinite(log["loss"]) for arm in OPD_ARMS for log in results["opd"][arm]["logs"]
        )
    if mode == "gpu" or options.fsdp2_only:
        results["fsdp2"] = run_fsdp2(mode, model_dir)
        checks.update(results["fsdp2"]["checks"])
    setup.update(
        mode=mode,
        device=torch.cuda.get_device_name() if mode == "gpu" else platform.processor() or "cpu",
        dtype="bfloat16" if mode == "gpu" else "float32",
        **{k: v for k, v in SIZES[mode].items() if k not in ("student", "teacher", "vocab_size")},
        opd_warmup_steps=1,
        opd_measured_steps=steps,
        torch=torch.__version__,
        transformers=sys.modules["transformers"].__version__,
        trl=sys.modules["trl"].__version__,
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    results["checks"] = checks
    results["ok"] = all(checks.values())
    results["wall_seconds"] = time.perf_counter() - started
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=2))
    say(f"checks {checks}; wrote {options.out} in {results['wall_seconds']:.0f}s")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
