"""report.py's summary numbers from metrics rows: first step at which the 5-step mean reaches a
level, the per-staleness table, idle share and token counts, and the offline --from-dir round trip."""
import json

import report


def _rows():
    rewards = [0.2, 0.4, 0.6, 0.7, 0.9, 0.9, 1.0, 0.8]  # 5-step means: 0.56, 0.70, 0.82 (step 7), ...
    rows = []
    for i, r in enumerate(rewards, 1):
        rows.append({"step": i, "version": i, "wall_s": 10.0 * i, "reward/mean": r, "perf/rollout_wait_s": 2.0,
                     "perf/step_s": 10.0, "rollout/backpressure_s": 0.0, "sample/staleness_mean": 1.0,
                     "sample/staleness_max": 2, "tokens": 100, "tokens/leased": 120, "mem/peak_rss_mb": 1.0,
                     "stale/1/groups": 6, "stale/1/reward": r, "stale/1/tokens": 100, "stale/1/ratio_dev_mean": 0.1,
                     "stale/1/ratio_dev_max": 0.2 * i, "stale/1/clip_frac": 0.05,
                     "stale/2/groups": 2, "stale/2/reward": 0.0, "stale/2/tokens": 0})
    rows[0]["stale/1/clip_frac"] = 0.45  # weighted by tokens with the others: (0.45 + 7 * 0.05) / 8
    return rows


def test_first_reaching_and_staleness_table():
    train = _rows()
    assert report.first_reaching(train, 0.8) == {"step": 7, "wall_s": 70.0}
    assert report.first_reaching(train, 0.99) is None
    s = report.summarize(train, {"w1": [{"version": 0, "rollout/reward_mean": 0.25, "rollout/samples": 64,
                                         "rollout/gen_s": 2.0, "rollout/tokens_per_s": 500.0, "mem/peak_rss_mb": 2.0}]}, [])
    assert s["first_reaches_0.8"] == {"step": 7, "wall_s": 70.0}
    assert s["steps_per_min"] == 6.0 and s["trainer_idle_frac"] == 0.2
    assert (s["tokens_generated"], s["tokens_leased"], s["tokens_trained"]) == (1000, 960, 800)
    one, two = s["by_staleness"][1], s["by_staleness"][2]
    assert one["groups"] == 48 and one["reward"] == round(sum(r["reward/mean"] for r in train) / 8, 3)
    assert one["ratio_dev_mean"] == 0.1 and one["ratio_dev_max"] == 1.6 and one["clip_frac"] == 0.1
    assert two == {"groups": 16, "reward": 0.0, "tokens": 0, "ratio_dev_mean": None, "ratio_dev_max": None,
                   "clip_frac": None}
    assert report.headline(s) == "5-step mean reward first reaches 0.8 at step 7, 70 s into training"


def test_first_version_reaching_reads_the_policy_not_the_step():
    """The reward of the rounds each version generated (versions without rounds skipped), and when the trainer
    published it: version 6's rounds and the four before it with rounds reach 0.8; the base model is at 0 s."""
    train = _rows()
    per_version = {0: 0.2, 1: 0.5, 2: 0.8, 4: 0.9, 5: 0.9, 6: 0.95, 7: 1.0}  # 5-version means: 0.66 (v5), 0.81 (v6)
    assert report.first_version_reaching(per_version, train, 0.8) == {"version": 6, "wall_s": 60.0}
    assert report.first_version_reaching({0: 0.9, 1: 0.9, 2: 0.9, 3: 0.9, 4: 0.9}, train, 0.8) == {"version": 4, "wall_s": 40.0}
    assert report.first_version_reaching({0: 0.9, 1: 0.9, 2: 0.9, 3: 0.9}, train, 0.8) is None  # fewer than five
    assert report.first_version_reaching({v: 0.9 for v in range(5, 10)}, train, 0.8) == {"version": 9, "wall_s": None}


def test_from_dir_round_trip(tmp_path, capsys):
    train = _rows()
    for r in train:  # tokens a worker sampled after a mid-round swap: staleness 0 has tokens but no group (no reward)
        r.update({"stale/0/groups": 0, "stale/0/tokens": 10, "stale/0/ratio_dev_mean": 0.0, "stale/0/ratio_dev_max": 0.0,
                  "stale/0/clip_frac": 0.0})
    report.save_dir(str(tmp_path), train, {"w1": []}, [])
    report.main(report.Args(from_dir=str(tmp_path)))
    out = capsys.readouterr().out
    assert "first reaches 0.8 at step 7, 70 s" in out and (tmp_path / "reward_curve.png").stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["by_staleness"]["0"] == {
        "groups": 0, "reward": None, "tokens": 80, "ratio_dev_mean": 0.0, "ratio_dev_max": 0.0, "clip_frac": 0.0}


