"""On-policy distillation: the student's own states, the teacher's signal.

accelerate launch recipes/opd.py                                        # the lab (configs/lab/opd.yaml)
accelerate launch recipes/opd.py --config recipes/configs/study/opd_from_stress_sft.yaml
accelerate launch recipes/opd.py --baseline stock                       # TRL's DistillationTrainer, same run
accelerate launch recipes/opd.py --teacher_model_server_url http://HOST:8000   # the teacher on a vLLM server
accelerate launch recipes/opd.py --teacher_model_server_url http://HOST:8000 --baseline stock  # TRL server trainer
accelerate launch recipes/opd.py --teacher_model_name_or_path math=lab-teacher,kb=http://HOST:8000  # two teachers
"""

import json
import sys
import warnings
from dataclasses import dataclass

from trl import DistillationTrainer, ModelConfig, TrlParser, get_peft_config

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, gsm8k_accuracy_reward
from trl_statelens.reports.runs import (
    LAB,
    LAB_TEACHER,
    RecipeArguments,
    load_train_data,
    resolve_model,
    run_recipe,
    state_logging_callback,
    with_default_config,
)
from trl_statelens.teachers import client_without_local_vllm, connect_served_teacher, load_teacher


@dataclass
class OPDScriptArguments(RecipeArguments):
    """teacher_model_name_or_path: the teacher: "lab-teacher" (the lab base model fine-tuned on lab math, built on
    first use), a saved model folder (for example an SFT recipe's output_dir) or a hub id. With
    `--teacher_model_server_url` the server runs the teacher: a folder or hub id given here is only read for its
    tokenizer (checked against the student's), and the lab names are not built.

    Several teachers: `name=teacher,name2=teacher2` or a JSON dict, each teacher a lab name, folder, hub id or vLLM
    server URL (`http://` or `https://`); each row goes to the teacher its dataset `teacher_id` column names, rows
    without one to the first."""

    teacher_model_name_or_path: str = "lab-teacher"


def named_teachers(value: str, lab_seed: int) -> dict[str, str] | None:
    """`name=teacher,...` or a JSON dict as name -> resolved path or server URL; `None` for a single teacher."""
    if value.startswith("{"):
        teachers = json.loads(value)
    elif "=" in value:
        teachers = dict(pair.split("=", 1) for pair in value.split(","))
    else:
        return None
    return {
        name.strip(): teacher if teacher.startswith(("http://", "https://")) else resolve_model(teacher, lab_seed)
        for name, teacher in teachers.items()
    }


def uses_reward(training_args: OnPolicyDistillConfig) -> bool:
    return bool(training_args.reward_weight) or training_args.skip_correct_rollouts


def stock_served_trainer(model_path, teacher_path, training_args, dataset, model_args, callback):
    """TRL's experimental `ServerDistillationTrainer` on the same data, server and settings: always on-policy, the
    generalised JSD with beta = jsd_beta on the teacher's top-k plus a tail (`to_server_distillation_config`)."""
    from trl.experimental.server_distillation import ServerDistillationTrainer

    stock_args = training_args.to_server_distillation_config()
    if stock_args.beta > 0:  # run what TRL offers for this beta (its only support) and say how it differs from ours
        warnings.warn(
            f"--baseline stock with a served teacher and jsd_beta={stock_args.beta}: TRL's ServerDistillationTrainer "
            "takes only loss_top_k=1 with beta > 0, so its loss is the divergence on the teacher's top-1 token, the "
            f"sampled token and a tail bucket, not on the teacher's top {training_args.teacher_top_k} tokens plus a "
            "tail as our `divergence`. With jsd_beta=0 both arms compute the same loss (top-k forward KL plus tail).",
            stacklevel=2,
        )
    with client_without_local_vllm():  # TRL's client refuses to start without vLLM, which HTTP requests do not use
        trainer = ServerDistillationTrainer(
            model=model_path,
            args=stock_args,
            train_dataset=dataset.select_columns(["prompt"]),
            peft_config=get_peft_config(model_args),
            callbacks=[callback],
        )
    # TRL's trainer checks the server at its first step at the earliest (and never the vocabulary): check it as our
    # served arm does, before the recipe's evaluation and any training work
    connect_served_teacher(
        stock_args.teacher_model_server_url,
        trainer.model,
        trainer.processing_class,
        teacher_path,
        training_args,
        stock_args.loss_top_k,
    )
    return trainer


