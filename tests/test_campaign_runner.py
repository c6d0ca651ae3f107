"""benchmarks/campaign.py runs decision 20's pre-registered commands seed by seed: each phase's arms and seeds, a
result file per finished seed, failed gates replaced in the finals, finished seeds never run again, and a seed that
crashed stops the runner naming its log. A stand-in bench (a script printing the bench's JSON line) keeps it fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import campaign  # noqa: E402

FAKE_BENCH = '''
import json, sys, time
from pathlib import Path
argv = sys.argv[1:]
seed = int(argv[argv.index("--seed") + 1])
Path(argv[argv.index("--workdir") + 1]).mkdir(parents=True, exist_ok=True)
if seed == {crash}:
    sys.exit(1)
time.sleep({seconds})
print("  step 1/1")
print("JSON " + json.dumps({{"args": argv, "seeds": [{{"seed": seed, "gate": {{"passed": seed != {failed}}}}}]}}))
'''


def _bench(tmp_path: Path, failed: int = -1, crash: int = -1, seconds: float = 0.0) -> Path:
    path = tmp_path / "fake_bench.py"
    path.write_text(FAKE_BENCH.format(failed=failed, crash=crash, seconds=seconds), encoding="utf-8")
    return path


def _run(tmp_path: Path, *argv: str) -> int:
    return campaign.main([*argv, "--workroot", str(tmp_path / "work"), "--results", str(tmp_path / "results"),
                          "--poll-s", "0.05"])


def test_the_screen_runs_seeds_300_to_307_with_every_arm(capsys, tmp_path):
    assert _run(tmp_path, "screen", "--dry-run") == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "bench_learning.py" in line]
    assert [c.split("--seed ")[1].split()[0] for c in commands] == [str(s) for s in range(300, 308)]
    first = commands[0]
    assert "--dense" in first and "--tune-decoding 64" in first and "--stop-at-failed-gate" in first
    assert "--grid-arms stage1_gap,stage2_recipe" in first
    for arm in ("stage1_annealed", "recipe_reading_order_ul", "reward_object", "reward_object_bc"):
        assert f"--variant {arm}=" in first
    assert "baseline_closing:true" in first and "--long-multiple" not in first


def test_a_setting_calibration_chose_other_than_5_10_20_is_passed_as_its_grid(capsys, tmp_path):
    _run(tmp_path, "screen", "--dry-run", "--grid", "5:8-16")
    out = capsys.readouterr().out
    assert "--grid 5:8-16" in out and "--dense" not in out


def test_the_finals_need_the_screens_finalists_and_the_long_multiple(tmp_path):
    with pytest.raises(SystemExit, match="--finalists"):
        _run(tmp_path, "dense", "--long-multiple", "4", "--dry-run")
    with pytest.raises(SystemExit, match="--finalists"):
        _run(tmp_path, "dense", "--finalists", "stage1_gap", "--long-multiple", "4", "--dry-run")
    with pytest.raises(SystemExit, match="--long-multiple"):
        _run(tmp_path, "dense", "--finalists", "reward_object", "--dry-run")


def test_the_finals_replace_a_failed_gate_and_never_rerun_a_finished_seed(capsys, tmp_path):
    bench = _bench(tmp_path, failed=331)
    assert _run(tmp_path, "sparse", "--finalists", "stage2_recipe,reward_object_bc", "--long-multiple", "2.5",
                "--gated", "3", "--bench", str(bench)) == 0
    results = tmp_path / "results"
    assert sorted(p.name for p in results.iterdir()) == [f"issue53_sparse_seed{s}.json" for s in (330, 331, 332, 333)]
    saved = json.loads((results / "issue53_sparse_seed330.json").read_text())
    argv = " ".join(saved["args"])
    assert "--grid 4:4-12" in argv and "--long-multiple 2.5" in argv
    assert "--variant reward_object_bc=" in argv and "--grid-arms stage1_gap,stage2_recipe" in argv
    assert json.loads((results / "issue53_sparse_seed331.json").read_text())["seeds"][0]["gate"]["passed"] is False
    capsys.readouterr()
    (tmp_path / "fake_bench.py").write_text("import sys; sys.exit(5)")  # a rerun would crash
    assert _run(tmp_path, "sparse", "--finalists", "stage2_recipe", "--long-multiple", "2.5", "--gated", "3",
                "--bench", str(bench)) == 0
    out = capsys.readouterr().out
    assert out.count("already done") == 4 and "4 seeds, 3 gated" in out


def test_a_seed_that_ends_without_its_json_line_stops_the_runner_naming_its_log(tmp_path):
    bench = _bench(tmp_path, crash=201)
    with pytest.raises(SystemExit, match=r"seed 201 exited 1 without its JSON line: see .*calibration_seed201\.out"):
        _run(tmp_path, "calibration", "--lanes", "1", "--bench", str(bench))
    assert (tmp_path / "results" / "issue53_calibration_seed200.json").exists()
    assert not (tmp_path / "results" / "issue53_calibration_seed201.json").exists()


def test_a_crashed_seed_never_stops_the_seed_beside_it(tmp_path):
    """Seed 300 crashes at once while 301 is still running: 301 finishes and keeps its result (an hour of work on
    the real bench), no further seed starts, and the runner then exits naming the crash."""
    bench = _bench(tmp_path, crash=300, seconds=1.0)
    with pytest.raises(SystemExit, match=r"seed 300 exited 1"):
        _run(tmp_path, "screen", "--lanes", "2", "--bench", str(bench))
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["issue53_screen_seed301.json"]
    assert not (tmp_path / "work" / "screen_seed302.out").exists()


def test_a_stop_file_lets_the_running_seeds_finish_and_starts_no_other(tmp_path):
    """A session with a time limit ends the campaign cleanly: once ``<workroot>/STOP`` exists, the seeds running
    finish and write their results, and no further seed starts; a run started while it exists refuses to run."""
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE_BENCH.format(failed=-1, crash=-1, seconds=0.0).replace(
        'print("  step 1/1")', 'Path(argv[argv.index("--workdir") + 1]).parent.joinpath("STOP").touch()'))
    assert _run(tmp_path, "screen", "--lanes", "1", "--bench", str(bench)) == 0
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["issue53_screen_seed300.json"]
    with pytest.raises(SystemExit) as refused:
        _run(tmp_path, "screen", "--bench", str(bench))
    assert refused.value.code == 2
    (tmp_path / "work" / "STOP").unlink()
    _bench(tmp_path)  # the plain stand-in: the rest of the screen runs
    assert _run(tmp_path, "screen", "--bench", str(bench)) == 0
    assert len(list((tmp_path / "results").iterdir())) == 8


def test_until_starts_no_seed_expected_to_end_after_it(capsys, tmp_path):
    """``--until``: the session's end, less the checks after it. A seed starts only if it is expected to end by
    then: the longest finished seed of the phase (here an hour and a half) or ``--seed-minutes``."""
    import datetime as dt

    bench = _bench(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    (results / "issue53_screen_seed300.json").write_text(json.dumps(
        {"args": [], "seeds": [{"seed": 300, "gate": {"passed": True}}], "total_s": 5400.0}))
    in_an_hour = (dt.datetime.now().astimezone() + dt.timedelta(hours=1)).isoformat(timespec="seconds")
    assert _run(tmp_path, "screen", "--until", in_an_hour, "--bench", str(bench)) == 0
    out = capsys.readouterr().out
    assert "seed 300: already done" in out and "seed 301 not started: expected to end at" in out
    assert "stopped by --until" in out and sorted(p.name for p in results.iterdir()) == ["issue53_screen_seed300.json"]
    assert _run(tmp_path, "screen", "--until", in_an_hour, "--seed-minutes", "1", "--bench", str(bench)) == 0
    assert len(list(results.iterdir())) == 8
    with pytest.raises(SystemExit, match="--seed-minutes"):  # nothing of the finals to time yet
        _run(tmp_path, "dense", "--finalists", "stage2_recipe", "--long-multiple", "2", "--until", "23:59")
    with pytest.raises(SystemExit, match="HH:MM"):
        _run(tmp_path, "screen", "--until", "late")


BASELINE_ARMS = ("stage1", "stage1_continued", "stage1_annealed", "stage1_long", "stage1_gap")
NOISE = (0.003, -0.002, 0.001, -0.003, 0.002, 0.0, -0.001, 0.003, -0.002, 0.001, 0.002, -0.003)


def _final(results: Path, phase: str, seeds: range, gains: dict[str, float], failed: tuple[int, ...] = ()) -> None:
    """One result file per seed, as campaign.py writes them: every baseline near 0.80 AP50 / 0.85 F1 (tuned) and
    each treatment at stage1_long plus its gain (plus a seed-dependent wobble smaller than the gain)."""
    grid = campaign.DENSE_GRID if phase == "dense" else campaign.SPARSE_GRID
    results.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        runs = {name: {"tuned": {"AP50": 0.80 + NOISE[(i + k) % 12] / 3, "f1": 0.85 + NOISE[(i + 2 * k) % 12] / 3}}
                for k, name in enumerate(BASELINE_ARMS)}
        long = runs["stage1_long"]["tuned"]
        for name, gain in gains.items():
            runs[name] = {"tuned": {f: v + gain + NOISE[(5 * i) % 12] / 4 for f, v in long.items()}}
        line = {"args": {"task": "grid", "grid": grid}, "seeds": [{"seed": seed, "gate": {"passed": seed not in failed},
                                                                  "runs": runs}]}
        (results / f"issue53_{phase}_seed{seed}.json").write_text(json.dumps(line) + "\n", encoding="utf-8")


def test_the_verdict_applies_both_settings_parts_and_names_what_init_should_write(capsys, tmp_path):
    """The finals' files alone decide: a treatment up on every dense baseline and level on 4:4-12 meets the rule (of
    two such, the larger dense AP50 gain ships); one below stage1 on 4:4-12 does not, naming that part; a failed
    gate's seed is left out of the 12."""
    results = tmp_path / "results"
    gains = {"stage2_recipe": 0.01, "reward_object_bc": 0.02, "recipe_reading_order_ul": 0.03}
    _final(results, "dense", range(310, 323), gains, failed=(315,))
    _final(results, "sparse", range(330, 338), {"stage2_recipe": 0.0, "reward_object_bc": 0.001,
                                                 "recipe_reading_order_ul": -0.02})
    assert _run(tmp_path, "verdict", "--json") == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["gated_seeds"] == {"dense": 12, "default": 8}
    assert verdict["arms"]["stage2_recipe"]["met"] and verdict["arms"]["reward_object_bc"]["met"]
    below = verdict["arms"]["recipe_reading_order_ul"]
    assert not below["met"] and below["reasons"][0].startswith("4:4-12: AP50 - stage1:")
    assert "entirely below 0" in below["reasons"][0]
    assert verdict["ships"] == "reward_object_bc"
    assert _run(tmp_path, "verdict") == 0
    out = capsys.readouterr().out
    assert "`coordexp init --stage 2` should write: reward_object_bc" in out and "12 gated dense seeds" in out


