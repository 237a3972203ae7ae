"""Supervised fine-tuning with state records: the dataset's states, the dataset's tokens.

accelerate launch recipes/sft.py                                        # the lab (configs/lab/sft.yaml)
accelerate launch recipes/sft.py --config recipes/configs/study/mild_sft.yaml
accelerate launch recipes/sft.py --baseline stock                       # TRL's SFTTrainer, same run
"""

import sys
from dataclasses import dataclass

from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser, get_peft_config

from trl_statelens import StateLensSFTTrainer
from trl_statelens.guards import RunGuards, check_mode
from trl_statelens.preflight import check_preflight_settings
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
    """The arguments every recipe shares ([`RecipeArguments`]) and the StateLens trainer's own keywords, which are
    not `SFTConfig` fields (a `--baseline stock` run, TRL's SFTTrainer, runs neither).

    Args:
        guards: the run guards' mode: `"warn"`, `"stop"` or `"off"` (docs/guards.md).
        max_base_kl: the forgetting guard's budget on the probes' `base_kl` (nats per token against the starting
            model); `None`, the default, leaves that guard off.
        preflight: the preflight's mode: `"warn"`, `"strict"` or `"off"` (docs/preflight.md).
        preflight_prompts: training prompts the preflight samples.
    """

    guards: str = "warn"
    max_base_kl: float | None = None
    preflight: str = "warn"
    preflight_prompts: int = 16

    def __post_init__(self):
        super().__post_init__()
        check_mode(self.guards)
        check_preflight_settings(self.preflight, self.preflight_prompts)


def build_trainer(args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig):
    """The run's trainer and its student's path, as `main` trains it (`statelens preflight` builds it so too, and
    checks it without training)."""
    model_path = resolve_model(model_args.model_name_or_path, args.lab_seed)
    callback = state_logging_callback(args)
    trainer_class = SFTTrainer if args.baseline == "stock" else StateLensSFTTrainer
    keywords, callbacks = {}, [callback]  # the StateLens trainer's own
    if args.baseline != "stock":
        keywords = dict(guards=args.guards, preflight=args.preflight, preflight_prompts=args.preflight_prompts)
        if args.max_base_kl is not None:  # the trainer attaches no guards of its own beside these
            callbacks.append(RunGuards(args.guards, max_base_kl=args.max_base_kl))
    trainer = trainer_class(
        model=model_path,
        args=training_args,
        train_dataset=load_train_data(args, training_args.seed),
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
        **keywords,
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
