"""The ranks' agreement on how a run starts (issue 55, item 3): the verdict over every rank's view, and the exchange
through a real TCP store (rank 0 hosts it, as without a torchrun agent), bounded when a rank never answers."""

from __future__ import annotations

import json
import threading

from coordexp.runtime.train.rank_agreement import (StartView, checkpoint_view, disagreement, exchange_views,
                                                   failure_view)
from testkit import free_port


def _checkpoint(folder, step: int, history: list) -> str:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    return str(folder)


def test_the_same_checkpoint_or_a_fresh_start_everywhere_agrees(tmp_path):
    path = _checkpoint(tmp_path / "run" / "checkpoint-6", 6, [])
    assert disagreement([checkpoint_view(r, path) for r in range(3)]) is None
    assert disagreement([checkpoint_view(r, None) for r in range(3)]) is None


def test_a_rank_that_cannot_start_stops_every_rank_with_its_reason_prefixed_by_its_rank(tmp_path):
    path = _checkpoint(tmp_path / "run" / "checkpoint-6", 6, [])
    views = [checkpoint_view(0, path), failure_view(1, "no checkpoint in runs/x\n(rank-local)", 2),
             failure_view(2, "a package is missing", 3)]
    problem = disagreement(views)
    assert problem.lines == ("rank 1: no checkpoint in runs/x (rank-local)", "rank 2: a package is missing")
    assert problem.code == 2  # the user's to fix wins over an external failure
    assert "must be one folder every node mounts" in problem.hint  # rank 0 sees a checkpoint rank 1 does not


def test_private_copies_of_one_checkpoint_name_disagree(tmp_path):
    a = _checkpoint(tmp_path / "node0" / "checkpoint-6", 6, [])
    b = _checkpoint(tmp_path / "node1" / "checkpoint-6", 6, [{"loss": 1.0}])
    problem = disagreement([checkpoint_view(0, a), checkpoint_view(1, b)])
    assert problem.code == 2 and problem.lines[0] == "the ranks would not start from the same checkpoint"
    assert problem.lines[2] == f"rank 1: sees {b} (step 6)"
    c = _checkpoint(tmp_path / "node1" / "run" / "checkpoint-6", 6, [])  # same bytes, another path
    problem = disagreement([checkpoint_view(0, a), checkpoint_view(1, c)])
    assert problem is not None and problem.lines[1:] == (f"rank 0: sees {a} (step 6)", f"rank 1: sees {c} (step 6)")
    same_name = disagreement([checkpoint_view(0, a), StartView(1, a, 6, "0" * 64)])
    assert same_name.lines[2].endswith("(another copy of the same name)")


def test_views_travel_through_the_store_and_a_silent_rank_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unit")
    path = _checkpoint(tmp_path / "run" / "checkpoint-2", 2, [])
    got: dict[int, list[StartView]] = {}

    def rank(k: int, view: StartView) -> None:
        got[k] = exchange_views(view, 2, timeout_s=60)

    threads = [threading.Thread(target=rank, args=(0, checkpoint_view(0, path))),
               threading.Thread(target=rank, args=(1, failure_view(1, "no checkpoint here", 2)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got[0] == got[1] and [v.rank for v in got[0]] == [0, 1]
    assert got[0][1].reason == "no checkpoint here" and got[0][0].checkpoint == path

    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # a launch where rank 1 never comes
    views = exchange_views(checkpoint_view(0, path), 2, timeout_s=1)
    assert views[1].code == 3 and "did not say how it starts within 1 s" in views[1].reason
    assert disagreement(views).lines == (f"rank 1: {views[1].reason}",)


def test_ranks_that_fail_alike_share_one_line_and_each_rank_has_its_own(tmp_path):
    views = [failure_view(r, "cfg.yaml: 1 problem(s)", 2) for r in range(12)] + [failure_view(12, "other", 3)]
    problem = disagreement(views)
    assert problem.lines == ("ranks 0, 1, 2, 3, 4, 5, 6, 7 and 4 more: cfg.yaml: 1 problem(s)", "rank 12: other")
    assert problem.own_line(12) == "rank 12: other" and problem.own_line(3) == problem.lines[0]
