"""Runs issue 53's campaign (docs/design.md, decision 20) seed by seed: the pre-registered command of each phase,
``--lanes`` seeds side by side (one torch thread each, each seed in its own process group so stopping one never
stops another), and each finished seed's JSON line written to ``--results`` as ``issue53_<phase>_seed<S>.json``
the moment it ends, to be committed as it finishes. A seed whose file exists is done and never run again, so the
runner picks up where a stopped session left it (a seed that was running is started over: its workdir is cleared).
To end a session cleanly, create ``<workroot>/STOP``: the seeds running finish and write their results, and no new
seed starts (a seed that has started is an hour of work; stopping it loses that hour). ``--until HH:MM`` does the
same by the clock: a seed starts only if it is expected to end by then (the longest ``total_s`` of the phase's
finished seeds, or ``--seed-minutes``), so a session's last lane is never spent on a seed its end would lose.

``figures --of PHASE`` prints each finished seed's figures as decision 20's amendments state them.
``verdict`` reads the finals' result files and applies issue 53's whole rule (both settings' parts): which
treatment beats the detector you have, and what ``coordexp init --stage 2`` should write (``--json``: as JSON).

Phases: ``calibration`` (seeds 200-201, the default arms, one ``--grid`` of decision 20's candidates),
``screen`` (seeds 300-307, every arm of the screen), ``dense`` and ``sparse`` (the finals: the five baselines and
the ``--finalists``, ``--long-multiple K``; seeds from 310 and 330 until ``--gated`` seeds passed stage 1's gate,
a failed seed reported and replaced by the next).

    python benchmarks/campaign.py screen --workroot /tmp/camp                   # seeds 300-307, two lanes
    python benchmarks/campaign.py dense --finalists reward_object --long-multiple 4 --dry-run
    python benchmarks/campaign.py verdict                                         # the rule, from both finals
    touch /tmp/camp/STOP                                                          # no new seed after these
    python benchmarks/campaign.py screen --until 23:45                           # none that would end later
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_learning.py"
DENSE_GRID, SPARSE_GRID = "5:10-20", "4:4-12"
COMMON = ("--task", "grid", "--n-seeds", "1", "--probe-images", "128", "--stop-at-failed-gate")
# decision 20's treatments and the one baseline that is a --variant; stage2_recipe and stage1_gap are the bench's own
VARIANTS = {
    "stage1_annealed": "rollout_matching.gt_step_share:1.0;training.lr_scheduler_type:cosine",
    "recipe_reading_order_ul": "rollout_matching.fn_placement:reading_order;rollout_matching.repeats:unlikelihood",
    "reward_object": "rollout_matching.objective:reward;rollout_matching.reward.credit:object",
    "reward_object_bc": ("rollout_matching.objective:reward;rollout_matching.reward.credit:object;"
                         "rollout_matching.reward.baseline_closing:true"),
}
BENCH_ARMS = ("stage1_gap", "stage2_recipe")
SCREEN_ARMS = ("stage1_annealed", "stage1_gap", "stage2_recipe", "recipe_reading_order_ul", "reward_object",
               "reward_object_bc")
TREATMENTS = ("stage2_recipe", "recipe_reading_order_ul", "reward_object", "reward_object_bc")


@dataclass(frozen=True)
class Phase:
    """Which seeds a phase runs and the bench options of every seed."""

    name: str
    first_seed: int
    seeds: int | None  # a fixed number of seeds (calibration, screen), gated or not
    gated: int | None  # or: seeds from first_seed until this many passed the gate (the finals)
    options: tuple[str, ...]


def arm_options(arms: Sequence[str]) -> tuple[str, ...]:
    """``--grid-arms``/``--variant`` options training ``arms`` besides the control (``stage1_continued``)."""
    unknown = [a for a in arms if a not in VARIANTS and a not in BENCH_ARMS]
    if unknown:
        raise SystemExit(f"no campaign arm {', '.join(unknown)}; arms: {', '.join((*BENCH_ARMS, *VARIANTS))}")
    options = ["--grid-arms", ",".join(a for a in BENCH_ARMS if a in arms)]
    for arm in arms:
        if arm in VARIANTS:
            options += ["--variant", f"{arm}={VARIANTS[arm]}"]
    return tuple(options)


def phase_of(args: argparse.Namespace) -> Phase:
    tune = ("--tune-decoding", "64")
    if args.phase == "calibration":
        return Phase("calibration", 200, 2, None,
                     (*COMMON, "--grid", args.grid, "--grid-arms", "stage2_recipe", *tune))
    dense = ("--dense",) if args.grid == DENSE_GRID else ("--grid", args.grid)
    if args.phase == "screen":
        return Phase("screen", 300, 8, None, (*COMMON, *dense, *tune, *arm_options(SCREEN_ARMS)))
    finalists = [a for a in (args.finalists or "").split(",") if a]
    if not finalists or len(finalists) > 2 or any(a not in TREATMENTS for a in finalists):
        raise SystemExit(f"--finalists: one or two of {', '.join(TREATMENTS)} (the screen's rule chose them)")
    if args.long_multiple is None:
        raise SystemExit("--long-multiple K: stage1_long's multiple, written in decision 20 before the finals")
    arms = ("stage1_annealed", "stage1_gap", *finalists)
    grid = dense if args.phase == "dense" else ("--grid", SPARSE_GRID)
    first, gated = (310, 12) if args.phase == "dense" else (330, 8)
    return Phase(args.phase, first, None, args.gated or gated,
                 (*COMMON, *grid, *tune, "--long-multiple", f"{args.long_multiple:g}", *arm_options(arms)))


def result_path(results: Path, phase: str, seed: int) -> Path:
    return results / f"issue53_{phase}_seed{seed}.json"


def phase_results(results: Path, phase: str) -> list[Path]:
    """The phase's finished seeds' result files, by name (:func:`result_path`)."""
    return sorted(results.glob(f"issue53_{phase}_seed*.json"))


def json_line(stdout: str) -> dict[str, Any] | None:
    """The bench's last ``JSON {...}`` line, parsed; None when the seed printed none (it crashed)."""
    lines = [line for line in stdout.splitlines() if line.startswith("JSON ")]
    return json.loads(lines[-1][5:]) if lines else None


