"""Shared pieces of the benchmarks: CPU settings, per-step timing and forward counts, and one forked child
per run (a fresh peak-memory reading without paying the ~8 s `import trl` again)."""

import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# One intra-op thread per run: the machine has 2 cores shared with other jobs, and one thread per process gives the
# steadiest timings there (two threads fight with the other load and swing more).
TORCH_THREADS = 1
torch.set_num_threads(TORCH_THREADS)
hf_logging.set_verbosity_error()
# transformers 5 renamed `gradient_checkpointing` to `activation_checkpointing`; TRL 1.16 still uses the old names, and
# the warning came once per forked run, about half of `make bench`'s output
warnings.filterwarnings("ignore", message=r".*gradient_checkpointing` is deprecated", category=FutureWarning)
hf_logging.disable_progress_bar()
datasets.disable_progress_bars()

RESULTS_DIR = Path(__file__).parent / "results"

# Every run's models and output folders go under one scratch folder, removed when the process that imported this
# module exits (a served-teacher run saves 140 MB of models; `make bench` used to leave them all in /tmp). Forked
# runs leave through `os._exit`, which skips this.
SCRATCH = tempfile.mkdtemp(prefix="statelens-bench-")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


def scratch_dir(prefix: str) -> str:
    """A new folder under `SCRATCH`."""
    return tempfile.mkdtemp(prefix=prefix, dir=SCRATCH)


# What every benchmark trainer shares (TRL's defaults of bf16 and gradient checkpointing are slow on CPU)
CPU_ARGS = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    logging_steps=1,
    save_strategy="no",
    dataloader_num_workers=0,
    disable_tqdm=True,
    seed=0,
    learning_rate=1e-4,
)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def count_saved_parameters(model_path) -> int:
    """Parameters of a saved single-file model, read from its safetensors header (no model in this process's memory:
    forked runs would inherit it and carry it in their peak RSS)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


# ----- per-step meter ---------------------------------------------------------------------------------------------
class StepMeter(TrainerCallback):
    """Wall time and forward calls of every optimizer step.

    A step's time runs from the previous step's end to this one's (the first step from its start), so it holds
    everything the step costs: data, generation, loss, optimizer, logging and every callback. Add the meter last
    (`trainer.add_callback`) so its `on_step_end` runs after all others, `StateLoggingCallback` included.
    `modules` maps a name to a module whose forward calls are counted with a pre-hook (use the backbone, which every
    loss path calls, fused head or not)."""

    def __init__(self, modules: dict):
        self.step_seconds, self.forwards_per_step = [], []
        self.calls = {name: 0 for name in modules}
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda *_, name=name: self.calls.__setitem__(name, self.calls[name] + 1))
        self._last_time, self._last_calls = None, dict(self.calls)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._last_time is None:
            self._last_time, self._last_calls = time.perf_counter(), dict(self.calls)

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self._last_time)
        self.forwards_per_step.append({name: self.calls[name] - self._last_calls[name] for name in self.calls})
        self._last_time, self._last_calls = now, dict(self.calls)


def backbone(model):
    """The decoder stack of a causal LM (through a PEFT wrapper if there is one)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.model


# ----- memory -------------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def start_peak_memory() -> int:
    """Reset this process's peak RSS (Linux `clear_refs`) and return the current RSS in kB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def peak_memory_mb(rss_at_start_kb: int) -> dict:
    """Peak RSS since `start_peak_memory`, whole process and above the RSS at the start (the training working set)."""
    peak = _status_kb("VmHWM")
    return {"peak_rss_mb": peak / 1024, "train_mem_mb": (peak - rss_at_start_kb) / 1024}


def train_and_measure(trainer, modules: dict, warmup_steps: int) -> dict:
    """Train with a `StepMeter`; return the per-step times and forward counts (warm-up dropped) and peak memory."""
    meter = StepMeter(modules)
    trainer.remove_callback(PrinterCallback)  # the per-step log lines would flood the table
    trainer.add_callback(meter)
    rss_at_start = start_peak_memory()
    trainer.train()
    return {
        "step_seconds": meter.step_seconds[warmup_steps:],
        "forwards_per_step": meter.forwards_per_step[warmup_steps:],
        **peak_memory_mb(rss_at_start),
    }


# ----- forked runs ------------------------------------------------------------------------------------------------
def timed(fn, seconds: list):
    """`fn`, appending each call's wall time in seconds to `seconds`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return wrapper


def keep_token_batches(trainer) -> list[dict]:
    """Make an on-policy `trainer` keep the token tensors of each generation batch it trains on (prompt and completion
    ids and masks), for a floor measured on the very same batches; returns the list it fills."""
    batches = []
    generate_and_score = trainer._generate_and_score_completions

    def keep_batch(inputs):
        output = generate_and_score(inputs)
        batches.append({k: output[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")})
        return output

    trainer._generate_and_score_completions = keep_batch
    return batches


def run_forked(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in a forked child; returns its JSON-able result. Each run starts from the parent's state
    (modules imported, nothing trained), so runs do not see each other's heap and the peak RSS is the run's own."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            payload = {"result": fn(*args, **kwargs)}
        except BaseException:
            payload = {"error": traceback.format_exc()}
        with os.fdopen(write_end, "w") as f:
            json.dump(payload, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    os.waitpid(pid, 0)
    payload = json.loads(text) if text else {"error": "the child died without a result"}
    if "error" in payload:
        raise RuntimeError(f"benchmark run failed in the child:\n{payload['error']}")
    return payload["result"]


# ----- summaries ------------------------------------------------------------------------------------------------------
def spread(values) -> dict:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def ratio_row(name: str, ratios, target: str = "") -> dict:
    return {"metric": name, **spread(ratios), "target": target}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'metric':<58} {'min':>9} {'median':>9} {'max':>9}  target")
    for row in rows:
        print(f"{row['metric']:<58} {row['min']:>9.3f} {row['median']:>9.3f} {row['max']:>9.3f}  {row['target']}")
    sys.stdout.flush()


def write_results(name: str, data: dict, directory: Path = RESULTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