def test_an_environments_success_rate_and_tool_call_share_first_and_last_five_steps(tmp_path):
    """A tool-using environment's run: the summary gives the success rate and the share of episodes that called
    the tool, means of the first and last five steps, and the plot draws the tool-call share."""
    train = _rows() + _rows()
    for i, r in enumerate(train):
        r.update({"step": i + 1, "reward/correct": 0.1 if i < 5 else 0.9, "reward/diag_tool_call": 0.2 if i < 5 else 0.8,
                  "reward/diag_turns": 1.5})
    s = report.summarize(train, {}, [])
    assert s["success_first5_last5"] == [0.1, 0.9] and s["tool_call_share_first5_last5"] == [0.2, 0.8]
    assert s["turns_first5_last5"] == [1.5, 1.5]
    plain = report.summarize(_rows(), {}, [])
    assert "tool_call_share_first5_last5" not in plain and "success_first5_last5" not in plain
    report.plot(train, {}, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 0


def _untrained(cut: float | None) -> tuple[list[dict], dict]:
    """Five steps in which every group had equal rewards (0), and a worker's rounds cut at the limit `cut` of the time."""
    train = [{**r, "reward/mean": 0.0, "tokens": 0, "groups/trained": 0, "groups/zero_std_frac": 1.0} for r in _rows()[:5]]
    rounds = [{"version": v, "rollout/reward_mean": 0.0, "rollout/samples": 64, "rollout/gen_s": 2.0,
               "rollout/tokens_per_s": 500.0, "mem/peak_rss_mb": 2.0,
               **({} if cut is None else {"rollout/finish_length": cut if v else 1.0})} for v in range(4)]
    return train, {"w1": rounds}


def test_a_run_that_trained_no_group_says_so_and_why(tmp_path, capsys):
    """Every group's rewards equal, nothing trained: the summary's last line says so, and names the share of
    answers cut at the token limit (weighted by the rounds' samples: one round of 4 cut every answer)."""
    train, rollouts = _untrained(0.85)
    s = report.summarize(train, rollouts, [])
    assert (s["groups_trained"], s["groups_equal_rewards_share"], s["answers_cut_share"]) == (0, 1.0, 0.888)
    want = ("nothing was trained: every group had equal rewards (mean reward 0.0) in 5 steps; e.g. answers cut at "
            "the token limit in 89% of episodes (raise --max-new-tokens)")
    assert report.headline(s) == want
    report.save_dir(str(tmp_path), train, rollouts, [])
    report.main(report.Args(from_dir=str(tmp_path)))
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == want
    s = report.summarize(*_untrained(None), [])  # rounds that do not say how they finished
    assert report.headline(s).endswith("in 5 steps; the task may be out of the model's reach, or its answers not in "
                                       "the form the task scores")


def test_a_run_that_trained_groups_has_its_usual_headline():
    train = [{**r, "groups/trained": 3, "groups/zero_std_frac": 0.5} for r in _rows()]
    s = report.summarize(train, {}, [])
    assert (s["groups_trained"], s["groups_equal_rewards_share"], s["answers_cut_share"]) == (24, 0.5, None)
    assert report.headline(s) == "5-step mean reward first reaches 0.8 at step 7, 70 s into training"


def test_rewards_outside_the_unit_range_are_told_in_their_own_terms(tmp_path, capsys):
    """An environment whose rewards are 42 does not 'reach 0.8': the summary gives its rewards' range and the
    first and last five steps' means, and no level unless --level names one."""
    train = [{**r, "reward/mean": 30.0 + 2 * i, "groups/trained": 4} for i, r in enumerate(_rows())]  # 30 .. 44
    s = report.summarize(train, {}, [])
    assert s["reward_level"] is None and s["reward_range"] == [30.0, 44.0]
    assert not any(k.startswith("first_reaches") for k in s)
    want = ("rewards outside [0, 1.1] (step means 30.0 to 44.0): mean reward 34.0 over the first 5 steps, 40.0 over "
            "the last 5, in 8 steps (80.0 s)")
    assert report.headline(s) == want
    report.save_dir(str(tmp_path), train, {}, [])
    report.main(report.Args(from_dir=str(tmp_path)))
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == want
    named = report.summarize(train, {}, [], level=40.0)  # a level given: the 5-step mean 40.0 at step 8
    assert report.headline(named) == "5-step mean reward first reaches 40.0 at step 8, 80 s into training"
    gsm8k = report.summarize([{**r, "reward/mean": 1.1} for r in _rows()], {}, [])  # right and formatted: the unit scale
    assert gsm8k["reward_level"] == 0.8 and gsm8k["first_reaches_0.8"] == {"step": 5, "wall_s": 50.0}