def passed_gate(result: dict[str, Any]) -> bool:
    return all((seed.get("gate") or {}).get("passed", False) for seed in result["seeds"])


def _done(results: Path, phase: str, seed: int) -> dict[str, Any] | None:
    path = result_path(results, phase, seed)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


class Runner:
    """Keeps ``lanes`` seeds running until the phase has what it needs; writes each result file as a seed ends."""

    def __init__(self, phase: Phase, args: argparse.Namespace, until: dt.datetime | None = None,
                 seed_s: float | None = None):
        self.phase, self.args = phase, args
        self.until, self.seed_s = until, seed_s  # no seed starts that is expected to end after ``until``
        self.running: dict[int, subprocess.Popen] = {}
        self.next_seed = phase.first_seed
        self.gated = self.finished = 0
        self.failures: list[str] = []  # seeds that ended without their JSON line
        self.out_of_time = False

    def command(self, seed: int) -> list[str]:
        work = Path(self.args.workroot) / f"{self.phase.name}_seed{seed}"
        return [sys.executable, str(self.args.bench), "--workdir", str(work), "--seed", str(seed),
                *self.phase.options]

    @property
    def stop_file(self) -> Path:
        return Path(self.args.workroot) / "STOP"

    def wanted(self) -> bool:
        """Whether another seed should start now."""
        if self.stop_file.exists() or self.out_of_time:
            return False
        if self.phase.seeds is not None:
            more = self.next_seed < self.phase.first_seed + self.phase.seeds
        else:
            more = self.gated + len(self.running) < self.phase.gated
        done = result_path(Path(self.args.results), self.phase.name, self.next_seed).exists()
        if more and self.until is not None and not done:  # a finished seed costs nothing: the run loop skips it
            ends = dt.datetime.now().astimezone() + dt.timedelta(seconds=self.seed_s)
            if ends > self.until:
                self.out_of_time = True
                print(f"[campaign] seed {self.next_seed} not started: expected to end at {ends:%H:%M}, after "
                      f"--until {self.until:%H:%M}", flush=True)
                return False
        return more

    def start(self, seed: int) -> None:
        command = self.command(seed)
        work = Path(command[command.index("--workdir") + 1])
        shutil.rmtree(work, ignore_errors=True)  # a seed stopped midway starts over
        work.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(work.parent / f"{work.name}.out", "w", encoding="utf-8") as log:  # the child holds its own copy
            self.running[seed] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True, cwd=ROOT)
        print(f"[campaign] seed {seed}: started ({work})", flush=True)

    def collect(self, seed: int, process: subprocess.Popen) -> None:
        """Write the seed's result file (atomically: a reader or a commit never sees half of it), or record its
        failure: the seeds still running finish and keep their results, and no new seed starts."""
        from coordexp.runtime.train.run_folder import write_result_file

        out = Path(self.args.workroot) / f"{self.phase.name}_seed{seed}.out"
        result = json_line(out.read_text(encoding="utf-8", errors="replace"))
        if process.returncode != 0 or result is None:
            self.failures.append(f"seed {seed} exited {process.returncode} without its JSON line: see {out}")
            print(f"[campaign] {self.failures[-1]}; starting no other seed", flush=True)
            return
        path = write_result_file(result_path(Path(self.args.results), self.phase.name, seed),
                                 (json.dumps(result) + "\n").encode("utf-8"))
        self.account(seed, result)
        print(f"[campaign] seed {seed}: {'gate passed' if passed_gate(result) else 'gate FAILED'} -> {path}",
              flush=True)

    def account(self, seed: int, result: dict[str, Any]) -> None:
        self.finished += 1
        self.gated += passed_gate(result)

    def run(self) -> int:
        while True:
            while not self.failures and len(self.running) < self.args.lanes and self.wanted():
                seed, self.next_seed = self.next_seed, self.next_seed + 1
                done = _done(Path(self.args.results), self.phase.name, seed)
                if done is not None:
                    self.account(seed, done)
                    print(f"[campaign] seed {seed}: already done", flush=True)
                    continue
                if self.args.dry_run:
                    print(" ".join(self.command(seed)))
                    self.account(seed, {"seeds": [{"gate": {"passed": True}}]})
                    continue
                self.start(seed)
            if not self.running:
                print(f"[campaign] {self.phase.name}: {self.finished} seeds, {self.gated} gated", flush=True)
                if self.stop_file.exists():
                    print(f"[campaign] stopped by {self.stop_file}: remove it and run again to go on", flush=True)
                elif self.out_of_time:
                    print("[campaign] stopped by --until: run again in a later session to go on", flush=True)
                if self.failures:
                    raise SystemExit("[campaign] " + "; ".join(self.failures))
                return 0
            for seed, process in list(self.running.items()):
                if process.poll() is not None:
                    del self.running[seed]
                    self.collect(seed, process)
            time.sleep(self.args.poll_s)

    def stop(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)


