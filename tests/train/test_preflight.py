"""coordexp preflight: config, model coord tokens, data sample, servers, topology; exit codes and wiring JSON."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.train.preflight import coord_tokens_missing, run_preflight, suggest_device_split

from testkit import free_port, server_rollout, stub_server

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, ["preflight", *map(str, args)])
    return result.exit_code, result.output


def test_hf_config_passes_without_server_checks(write_config):
    code, out = invoke(write_config({}), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] and [c["name"] for c in report["checks"]] == ["config", "overlap", "model", "stage 2 start",
                                                                      "optimizer groups", "train data", "servers"]


def test_server_mode_reports_wiring(write_config):
    with stub_server(world_size=3) as a:
        cfg = write_config({"rollout_matching": server_rollout([(a.base_url, 51216)], decode_batch_size=8)})
        code, out = invoke(cfg, "--json", "--learner-world-size", 1, "--gpus", 4)
    assert code == 0, out
    wiring = json.loads(out)["wiring"]
    assert wiring["server_base_urls"] == [a.base_url] and wiring["group_ports"] == [51216]
    assert wiring["server_world_sizes"] == [3] and wiring["per_rank_chunk"] == 24
    split = wiring["suggested_device_split"]
    assert split["server_cuda_visible_devices"] == "0,1,2" and split["learner_cuda_visible_devices"] == "3"


def test_invalid_config_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout_matching: {decode_batch_size: -3}\n", encoding="utf-8")
    code, out = invoke(bad, "--json")
    assert code == 2 and json.loads(out)["checks"][0]["name"] == "config"


def test_unreachable_server_exits_3_naming_the_url(write_config):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = write_config({"rollout_matching": server_rollout([(url, 51216)])})
    code, out = invoke(cfg, "--json", "--health-timeout", 0.5)
    assert code == 3
    assert url in json.loads(out)["checks"][-1]["detail"]


def test_infeasible_topology_exits_3(write_config):
    with stub_server(world_size=1) as a, stub_server(world_size=1) as b:
        cfg = write_config({"rollout_matching": server_rollout([(a.base_url, 1), (b.base_url, 2)],
                                                               decode_batch_size=1)})
        code, out = invoke(cfg, "--json", "--learner-world-size", 4)
    assert code == 3, out
    assert "decode_batch_size" in json.loads(out)["checks"][-1]["detail"]


def test_launch_mode_checks_free_ports_and_exits_3_when_busy(write_config):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        cfg = write_config({"rollout_matching": server_rollout([(f"http://127.0.0.1:{free_port()}", busy)])})
        code, out = invoke(cfg, "--json", "--launch")
    assert code == 3 and f"port {busy}" in out
    code, out = invoke(cfg, "--json", "--launch", "--server-world-size", 3)
    assert code == 0 and json.loads(out)["wiring"]["per_rank_chunk"] == 6  # decode_batch_size 2 * 3 / 1


def test_model_without_coord_tokens_exits_2(write_config, tmp_path, tiny_model_dir):
    bare = tmp_path / "bare_model"
    bare.mkdir()
    (bare / "config.json").write_text("{}", encoding="utf-8")
    (bare / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": "<|coord_0|>"}]}), encoding="utf-8")
    assert len(coord_tokens_missing(bare)) == 999 and coord_tokens_missing(tiny_model_dir) == []
    report = run_preflight(write_config({"model": {"path": str(bare)}}))
    (problem,) = report.problems
    assert report.exit_code == 2 and problem.name == "model" and "999 of 1000 coord tokens missing" in problem.detail


def test_model_check_names_the_family_and_refuses_others(write_config, tmp_path, tiny_model_dir, qwen3_model_dir):
    report = run_preflight(write_config({"model": {"path": str(qwen3_model_dir)}}))
    model_check = next(c for c in report.checks if c.name == "model")
    assert model_check.ok and "qwen3_vl, all 1000 coord tokens" in model_check.detail
    other = tmp_path / "other_family"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((tiny_model_dir / name).read_bytes())
    (other / "config.json").write_text(json.dumps({"model_type": "idefics3"}), encoding="utf-8")
    report = run_preflight(write_config({"model": {"path": str(other)}}))
    (problem,) = report.problems
    assert report.exit_code == 2 and "'idefics3' is not a supported Qwen-VL family" in problem.detail


def test_an_adapter_directory_is_checked_against_its_base(write_config, tmp_path, qwen3_model_dir):
    """A saved LoRA adapter as model.path: coord tokens from its tokenizer, the family from its base checkpoint."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (adapter / name).write_bytes((qwen3_model_dir / name).read_bytes())
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": str(qwen3_model_dir)}), encoding="utf-8")
    report = run_preflight(write_config({"model": {"path": str(adapter)}}))
    model_check = next(c for c in report.checks if c.name == "model")
    assert model_check.ok and f"(LoRA adapter on {qwen3_model_dir}): qwen3_vl" in model_check.detail
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "gone")}), encoding="utf-8")
    problem = next(c for c in run_preflight(write_config({"model": {"path": str(adapter)}})).problems
                   if c.name == "model")
    assert "is not a local checkpoint" in problem.detail


