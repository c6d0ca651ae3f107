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
