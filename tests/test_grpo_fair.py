"""The pre-registered rule of recipes/studies/grpo_fair.py (issue 46, STUDY.md), on dev curves written by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "studies"))
import grpo_fair  # noqa: E402

STEPS = [25, 50, 75, 100]


def curve(start, greedy, flops_per_step, start_flops=0.0):
    return {"start": start, "start_sampled": None, "start_flops": start_flops, "steps": STEPS, "greedy": greedy,
            "sampled": [None] * len(STEPS), "flops": [flops_per_step * s for s in STEPS]}  # fmt: skip


def test_when_nothing_moves_the_rule_names_the_highest_smoothed_score_not_the_cheapest():
    # The 2026-12-03 rule ran the cheapest arm within 0.03 of the best when nothing moved; this one runs the best.
    result = grpo_fair.choose_fair(
        {
            "cold": curve(0.28, [0.26, 0.27, 0.28, 0.29], 1e10),  # smoothed best (0.28+0.29)/2 = 0.285 < 0.31
            # smoothed 0.33 / 0.333 / 0.33 / 0.32: best at 50 (< 0.36); the old rule took the cheaper 25 (within 0.03)
            "warm": curve(0.33, [0.31, 0.35, 0.34, 0.30], 1e10, start_flops=5e11),
        }
    )
    assert not result["moves"]
    assert (result["chosen"]["candidate"], result["chosen"]["step"]) == ("warm", 50)
    assert result["best"] == pytest.approx((0.31 + 0.35 + 0.34) / 3)


def test_a_move_is_judged_against_the_candidates_own_start_and_the_cheapest_within_the_tolerance_is_chosen():
    result = grpo_fair.choose_fair(
        {
            # from the base: 0.28 -> smoothed 0.34 at 75, a move; the highest score of all, but not over its start
            "cold": curve(0.28, [0.27, 0.31, 0.34, 0.35], 1e10),
            # warm: a higher score everywhere, but from a start of 0.35 it never moves by 0.03
            "warm": curve(0.35, [0.36, 0.36, 0.37, 0.37], 1e10, start_flops=5e11),
        }
    )
    assert result["moves"] and result["starts"]["cold"]["moves"] and not result["starts"]["warm"]["moves"]
    assert result["best"] == pytest.approx((0.34 + 0.35) / 2)  # the step-0 start is never in the smoothing
    # within 0.03 of 0.345: smoothed 0.307 at 50 (fails), (0.31+0.34+0.35)/3 = 0.333 at 75: the fewest FLOPs
    assert (result["chosen"]["candidate"], result["chosen"]["step"]) == ("cold", 75)
    warm_rows = [r for r in result["rows"] if r["candidate"] == "warm"]
    assert warm_rows[0]["flops"] == pytest.approx(5e11 + 25e10)  # the warm start's own training counted


def run_curve(steps, flops, correct_by_step):
    """One seed's training-time curve: per evaluated step, which of the problems q0..q3 it got right."""
    items = [{f"q{i}": float(c) for i, c in enumerate(correct)} for correct in correct_by_step]
    return {"steps": steps, "flops": flops, "items": items, "problems": sorted(items[0])}


def test_opd_to_grpo_ratio_reads_the_seed_mean_smoothed_curves():
    # GRPO: seed means 0.25, 0.50, 0.75 (smoothed 0.375, 0.5, 0.625): best 0.625 at step 75, 3e12 FLOPs
    grpo = [run_curve([25, 50, 75], [1e12, 2e12, 3e12], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])] * 2
    # OPD: seed means 0.5, 0.75, 0.75 (smoothed 0.625, 0.667, 0.75): reaches 0.625 at its first point, 5e11
    opd = [run_curve([15, 30, 45], [5e11, 1e12, 1.5e12], [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]),
           run_curve([15, 30, 45], [5e11, 1e12, 1.5e12], [[0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]])]  # fmt: skip
    result = grpo_fair.opd_to_grpo_ratio({"grpo": grpo, "opd_from_mild_sft": opd}, range(4))
    assert result["grpo_best"] == pytest.approx(0.625) and result["grpo_step"] == 75
    assert (result["opd_step"], result["opd_flops"]) == (15, 5e11)
    assert result["ratio"] == pytest.approx(3e12 / 5e11)
    # on a resample of the problems GRPO never gets right, OPD's curve is judged against GRPO's best there
    never = grpo_fair.opd_to_grpo_ratio({"grpo": grpo, "opd_from_mild_sft": opd[:1]}, [3, 3])
    assert never["grpo_best"] == 0.0 and never["opd_step"] == 15
    below = grpo_fair.opd_to_grpo_ratio({"grpo": grpo, "opd_from_mild_sft": opd[1:]}, [0])
    assert below["grpo_best"] == 1.0 and below["ratio"] is None and below["opd_flops"] is None  # never reached
