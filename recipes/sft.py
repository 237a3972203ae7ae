"""Supervised fine-tuning with state records: the dataset's states, the dataset's tokens.

accelerate launch recipes/sft.py                                        # the lab (configs/lab/sft.yaml)
accelerate launch recipes/sft.py --config recipes/configs/study/mild_sft.yaml
accelerate launch recipes/sft.py --baseline stock                       # TRL's SFTTrainer, same run
"""

import sys
from dataclasses import dataclass

from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser, get_peft_config

from trl_statelens import StateLensSFTTrainer
from trl_statelens.reports.runs import (
    RecipeArguments,
    load_train_data,
    resolve_model,
    run_recipe,
    state_logging_callback,
    with_default_config,
)


@dataclass
class SFTScriptArguments(RecipeArguments):
    pass


def build_trainer(args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig):
    """The run's trainer and its student's path, as `main` trains it (`statelens preflight` builds it so too, and
    checks it without training)."""
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    callback = state_logging_callback(args)
    trainer_class = SFTTrainer if args.baseline == "stock" else StateLensSFTTrainer
    trainer = trainer_class(
        model=model_path,
        args=training_args,
        train_dataset=load_train_data(args, training_args.seed),
        peft_config=get_peft_config(model_args),
        callbacks=[callback],
    )
    callback.trainer = trainer  # a stock trainer does not attach it itself
    return trainer, model_path


def main(args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig):
    trainer, model_path = build_trainer(args, training_args, model_args)
    run_recipe("sft", trainer, args, model_path)


def parse_arguments(argv: list[str]):
    """The run's arguments: its config file (the lab's without `--config`), then the flags that override it."""
    parser = TrlParser((SFTScriptArguments, SFTConfig, ModelConfig))
    return parser.parse_args_and_config(args=with_default_config(__file__, argv))


if __name__ == "__main__":
    main(*parse_arguments(sys.argv[1:]))