def test_the_verdict_with_no_arm_met_keeps_init_and_says_why(capsys, tmp_path):
    results = tmp_path / "results"
    _final(results, "dense", range(310, 318), {"stage2_recipe": 0.01})  # 8 seeds: the dense part needs 12
    _final(results, "sparse", range(330, 338), {"stage2_recipe": 0.01})
    assert _run(tmp_path, "verdict") == 0
    out = capsys.readouterr().out
    assert "stage2_recipe: not met (dense: needs 12 gated seeds, has 8)" in out
    assert "no treatment met the rule: `coordexp init --stage 2` stays as it is" in out


def test_the_verdict_refuses_missing_or_misplaced_finals(tmp_path):
    with pytest.raises(SystemExit, match=r"no dense result in .*issue53_dense_seed\*\.json"):
        _run(tmp_path, "verdict")
    _final(tmp_path / "results", "dense", range(310, 312), {"stage2_recipe": 0.01})
    _final(tmp_path / "results", "sparse", range(330, 332), {"stage2_recipe": 0.01})
    bad = tmp_path / "results" / "issue53_sparse_seed330.json"
    bad.write_text(bad.read_text().replace(campaign.SPARSE_GRID, "6:8-20"))
    with pytest.raises(SystemExit, match="cannot be summarized as one: grid"):
        _run(tmp_path, "verdict")
    (tmp_path / "results" / "issue53_sparse_seed331.json").unlink()
    with pytest.raises(SystemExit, match=r"the default part needs a grid run at --grid 4:4-12"):
        _run(tmp_path, "verdict")


