"""Session-scoped lab fixtures, built in seconds. Every test runs offline."""

import atexit
import os
import shutil
import tempfile

from cpu_settings import WORKER_THREADS

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["WANDB_DISABLED"] = "true"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["TQDM_DISABLE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))  # read by torch below and by every subprocess
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="statelens-tests-trackio-")  # read when trackio is imported
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_statelens.lab import LabWorld, build_model, build_tokenizer, format_plain  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread per process beats two fighting over 2 cores

# `make test` hands whole files to its workers in collection order (`--dist loadfile --no-loadscope-reorder`): the
# files that take minutes go first, longest first (durations from a clean-clone run), so that no worker is left
# running a study's smoke chain alone at the end. The rest keep pytest's order.
SLOWEST_FILES_FIRST = (
    "test_real_model.py",
    "test_multiprocess.py",
    "test_recipes.py",
    "test_fsdp2.py",
    "test_study_lab.py",
    "test_resume.py",
    "test_served_teacher.py",
    "test_self_distill_study.py",
    "test_two_teachers.py",
    "test_forgetting_study.py",
    "test_bench_teachers.py",
    "test_lab.py",
    "test_gpu_smoke.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


@pytest.fixture(scope="session")
def world():
    return LabWorld(seed=0)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, world):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(world, num_documents=2000).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    return AutoTokenizer.from_pretrained(tokenizer_path)


def _save_model(tmp_path_factory, tokenizer, name, seed):
    path = tmp_path_factory.mktemp(name)
    build_model("test", tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def student_path(tmp_path_factory, tokenizer):
    """A `test`-size Qwen3 (random weights) saved like a hub checkpoint: pass the path to any trainer."""
    return _save_model(tmp_path_factory, tokenizer, "student", seed=0)


@pytest.fixture(scope="session")
def teacher_path(tmp_path_factory, tokenizer):
    """Another `test`-size Qwen3 with the student's vocabulary and different weights."""
    return _save_model(tmp_path_factory, tokenizer, "teacher", seed=1)


@pytest.fixture(scope="session")
def other_teacher_path(tmp_path_factory, world):
    """A `test`-size model with a second lab tokenizer: other merges (700 tokens) and digit runs kept whole (a teacher
    of another tokenizer: `tests/test_cross_tokenizer_*.py`)."""
    tokenizer = build_tokenizer(world, vocab_size=700, num_documents=500, individual_digits=False)
    path = tmp_path_factory.mktemp("other_teacher")
    build_model("test", tokenizer, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def math_dataset(world):
    """64 GSM8K-format training rows in TRL's prompt-completion layout (plain format, as in the study)."""
    rows = world.math("train", n=64)
    return Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["answer"], **r} for r in rows]
    )


# ----- models with preferences of their own ------------------------------------------------------------------
def _train_on_math(model, tokenizer, world, path, steps: int, problems_seed: int):
    """Plain teacher forcing on lab math text, 8 problems a step, then `save_pretrained` to `path`."""
    texts = [
        format_plain(r["question"], r["answer"]) + tokenizer.eos_token
        for r in world.math("train", n=8 * steps, seed=problems_seed)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    torch.manual_seed(0)
    for step in range(steps):
        batch = tokenizer(texts[step * 8 : step * 8 + 8], return_tensors="pt", padding=True, padding_side="right")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def math_trained_path(tmp_path_factory, tokenizer, world):
    """A `test`-size Qwen3 trained briefly on math text only, so it has preferences of its own (a random-init model
    predicts near-uniformly, which hides off-policy gaps). A few seconds of plain teacher forcing."""
    model = build_model("test", tokenizer, seed=0)
    return _train_on_math(model, tokenizer, world, tmp_path_factory.mktemp("math_trained"), 40, problems_seed=1)


@pytest.fixture(scope="session")
def math_teacher_path(tmp_path_factory, tokenizer, world, math_trained_path):
    """`math_trained_path` trained 60 steps further on other math problems: a teacher a step ahead of that
    student, so on-policy distillation between the two has something to teach at the student's own states."""
    model = AutoModelForCausalLM.from_pretrained(math_trained_path)
    return _train_on_math(model, tokenizer, world, tmp_path_factory.mktemp("math_teacher"), 60, problems_seed=3)


@pytest.fixture(scope="session")
def kb_dataset(world):
    """Knowledge-base questions in the plain prompt-completion layout: another task than math."""
    rows = world.kb("test")[:64]
    return Dataset.from_list(
        [{"prompt": format_plain(r["question"]), "completion": " " + r["choices"][r["answer"]]} for r in rows]
    )


@pytest.fixture(scope="session")
def tensorboard_opd_run(tmp_path_factory, math_trained_path, math_teacher_path, math_dataset, world):
    """A real 4-step `OnPolicyDistillTrainer` run (learner and dataset states, a teacher, a reward) that reports to
    tensorboard (and to trackio, offline, when it is installed) and keeps every sequence in its ledger. Returns the
    run folder (tensorboard events under `runs/`) and the log history."""
    import importlib.util

    from cpu_settings import CPU

    from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
    from trl_statelens.evaluation.rewards import gsm8k_accuracy_reward

    out = tmp_path_factory.mktemp("tensorboard_opd")
    report_to = ["tensorboard"]
    if importlib.util.find_spec("trackio") is not None:
        report_to.append("trackio")  # offline: a local database under $TRACKIO_DIR (set above)
    args = OnPolicyDistillConfig(
        **{**CPU, "report_to": report_to, "logging_steps": 1},
        project="statelens-tests",
        run_name=out.name,
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=16,
        learning_rate=1e-3,
        state_source_mix={"learner": 0.6, "dataset": 0.4},
    )
    probes = [format_plain(row["question"]) for row in world.math("dev", n=2)]
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=args,
        train_dataset=math_dataset,
        reward_funcs=[gsm8k_accuracy_reward],
        callbacks=[StateLoggingCallback(probe_prompts=probes, probe_steps=2, sample_rate=1.0)],
    )
    trainer.train()
    return out, trainer.state.log_history
