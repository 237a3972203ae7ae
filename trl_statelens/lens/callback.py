"""`StateLoggingCallback`: per-step state metrics, an on-disk state ledger and probe drift, for any TRL trainer."""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from transformers import TrainerCallback

from .. import collective
from ..provenance import write_run_provenance
from .compute import FLOPS_PARTS, ComputeCounter, ledger_totals, tokens_seen, untrained_share
from .drift import PrefixFeatures, probe_drift
from .endings import ending_metrics
from .probes import DRIFT_REFERENCE_FILE, ProbeMixin
from .recorder import StateRecorderMixin
from .records import aggregate_states, has_spread, prefix_len_histogram

logger = logging.getLogger(__name__)

METRIC_PREFIX = "statelens/"
LEDGER_FILES = ("steps.jsonl", "states.jsonl", "drift.jsonl", "groups.jsonl")


class StateLoggingCallback(ProbeMixin, TrainerCallback):
    r"""Logs which states a trainer supervises, keeps a ledger of them on disk, and measures probe drift.

    At the end of every optimizer step:

    - with a StateLens trainer ([`StateLensSFTTrainer`], [`StateLensGRPOTrainer`] or any trainer using
      [`StateRecorderMixin`]), the step's state records are gathered from every rank and aggregated (`state_nll`,
      `state_entropy`, `offpolicy_gap`, `source_frac/*`, `prefix_len/*`, `weight/*`, and `teacher_nll` and
      `teacher_kl/supervised` (the sampled reverse KL on the supervised tokens the learner sampled) when a teacher
      scored the tokens; with several teachers `supervised_tokens/<name>` and
      `source_frac/teacher/<name>`), with the step's cost: `teacher_tokens` (the positions a teacher scored or
      wrote, all ranks: [`StateRecorderMixin._count_teacher_tokens`]) and `teacher_tokens_total` (so far) with a
      teacher, and the training FLOPs by part,
      `flops/{student_generation,student_training,teacher_scoring,teacher_writing}` and their sum `flops/total` for the
      step and `flops_total/*` so far (counted as `results.json`'s `compute`: [`~trl_statelens.lens.compute.ComputeCounter`];
      `None` in the ledger, and not logged, for a served teacher's parts, whose size is unknown), and, with GRPO's
      groups of rollouts, `reward_groups/spread_frac` (the share of the step's groups whose rewards differ: the
      others give all their tokens a zero advantage; `weight/nonzero_frac` is the share of supervised tokens with a
      non-zero one). The aggregates go
      into the trainer's metrics under the `statelens/` prefix, so they are logged (and reach `report_to` backends)
      with the trainer's own metrics;
    - every `probe_steps` steps, the current policy samples the probe prompts and the drift of its prefix states
      against step 0 is logged as `statelens/drift/{mmd,centroid,sliced_wasserstein,jaccard}`;
    - with a teacher in the trainer's process ([`probe_teacher_model`]: [`OnPolicyDistillTrainer`], TRL's
      `DistillationTrainer`; not a self teacher, ours or TRL's `SDFTTrainer`'s, which teaches from a privileged
      prompt the probe prompts lack), the same probe step also measures where the student still disagrees with it,
      whatever the training signal: the exact per-token reverse KL $\mathrm{KL}(p_S \| p_T)$ over the whole vocabulary at
      every completion position, averaged over the probe completion tokens, as `statelens/drift/teacher_kl/exact` on
      the student's current samples (its own states now), `teacher_kl/exact_fixed` on the step-0 samples (fixed
      states: a fall there is agreement, not a change of states), `teacher_kl/exact_number` /
      `teacher_kl/exact_other` on tokens whose
      text holds a digit / the rest, with `number_frac` (the share of number tokens) and `probe_tokens` (mean
      completion tokens per probe; rollouts getting shorter lower a summed KL without any agreement). `drift.jsonl`
      adds `teacher_kl/exact_by_prefix`: `[tokens, mean KL]` per prefix-length bin (the bins of `prefix_len_hist`);
    - at the same probe step, how far the policy has moved from the one it started from, on the completions
      $y_1, \dots, y_n$ that the starting policy $\pi_0$ sampled at step 0 (kept in `drift_reference.json`), scored
      with one forward pass of the current policy $\pi_\theta$ (shared with `teacher_kl/exact_fixed`), at the trainer's
      `temperature` (1 without one). With $N$ their tokens in all and $s_{i,t}$ the prompt and first $t - 1$ tokens of $y_i$:

      - `statelens/drift/base_kl`, the per-token forward KL from $\pi_0$ to $\pi_\theta$ on the probe prompts
        (which "RL's Razor", arXiv 2509.04259, finds to track forgetting), estimated on $\pi_0$'s samples:
        $$\mathrm{base\_kl} = \frac{1}{N} \sum_{i,t} \left[\log \pi_0(y_{i,t} \mid s_{i,t})
        - \log \pi_\theta(y_{i,t} \mid s_{i,t})\right].$$
        Its expectation is the per-token $\mathrm{KL}(\pi_0 \| \pi_\theta)$ over the states $\pi_0$ visits when
        the probes sample from $\pi_0$ at that temperature without truncation (a GRPO-like trainer's sampling with
        `top_p=1`, `top_k=0`); single tokens can be negative;
      - `statelens/drift/base_kl_topk`, the same states with the next token summed over instead of sampled: with
        $K_{i,t}$ the `base_kl_top_k` ids most likely under $\pi_0(\cdot \mid s_{i,t})$ and
        $p_{\mathrm{rest}} = 1 - \sum_{v \in K} \pi_0(v)$, $q_{\mathrm{rest}} = 1 - \sum_{v \in K} \pi_\theta(v)$
        at that state,
        $$\mathrm{base\_kl\_topk} = \frac{1}{N} \sum_{i,t} \left[\sum_{v \in K_{i,t}} \pi_0(v)
        \log \frac{\pi_0(v)}{\pi_\theta(v)} + p_{\mathrm{rest}} \log \frac{p_{\mathrm{rest}}}{q_{\mathrm{rest}}}
        \right],$$
        the exact KL between the two next-token distributions with the ids outside $K$ merged into one: never above
        the full-vocabulary KL, equal to it when `base_kl_top_k` covers the vocabulary (its error at the default
        on the lab is measured in BENCHMARKS.md).

      Step 0 stores what $\pi_0$ gives those completions (each token's log-prob, and per position the top-k ids,
      their log-probs and $p_{\mathrm{rest}}$), so no copy of $\pi_0$ is kept, and a resumed run or a stock trainer
      measures against the same $\pi_0$; both are exactly 0 for an unchanged policy.

    Attached to a stock TRL trainer (`SFTTrainer`, `GRPOTrainer`, `DistillationTrainer`, ...) it runs probe drift only
    and says so once in the log.

    The ledger, written by the main process under `<output_dir>/statelens/` and flushed every step:

    - `steps.jsonl`: one line per optimizer step with the aggregates and `prefix_len_hist` (supervised tokens per
      prefix-length bin `k`, covering prefix lengths `[2**k - 1, 2**(k+1) - 1)`);
    - `states.jsonl`: the sampled sequences (a `sample_rate` share of them), with prompt and completion text and
      per-token `prefix_len`, `logp`, `entropy`, `teacher_logp` and `weight`, plus `reward` when there is one;
    - `groups.jsonl` (GRPO): one line per prompt's group of rollouts generated in the step: `prompt_id` (a hash of
      the prompt), `rewards` (`None` for an unscorable rollout) and `solution_steps` when the data has that column
      (`trl_statelens.data.solution_steps`, a GSM8K problem's difficulty);
    - `drift.jsonl`: one line per probe step with the four drift distances, `base_kl`, `base_kl_topk` and the
      number of probe states;
    - `drift_reference.json`: the step-0 probe completions and what the step-0 policy gives their tokens
      (`base_policy`), so a resumed run measures drift and `base_kl` against the same reference;
    - `provenance.json`: what the run ran with, written at its start: the package's commit and uncommitted changes,
      the library versions and a hash of each model's weights ([`~trl_statelens.provenance.provenance`]); a resumed
      run appends its own record to `resumed`.

    A run resumed from a checkpoint drops the ledger lines after the checkpoint's step, so each step appears once.

    Args:
        trainer (`transformers.Trainer`, *optional*):
            Trainer to observe. StateLens trainers attach themselves; pass it when adding the callback to a stock
            trainer (`trainer.add_callback(StateLoggingCallback(trainer, probe_prompts=...))`).
        probe_prompts (`list[str]` or `list[list[dict]]`, *optional*):
            Fixed prompts for probe drift: plain strings, or conversations (lists of `{"role", "content"}` messages)
            formatted with the tokenizer's chat template. Without them there is no drift.
        probe_steps (`int`, *optional*, defaults to `50`):
            Measure drift every this many optimizer steps.
        sample_rate (`float`, *optional*, defaults to `0.05`):
            Share of the supervised sequences written with their text to `states.jsonl`.
        probe_max_new_tokens (`int`, *optional*):
            Tokens sampled per probe prompt. Defaults to the trainer's own generation length (`max_completion_length`
            of GRPO-like trainers), else 64.
        probe_seed (`int`, *optional*, defaults to `0`):
            Seed of the probe sampling. Probe sampling is seeded (and leaves the training RNG untouched), so the drift
            of an unchanged policy is exactly 0.
        base_kl_top_k (`int`, *optional*, defaults to `16`):
            Most likely ids of the step-0 policy kept per position for `base_kl_topk`. At 16 it was within 4% of
            the full-vocabulary KL on the lab, 8 within 7%, 4 within 17% (BENCHMARKS.md, 5.1); the reference holds
            `2 x base_kl_top_k + 2` numbers per probe completion token.
        max_flops (`float`, *optional*):
            Stop training after the first optimizer step at which the run's training FLOPs so far
            (`flops_total/total`, counted as `results.json`'s `compute`) reach this: a baseline run at the compute of
            another run, whatever its tokens per step; the main process's count decides, for every process (a
            resumed run's every process counts on from the totals the main process reads back from its ledger).
            `max_steps` still applies. Needs a StateLens trainer and a known total (not a served teacher, whose size
            this process cannot know).
    """

    def __init__(
        self,
        trainer=None,
        probe_prompts: list | None = None,
        probe_steps: int = 50,
        sample_rate: float = 0.05,
        probe_max_new_tokens: int | None = None,
        probe_seed: int = 0,
        base_kl_top_k: int = 16,
        max_flops: float | None = None,
    ):
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be a positive number of steps, got {probe_steps}")
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate is a share of sequences, between 0 and 1; got {sample_rate}")
        if base_kl_top_k < 1:
            raise ValueError(f"base_kl_top_k must be a positive number of token ids, got {base_kl_top_k}")
        if probe_prompts is not None and len(probe_prompts) == 0:
            raise ValueError("probe_prompts is empty: pass some prompts, or None to turn probe drift off")
        if max_flops is not None and not max_flops > 0:
            raise ValueError(f"max_flops is a number of training FLOPs (None for no limit), got {max_flops}")
        self.trainer = trainer
        self.probe_prompts = probe_prompts
        self.probe_steps = probe_steps
        self.sample_rate = sample_rate
        self.probe_max_new_tokens = probe_max_new_tokens
        self.probe_seed = probe_seed
        self.base_kl_top_k = base_kl_top_k
        self.max_flops = max_flops
        self._reference_features = None

    # ----- training events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "StateLoggingCallback needs the trainer: create it with StateLoggingCallback(trainer, ...) or use a "
                "StateLens trainer, which attaches it."
            )
        self.ledger_dir = Path(args.output_dir) / "statelens"
        self.records_states = isinstance(self.trainer, StateRecorderMixin)
        if self.records_states:
            self.trainer._start_state_recording()
            self._compute = ComputeCounter.of(self.trainer)
            self._totals = {}  # the ledger's per-step counts so far (`ledger_totals`)
        elif state.is_world_process_zero:
            logger.warning(
                "StateLoggingCallback on %s: per-step state records need a StateLens trainer (StateLensSFTTrainer, "
                "StateLensGRPOTrainer); this run logs probe drift only.",
                type(self.trainer).__name__,
            )
        if state.global_step == 0:
            self._check_no_ledger_on_every_rank(state)
        if state.is_world_process_zero:
            self._prepare_ledger(resumed_at=state.global_step)
            write_run_provenance(self.ledger_dir, self.trainer, step=state.global_step)  # code, versions, weights
            if self.records_states:  # a resumed run counts on from its ledger (the main process's, which logs)
                steps = self.ledger_dir / "steps.jsonl"
                if steps.exists():
                    self._totals = ledger_totals([json.loads(line) for line in steps.read_text().splitlines()])
        if self.records_states:
            # Every rank counts on from the main process's totals: a rank counting from none would reach `max_flops`
            # at another step than the others, and stop (or train on) alone
            self._totals = collective.from_main_process(self.trainer.accelerator, self._totals)
            # The last generation batch's rollout tokens and teacher reads, which the steps that train on it count
            # (a run starts, and resumes, at a batch's start)
            self._tokens_at_step, self._generation = tokens_seen(self.trainer), (0.0, 0.0)
            self._flops_so_far = self._flops()
        if self.max_flops is not None and (not self.records_states or self._flops_so_far["total"] is None):
            raise ValueError(
                f"max_flops needs the run's FLOPs total, which {type(self.trainer).__name__} does not give here: it "
                "needs a StateLens trainer and no served teacher (its size is unknown); stop the run with max_steps"
            )
        if self.probe_prompts is not None:
            self._check_probe_lengths()
            self._reference_texts, self._base_policy = self._load_or_make_reference(state)
            self._reference_features = PrefixFeatures(self._reference_texts)

    def on_step_end(self, args, state, control, **kwargs):
        if self.records_states:
            records = self.trainer._collect_state_records(self.sample_rate, seed=args.seed)
            metrics = aggregate_states(records, self.trainer.state_teacher_names)
            groups = self.trainer._collect_reward_groups()
            if groups:
                metrics["reward_groups/spread_frac"] = statistics.mean(has_spread(g["rewards"]) for g in groups)
            metrics.update(self.trainer._collect_rollout_endings())  # a collective: on every rank
            metrics.update(self.trainer._step_trace())  # before the accounting, which reads its counts
            metrics.update(self._accounting(metrics))
            self._log_metrics(metrics)
            # One decision, the main process's, on every rank: a rank that stopped alone would leave the others
            # waiting in the next step's collectives
            if self.max_flops is not None and collective.from_main_process(
                self.trainer.accelerator, metrics["flops_total/total"] >= self.max_flops
            ):
                control.should_training_stop = True
            if state.is_world_process_zero:
                line = {"step": state.global_step, "epoch": state.epoch, **metrics}
                line["prefix_len_hist"] = prefix_len_histogram(records)
                self._append("steps.jsonl", [line])
                self._append("states.jsonl", records.samples)
                self._append("groups.jsonl", [{"step": state.global_step, **group} for group in groups])
        if self.probe_prompts is not None and state.global_step % self.probe_steps == 0:
            completions = self._sample_probes()
            states = PrefixFeatures(completions)
            drift = probe_drift(self._reference_features, states)
            drift.update(ending_metrics(self._probe_end_kinds, completions, "ends_"))
            by_prefix = None
            if self._has_teacher():
                own, by_prefix = self._teacher_disagreement(completions)
                drift.update(own)
            drift.update(self._reference_divergences())
            self._log_metrics({f"drift/{name}": value for name, value in drift.items()})
            if state.is_world_process_zero:
                line = {"step": state.global_step, **drift, "num_states": states.num_states}
                if by_prefix is not None:
                    line["teacher_kl/exact_by_prefix"] = by_prefix
                self._append("drift.jsonl", [line])

    # ----- accounting ----------------------------------------------------------------------------------------
    def _flops(self, untrained: float = 0.0) -> dict[str, float | None]:
        """The run's training FLOPs so far by part (`runs.compute_counts`' count, from the same totals), less the
        training on the `untrained` share of the last generation batch (`ComputeCounter.split`)."""
        tokens, teacher_reads = self._generation
        return self._compute.of_ledger(
            tokens_seen(self.trainer), self._totals, untrained * tokens, untrained * teacher_reads
        )

    def _accounting(self, metrics: dict[str, float]) -> dict[str, float | None]:
        """`teacher_tokens_total`, and the step's (`flops/<part>`) and the run's (`flops_total/<part>`) training FLOPs
        by part: each step's is the run's so far less the run's at the step before, so the last step's totals are
        `results.json`'s when the run ends at a generation batch's end (teachers of several sizes are weighted by all
        the tokens each supervised so far). The training on a generation batch that spans steps counts at each step
        by its share of the batch's micro-batches."""
        self._totals = ledger_totals([self._totals, metrics])
        accounting = {}
        if "teacher_tokens" in metrics:
            accounting["teacher_tokens_total"] = self._totals["teacher_tokens"]
        tokens = tokens_seen(self.trainer)
        untrained, began = untrained_share(self.trainer)
        if began and tokens > self._tokens_at_step:  # this step sampled: its counts are its batches' (alike in size)
            sampled = tokens - self._tokens_at_step
            reads = sampled + metrics.get("teacher_context_tokens", 0.0) - metrics.get("teacher_skipped_tokens", 0.0)
            self._generation = (sampled / began, reads / began)
        self._tokens_at_step = tokens
        flops, before = self._flops(untrained), self._flops_so_far
        for part in (*FLOPS_PARTS, "total"):
            step = None if flops[part] is None or before[part] is None else flops[part] - before[part]
            accounting[f"flops/{part}"], accounting[f"flops_total/{part}"] = step, flops[part]
        self._flops_so_far = flops
        return accounting

    # ----- logging and ledger ----------------------------------------------------------------------------------
    def _log_metrics(self, metrics: dict[str, float | None]) -> None:
        """Queue metrics in the trainer's own metric store, which its next `log()` averages and reports (an unknown
        count, `None`, is left out)."""
        store = getattr(self.trainer, "_metrics", None)
        if store is None:
            return
        for name, value in metrics.items():
            # (a number: the ledger's strings, such as the teacher cache's `refreshed`, are not metrics)
            if value is not None and not isinstance(value, str) and math.isfinite(value):
                store["train"][METRIC_PREFIX + name].append(value)

    def _check_no_ledger_on_every_rank(self, state) -> None:
        """A fresh run refuses a folder holding another run's ledger (it would be lost). The main process, which owns
        the ledger, checks; every rank raises its verdict, so none is left waiting in a collective for the others."""
        refusal = None
        if state.is_world_process_zero:
            try:
                check_no_ledger(self.ledger_dir.parent)
            except ValueError as error:
                refusal = str(error)
        refusal = collective.from_main_process(self.trainer.accelerator, refusal)
        if refusal is not None:
            raise ValueError(refusal)

    def _prepare_ledger(self, resumed_at: int) -> None:
        """A fresh run starts an empty ledger (another run's was refused on every rank first); a resumed one keeps the
        lines up to the checkpoint's step, dropping a torn last line, which a run killed while writing leaves behind.
        """
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        if resumed_at == 0:
            (self.ledger_dir / DRIFT_REFERENCE_FILE).unlink(missing_ok=True)
        for name in LEDGER_FILES:
            path = self.ledger_dir / name
            if resumed_at == 0 or not path.exists():
                path.unlink(missing_ok=True)  # empty files only: check_no_ledger refused any other
                continue
            rows = [line for line in path.read_text().splitlines() if line]
            if rows and not _parses(rows[-1]):
                logger.warning("%s: dropping a torn last line (a run killed while writing it): %r", path, rows.pop())
            kept = [line for line in rows if json.loads(line)["step"] <= resumed_at]
            path.write_text("".join(line + "\n" for line in kept))

    def _append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        with open(self.ledger_dir / name, "a", encoding="utf-8") as f:  # closing flushes: the ledger survives a crash
            for row in rows:
                f.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")


