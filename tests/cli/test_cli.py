"""``coordexp validate | schema | migrate``: exit codes, JSON output, no tracebacks, no heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(str(p) for p in (REPO / "examples").glob("*.yaml"))
runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_validate_examples_ok():
    result = _run("validate", *EXAMPLES)
    assert result.exit_code == 0, result.output
    assert result.output.count("✓") == len(EXAMPLES)


def test_validate_invalid_exit_2_with_dotted_paths(stage2_config, write_yaml):
    stage2_config["rollout_matching"]["vllm"] = {"mode": "server", "server": {"servers": [
        {"base_url": "http://h:1", "group_port": 5, "unknown_flag": 1}]}}
    result = _run("validate", str(write_yaml(stage2_config)))
    assert result.exit_code == 2
    assert "rollout_matching.vllm.server.servers[0].unknown_flag: unknown key" in result.output


def test_validate_json(stage2_config, write_yaml):
    good = write_yaml(stage2_config, "good.yaml")
    stage2_config["custom"]["extra"] = {"rollout_matching": {"decode_batch_size": 4}}
    bad = write_yaml(stage2_config, "bad.yaml")
    result = _run("validate", "--json", str(good), str(bad))
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert [(r["path"], r["ok"]) for r in payload] == [(str(good), True), (str(bad), False)]
    (error,) = payload[1]["errors"]
    assert error["path"] == "custom.extra.rollout_matching.decode_batch_size"
    assert error["message"] == "legacy key, replaced by rollout_matching.decode_batch_size"
    assert error["hint"] and error["file"].endswith("bad.yaml")
    assert payload[0]["warnings"] == []


def test_validate_print_contract_json(stage2_config, write_yaml):
    result = _run("validate", "--json", "--print-contract", str(write_yaml(stage2_config)))
    assert result.exit_code == 0
    contract = json.loads(result.stdout)[0]["contract"]
    backend = contract["rollout_matching"]["backend"]  # the one resolved backend (issue 10 item 2)
    assert backend["kind"] == "vllm_colocate" and backend["sync"]["mode"] == "full"
    assert contract["rollout_matching"]["packing"]["packing_length"] == 2048


def test_validate_prints_warnings(stage2_config, write_yaml):
    stage2_config["rollout_matching"]["pipeline"]["objective"][0]["channels"] = ["A"]
    result = _run("validate", str(write_yaml(stage2_config)))
    assert result.exit_code == 0 and "warning" in result.output and "inert" in result.output


@pytest.mark.parametrize(
    ("content", "needle"),
    [(b"", "file is empty"), (b"- 1\n- 2\n", "got a list"), (bytes(range(256)) * 4, "not a UTF-8"),
     (b"a: [\n", "invalid YAML"), (b"\x00\x01\x02", "NUL")],
)
def test_validate_never_shows_a_traceback(tmp_path, content, needle):
    path = tmp_path / "in.yaml"
    path.write_bytes(content)
    result = _run("validate", str(path))
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output


def test_validate_missing_file_and_directory(tmp_path):
    result = _run("validate", str(tmp_path / "nope.yaml"), str(tmp_path))
    assert result.exit_code == 2
    assert "file not found" in result.output and "is a directory" in result.output


def test_schema_is_json_schema():
    result = _run("schema")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["additionalProperties"] is False
    assert {"global_max_length", "model", "rollout_matching", "extends"} <= set(document["properties"])
    assert "RolloutMatchingConfig" in document["$defs"]


def test_migrate_stdout_in_place_and_output(tmp_path):
    legacy = REPO / "examples" / "legacy" / "old_flat_keys_colocate.yaml"
    src = tmp_path / "legacy" / "cfg.yaml"
    src.parent.mkdir()
    src.write_text(legacy.read_text())
    result = _run("migrate", str(src))
    assert result.exit_code == 0 and "decoding:" in result.stdout and "moved" in result.stderr
    out = tmp_path / "legacy" / "new.yaml"
    assert _run("migrate", str(src), "-o", str(out)).exit_code == 0
    assert "validates" in _run("migrate", str(src), "-o", str(out)).stderr
    original = src.read_text()
    result = _run("migrate", str(src), "--in-place")
    assert result.exit_code == 0
    assert (tmp_path / "legacy" / "cfg.yaml.bak").read_text() == original
    assert src.read_text() == out.read_text()
    again = _run("migrate", str(src), "--in-place")
    assert again.exit_code == 0 and "nothing to migrate" in again.stderr


def test_migrate_reports_what_it_left(stage2_config, write_yaml):
    stage2_config["rollout_matching"]["decode_mode"] = "beam"
    result = _run("migrate", str(write_yaml(stage2_config)))
    assert result.exit_code == 2 and "left" in result.stderr and "decode_mode" in result.stderr


def test_migrate_bad_input_and_flag_conflict(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"- a\n")
    assert _run("migrate", str(path)).exit_code == 2
    path.write_bytes(b"a: 1\n")
    assert _run("migrate", str(path), "--in-place", "-o", str(tmp_path / "o.yaml")).exit_code == 2
    assert _run("migrate", str(tmp_path / "missing.yaml")).exit_code == 2


_PROBE = """
import sys, time
t = time.perf_counter()
from coordexp.cli.app import main
try:
    main({args!r})
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "vllm", "coordexp.runtime") if m in sys.modules)
print("RESULT", code, heavy, round(time.perf_counter() - t, 3))
"""


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("args", [["validate", *EXAMPLES], ["schema"], ["validate", "--print-contract", EXAMPLES[0]]])
def test_light_commands_import_no_heavy_module(args):
    """validate/schema stay fast by construction: they never import torch/transformers/vllm (a timing bound would
    only measure the machine's load; benchmarks/ holds speed targets)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(args=args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    _, code, rest = line.split(" ", 2)
    heavy, _seconds = rest.rsplit(" ", 1)
    assert (code, heavy) == ("0", "[]"), (line, proc.stderr)


@pytest.mark.slow  # starts a process
def test_console_script_entry_point_exists():
    proc = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "validate" in proc.stdout and "migrate" in proc.stdout


def test_internal_errors_exit_1_without_traceback(monkeypatch, capsys, stage2_config, write_yaml):
    import coordexp.schema.loader as loader
    from coordexp.cli.app import main

    def boom(path):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(loader, "validate_config_file", boom)
    monkeypatch.delenv("COORDEXP_DEBUG", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["validate", str(write_yaml(stage2_config))])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "simulated bug" in err and "Traceback" not in err
