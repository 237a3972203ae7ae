"""On-policy distillation under DeepSpeed ZeRO-3 with the offline teacher cache (`teacher_cache_steps=3`), launched
by tests/test_teacher_cache.py with `accelerate launch --config_file recipes/accelerate/zero3.yaml`.

Usage: accelerate launch --config_file zero3.yaml --num_processes 2 opd_zero3_teacher_cache.py STUDENT TEACHER OUT

`reverse_kl` with a tiny staleness limit (a refresh every step after the first) and `divergence` with a huge one (by
age only, so two steps reuse the in-process teacher's cached hidden states). The ranks hold different rollouts, so
each rank's own staleness differs; the decision must not: every rank reads the staleness summed over both. Each rank
writes `OUT/rank<i>.json` with what ran, each step's decision, the staleness it compared (all ranks) and its own
rank's, and the teacher's forwards.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared CPU settings

import torch  # noqa: E402
from cpu_settings import CPU  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402
from trl_statelens.opd.cache import CACHE_SLOT, staleness_mask, staleness_terms  # noqa: E402
from trl_statelens.opd.rollouts import LEARNER  # noqa: E402

torch.set_num_threads(1)
student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = LabWorld(seed=0).math("train", n=16)
dataset = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
report = {}
for signal, max_staleness in (("reverse_kl", 1e-9), ("divergence", 1e9)):
    trainer = OnPolicyDistillTrainer(
        model=student_path,
        teacher_model=teacher_path,
        args=OnPolicyDistillConfig(
            preflight="off",  # the test counts training's own teacher calls
            output_dir=str(output_dir / signal),
            max_steps=4,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=6,
            learning_rate=1e-2,
            signal=signal,
            teacher_cache_steps=3,
            teacher_cache_max_staleness=max_staleness,
            **CPU,
        ),
        train_dataset=dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    cache, decisions = trainer.teacher_cache, []
    advance_or_refresh = cache.advance_or_refresh

    @torch.no_grad()
    def own_staleness(buffered, trainer=trainer):
        """This rank's staleness alone (its forwards are collective: both ranks make them, on the same steps)."""
        sums = torch.zeros(3)
        for inputs in buffered:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].size(1)
            )
            sums += staleness_terms(inputs[CACHE_SLOT].sampling_logps, logps, staleness_mask(inputs, LEARNER)).cpu()
        return (sums[0] / sums[2]).item()

    def recording(buffered, cache=cache, advance=advance_or_refresh, decisions=decisions, own=own_staleness):
        checks = cache.age is not None and buffered is not None and cache.age + 1 < cache.steps
        mine = own(buffered) if checks else None
        served = advance(buffered)
        decisions.append({"refreshed": cache.refreshed, "measured": cache.measured, "own": mine, "served": served})
        return served

    cache.advance_or_refresh = recording
    forwards = [0]
    decoder = trainer.accelerator.unwrap_model(trainer.teacher.model).get_decoder()
    decoder.register_forward_hook(lambda *args, forwards=forwards: forwards.__setitem__(0, forwards[0] + 1))
    trainer.train()
    plugin = trainer.accelerator.state.deepspeed_plugin
    report[signal] = {
        "world_size": trainer.accelerator.num_processes,
        "zero_stage": None if plugin is None else plugin.zero_stage,
        "teacher_engine": type(trainer.teacher.model).__name__,
        "global_step": trainer.state.global_step,
        "decisions": decisions,
        "teacher_forwards": forwards[0],
    }
(output_dir / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
trainer.accelerator.end_training()  # destroys the process group before exit (see tests/test_multiprocess.py)