def test_unreadable_image_exits_2(write_config, tmp_path, dataset):
    lines = dataset.train_jsonl.read_text(encoding="utf-8").splitlines()
    record = json.loads(lines[0])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    record["images"] = [str(broken)]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps(record) + "\n", encoding="utf-8")
    report = run_preflight(write_config({"data": {"train_jsonl": str(jsonl), "val_jsonl": None}}))
    (problem,) = report.problems
    assert report.exit_code == 2 and "not a readable image" in problem.detail


def test_device_split_suggestions():
    assert suggest_device_split(4, 1)["server_devices"] == [0, 1, 2]
    assert suggest_device_split(8, 2)["learner_devices"] == [6, 7]
    assert suggest_device_split(1, 1)["server_devices"] == []


@pytest.mark.slow  # starts a process
def test_preflight_does_not_import_torch(write_config):
    cfg = write_config({})
    code = ("import sys; from coordexp.runtime.train.preflight import run_preflight; r = run_preflight(sys.argv[1]); "
            "assert r.ok, r; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code, str(cfg)], check=True, timeout=60)


def test_every_problem_is_reported_and_user_input_outranks_a_dead_server(write_config, tmp_path, dataset):
    """Preflight goes on after a failure: a bare model, an unreadable image and two dead servers are all listed;
    the exit code is 2 (the input must be fixed; waiting for servers would not help)."""
    bare = tmp_path / "bare_model"
    bare.mkdir()
    (bare / "config.json").write_text("{}", encoding="utf-8")
    record = json.loads(dataset.train_jsonl.read_text(encoding="utf-8").splitlines()[0])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    record["images"] = [str(broken)]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps(record) + "\n", encoding="utf-8")
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    cfg = write_config({"model": {"path": str(bare)}, "data": {"train_jsonl": str(jsonl), "val_jsonl": None},
                        "rollout_matching": server_rollout([(dead[0], 51216), (dead[1], 51217)])})
    code, out = invoke(cfg, "--json", "--health-timeout", 0.3)
    report = json.loads(out)
    problems = [(c["name"], c["exit_code"]) for c in report["checks"] if not c["ok"]]
    assert problems == [("model", 2), ("train data", 2), (f"server {dead[0]}", 3), (f"server {dead[1]}", 3)]
    assert code == 2 and report["exit_code"] == 2
    assert "topology" not in [c["name"] for c in report["checks"]]  # unknown world sizes: not judged


def test_only_external_problems_exit_3_and_the_text_report_counts_them(write_config):
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    cfg = write_config({"rollout_matching": server_rollout([(dead[0], 51216), (dead[1], 51217)])})
    code, out = invoke(cfg, "--health-timeout", 0.3)
    assert code == 3, out
    assert all(f"✗ server {url}" in out for url in dead)
    assert "2 problem(s)" in out and "(exit 3)" in out and "Traceback" not in out


def test_every_config_problem_is_a_check(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("global_max_length: -1\nrollout_matching: {decode_batch_size: -3}\ntraining: {max_stepz: 1}\n",
                   encoding="utf-8")
    report = run_preflight(bad)
    assert report.exit_code == 2 and len(report.problems) >= 3
    assert {c.name for c in report.checks} == {"config"}
    details = " ".join(c.detail for c in report.problems)
    assert "global_max_length" in details and "decode_batch_size" in details and "max_stepz" in details


def test_preflight_says_whether_overlap_is_on(write_config):
    from coordexp.runtime.train.preflight import run_preflight

    report = run_preflight(write_config({}))
    overlap = next(c for c in report.checks if c.name == "overlap")
    assert overlap.ok and "off" in overlap.detail


def test_preflight_says_when_overlap_is_on(write_config):
    rollout = server_rollout([(f"http://127.0.0.1:{free_port()}", free_port())], overlap={"enabled": True})
    report = run_preflight(write_config({"rollout_matching": rollout}), health_timeout_s=0.5)
    overlap = next(c for c in report.checks if c.name == "overlap")
    assert overlap.ok and "ON" in overlap.detail and "1 optimizer step" in overlap.detail