def check_no_ledger(output_dir) -> None:
    """Refuse to start a fresh run in a folder whose state ledger already holds another run's steps.

    Called before any work starts (the recipes call it before evaluating); a resumed run is not checked.
    """
    ledger_dir = Path(output_dir) / "statelens"
    held = [name for name in LEDGER_FILES if (ledger_dir / name).exists() and (ledger_dir / name).stat().st_size]
    if held:
        raise ValueError(
            f"{ledger_dir} holds another run's state ledger ({', '.join(held)}): a fresh run would overwrite it. "
            "Continue that run with --resume_from_checkpoint (resume_from_checkpoint= in trainer.train()), or choose "
            "another output_dir, or delete the folder."
        )


def attach_state_logging(trainer, state_logging: bool = True) -> None:
    """Point every `StateLoggingCallback` of `trainer` without a trainer at it; add a default one if there is none.

    Args:
        trainer: the trainer whose callbacks to attach.
        state_logging: add a default `StateLoggingCallback` (records and ledger, no probes) when none was passed.
    """
    callbacks = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StateLoggingCallback)]
    for callback in callbacks:
        if callback.trainer is None:
            callback.trainer = trainer
    if not callbacks and state_logging:
        trainer.add_callback(StateLoggingCallback(trainer))


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _json_safe(value):
    """NaN and infinities become null, which strict JSON readers accept."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