def _arm(ap50: float, f1: float, duplicates: float = 0.0, wall_s: float | None = None,
         cut_off: list[float] | None = None, reward: list[float] | None = None) -> dict:
    figures = {"AP50": ap50, "f1": f1, "duplicates_per_image": duplicates, "premature_eos_rate": 0.125}
    return {"eval": dict(figures), "tuned": {**figures, "AP50": ap50 + 0.01, "premature_eos_rate": 0.25},
            "train": {"wall_s": wall_s, "cut_off_quarters": cut_off, "reward_quarters": reward}}


def test_figures_prints_each_seeds_amendment_figures_from_its_result_file(capsys, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    runs = {"stage1": _arm(0.80, 0.85), "stage1_continued": _arm(0.8, 0.85004, 0.5, wall_s=60.0),
            "reward_object": _arm(0.83, 0.81, 2.0, wall_s=600.0, cut_off=[0.1, 0.95], reward=[0.5, 0.25])}
    for seed in (306, 307):
        result = {"total_s": 5400.0, "seeds": [{"seed": seed, "gate": {"passed": seed == 306}, "runs": runs}]}
        (results / f"issue53_screen_seed{seed}.json").write_text(json.dumps(result), encoding="utf-8")
    assert _run(tmp_path, "figures", "--seeds", "307") == 0
    out = capsys.readouterr().out
    assert "seed 306" not in out
    assert ("seed 307, 90 minutes: gate FAILED; stage1's premature EOS 12.5% at the default decoding (25.0% tuned); "
            "stage1 tuned AP50 / F1 81.0 / 85.0") in out
    assert "| `stage1_continued` | 0.0 / 0.0 | 0.0 / 0.0 | 0.50 -> 0.50 | 1.0x | - | - |" in out
    assert "| `reward_object` | +3.0 / -4.0 | +3.0 / -4.0 | 2.00 -> 2.00 | 10.0x | 10.0% -> 95.0% | 0.50 -> 0.25 |" in out
    assert "| `stage1` |" not in out
    with pytest.raises(SystemExit, match="figures: no dense result"):
        _run(tmp_path, "figures", "--of", "dense")
    with pytest.raises(SystemExit) as bad_seeds:
        _run(tmp_path, "figures", "--seeds", "3o6")
    assert bad_seeds.value.code == 2
    assert "give seed numbers" in capsys.readouterr().err
    # a damaged result file is reported as itself, not as a bad --seeds (JSONDecodeError is a ValueError)
    (results / "issue53_screen_seed307.json").write_text("{", encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        _run(tmp_path, "figures", "--seeds", "307")