def build_trainer(
    args: OPDScriptArguments, training_args: OnPolicyDistillConfig, model_args: ModelConfig, dataset=None
):
    """The run's trainer, its student's path and its teacher, as `main` trains it (`statelens preflight` builds it so
    too, and checks it without training)."""
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    teachers = named_teachers(args.teacher_model_name_or_path, args.lab_seed)
    if teachers is not None:
        if args.baseline == "stock":
            raise ValueError(
                "--baseline stock runs TRL's DistillationTrainer (one in-process teacher) or, with "
                "--teacher_model_server_url, its ServerDistillationTrainer (one served teacher): several teachers have "
                "no stock counterpart here (README, 'Compare with stock TRL'). Give one teacher"
            )
        teacher_path = args.teacher_model_name_or_path  # recorded in results.json
    elif training_args.teacher_model_server_url is None:
        teacher_path = resolve_model(args.teacher_model_name_or_path, args.lab_seed)
    elif args.teacher_model_name_or_path in (LAB, LAB_TEACHER):  # served: the lab has the student's tokenizer anyway
        teacher_path = None
    else:  # served: not loaded here, only read for its tokenizer (a real model's short name is resolved first)
        teacher_path = resolve_model(args.teacher_model_name_or_path, args.lab_seed)
    if dataset is None:
        dataset = load_train_data(args, training_args.seed)
    callback = state_logging_callback(args)
    if args.baseline == "stock" and training_args.teacher_model_server_url is not None:
        trainer = stock_served_trainer(model_path, teacher_path, training_args, dataset, model_args, callback)
    elif args.baseline == "stock":  # always on-policy, full-vocabulary JSD with beta = jsd_beta
        stock_args = training_args.to_distillation_config()
        stock_args.teacher_model_init_kwargs = (
            None  # used by load_teacher: the same teacher as our arm (LoRA folders too)
        )
        trainer = DistillationTrainer(
            model=model_path,
            teacher_model=load_teacher(teacher_path, training_args),
            args=stock_args,
            train_dataset=dataset.select_columns(["prompt"]),
            peft_config=get_peft_config(model_args),
            callbacks=[callback],
        )
    else:
        trainer = OnPolicyDistillTrainer(
            model=model_path,
            teacher_model=teachers if teachers is not None else teacher_path,
            args=training_args,
            train_dataset=dataset,
            # the exact-final-answer reward, as recipes/grpo.py's, only where an option reads it
            reward_funcs=gsm8k_accuracy_reward if uses_reward(training_args) else None,
            peft_config=get_peft_config(model_args),
            callbacks=[callback],
        )
    callback.trainer = trainer
    return trainer, model_path, teacher_path


def main(args: OPDScriptArguments, training_args: OnPolicyDistillConfig, model_args: ModelConfig, dataset=None):
    """One run; `dataset`: the training rows, when not `--dataset_name`'s (recipes/studies/two_teachers.py's mixed prompts)."""
    trainer, model_path, teacher_path = build_trainer(args, training_args, model_args, dataset)
    run_recipe("opd", trainer, args, model_path, training_args.teacher_model_server_url or teacher_path)


def parse_arguments(argv: list[str]):
    """The run's arguments: its config file (the lab's without `--config`), then the flags that override it."""
    parser = TrlParser((OPDScriptArguments, OnPolicyDistillConfig, ModelConfig))
    return parser.parse_args_and_config(args=with_default_config(__file__, argv))


if __name__ == "__main__":
    main(*parse_arguments(sys.argv[1:]))