def parse_until(text: str) -> dt.datetime:
    """``HH:MM`` (the next such time on this machine's clock) or an ISO date and time, as an aware datetime."""
    now = dt.datetime.now().astimezone()
    try:
        clock = dt.time.fromisoformat(text)
    except ValueError:
        try:
            moment = dt.datetime.fromisoformat(text)
        except ValueError:
            raise SystemExit(f"--until {text!r}: give HH:MM or an ISO date and time (2026-12-08T00:15)") from None
        return moment if moment.tzinfo else moment.astimezone()
    moment = now.replace(hour=clock.hour, minute=clock.minute, second=clock.second, microsecond=0)
    return moment if moment > now else moment + dt.timedelta(days=1)


def expected_seed_s(results: Path, phase: str, seed_minutes: float | None) -> float:
    """How long one seed of ``phase`` is expected to take: ``--seed-minutes``, else the longest ``total_s`` of the
    phase's finished seeds (the seeds beside it slow it, so the longest, not the mean)."""
    if seed_minutes is not None:
        return seed_minutes * 60.0
    times = [float(json.loads(p.read_text(encoding="utf-8")).get("total_s") or 0.0)
             for p in phase_results(results, phase)]
    if not any(times):
        raise SystemExit(f"--until: no finished {phase} seed to time in {results}; give --seed-minutes M")
    return max(times)


def load_phase(results: Path, phase: str) -> dict[str, Any]:
    """Every result file of a phase as one run (bench_learning's ``merge_runs``: the options must agree)."""
    from _learning_options import merge_runs

    paths = phase_results(results, phase)
    if not paths:
        raise SystemExit(f"verdict: no {phase} result in {results} (issue53_{phase}_seed*.json)")
    return merge_runs([json.loads(path.read_text(encoding="utf-8")) for path in paths])


