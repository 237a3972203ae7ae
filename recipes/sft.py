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


def main(args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig):
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
    run_recipe("sft", trainer, args, model_path)


if __name__ == "__main__":
    parser = TrlParser((SFTScriptArguments, SFTConfig, ModelConfig))
    main(*parser.parse_args_and_config(args=with_default_config(__file__, sys.argv[1:])))