def verdict(args: argparse.Namespace) -> int:
    """Issue 53's rule over the finals' seeds (``_campaign_report.campaign_verdict``), printed or as JSON."""
    from _campaign_report import campaign_verdict

    try:
        result = campaign_verdict(load_phase(Path(args.results), "dense"), load_phase(Path(args.results), "sparse"))
    except ValueError as exc:
        raise SystemExit(f"verdict: {exc}") from None
    if args.json:
        print(json.dumps(result))
        return 0
    gated, figures = result["gated_seeds"], result["figures"]
    print(f"issue 53's rule on {gated['dense']} gated dense seeds ({figures['dense']} figures) and "
          f"{gated['default']} gated {SPARSE_GRID} seeds ({figures['default']} figures)")
    for name, arm in result["arms"].items():
        print(f"  {name}: " + ("MET" if arm["met"] else "not met (" + "; ".join(arm["reasons"]) + ")"))
    print(f"`coordexp init --stage 2` should write: {result['ships']}" if result["ships"] else
          "no treatment met the rule: `coordexp init --stage 2` stays as it is")
    return 0


def figures(args: argparse.Namespace) -> int:
    """Each finished seed's figures of ``--of PHASE`` (``--seeds``: these only) as an amendment states them."""
    from _campaign_report import seed_figures

    wanted = set(args.seeds) if args.seeds else None
    shown = 0
    for path in phase_results(Path(args.results), args.of):
        result = json.loads(path.read_text(encoding="utf-8"))
        if wanted is not None and not wanted & {s["seed"] for s in result["seeds"]}:
            continue
        print(f"\n{path.name}\n" + "\n".join(seed_figures(result)))
        shown += 1
    if not shown:
        seeds = f" of seeds {','.join(map(str, args.seeds))}" if args.seeds else ""
        raise SystemExit(f"figures: no {args.of} result{seeds} in {args.results}")
    return 0


def seed_list(text: str) -> list[int]:
    """``--seeds 306,307`` as numbers (argparse reports anything else as bad input)."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seed numbers, comma-separated (306,307)") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("calibration", "screen", "dense", "sparse", "verdict", "figures"))
    parser.add_argument("--workroot", default="/tmp/coordexp_campaign", help="each seed's workdir and log go here")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--lanes", type=int, default=2, help="seeds side by side (decision 20: two on 2 cores)")
    parser.add_argument("--grid", default=DENSE_GRID,
                        help="the dense setting: calibration's candidate, then the one calibration chose")
    parser.add_argument("--finalists", help="finals: the screen's one or two finalists, comma-separated")
    parser.add_argument("--long-multiple", type=float, help="finals: stage1_long's K (decision 20's amendment)")
    parser.add_argument("--gated", type=int, help="finals: gated seeds wanted (default 12 dense, 8 sparse)")
    parser.add_argument("--until", help="start no seed expected to end after this time (HH:MM or ISO)")
    parser.add_argument("--seed-minutes", type=float,
                        help="--until: one seed's expected minutes (default: the longest finished seed's)")
    parser.add_argument("--dry-run", action="store_true", help="print each seed's command, run nothing")
    parser.add_argument("--json", action="store_true", help="verdict: print the result as one JSON object")
    parser.add_argument("--of", default="screen", choices=("calibration", "screen", "dense", "sparse"),
                        help="figures: the phase whose finished seeds to show")
    parser.add_argument("--seeds", type=seed_list, help="figures: only these seeds, comma-separated")
    parser.add_argument("--bench", default=str(BENCH), help=argparse.SUPPRESS)
    parser.add_argument("--poll-s", type=float, default=10.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase in ("verdict", "figures"):
        if str(ROOT / "benchmarks") not in sys.path:
            sys.path.insert(0, str(ROOT / "benchmarks"))
        return figures(args) if args.phase == "figures" else verdict(args)
    if args.lanes < 1:
        parser.error("--lanes must be at least 1")
    if args.seed_minutes is not None and not 0 < args.seed_minutes < 10_000:
        parser.error("--seed-minutes must be above 0 and below 10000")
    phase = phase_of(args)
    until = parse_until(args.until) if args.until else None
    seed_s = expected_seed_s(Path(args.results), phase.name, args.seed_minutes) if until else None
    runner = Runner(phase, args, until, seed_s)
    if runner.stop_file.exists():  # left from a stopped session: this run would start nothing
        parser.error(f"{runner.stop_file} exists (a request to stop); remove it to run")
    try:
        return runner.run()
    except KeyboardInterrupt:  # asked to stop: the running seeds stop too
        runner.stop()
        raise


if __name__ == "__main__":
    sys.exit(main())
