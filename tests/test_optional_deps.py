"""The one table of optional packages (``coordexp/optional_deps.py``): what needs each, its install line, and every
surface that reads it: ``validate`` warns, ``train`` and ``serve-rollout`` exit 3 before any model loads, an
ImportError of a listed package anywhere is exit 3 with the line (never "a bug in coordexp")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from coordexp import optional_deps as deps
from coordexp.errors import EXIT_EXTERNAL, MissingDependencyError, exit_code_for

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def fake_run(**changes):
    run = SimpleNamespace(
        model=SimpleNamespace(path="/nonexistent/model", attn_implementation="sdpa", dtype="float32"),
        training=SimpleNamespace(deepspeed=None, report_to=[]), tuner=SimpleNamespace(train_type="full"),
        rollout_matching=SimpleNamespace(backend=SimpleNamespace(kind="hf")), trainer_variant="stage1_sft")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        target = run
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return run


def modules(found) -> list[str]:
    return [dep.module for dep, _ in found]


def test_each_config_value_names_its_package():
    assert modules(deps.needed_by(fake_run())) == []
    assert modules(deps.needed_by(fake_run(tuner__train_type="lora"))) == ["peft"]
    assert modules(deps.needed_by(fake_run(training__deepspeed="zero2"))) == ["deepspeed"]
    assert modules(deps.needed_by(fake_run(training__report_to=["tensorboard"]))) == ["tensorboard"]
    assert modules(deps.needed_by(fake_run(model__attn_implementation="flash_attention_2"))) == ["flash_attn"]
    colocate = dict(rollout_matching__backend=SimpleNamespace(kind="vllm_colocate"))
    assert modules(deps.needed_by(fake_run(**colocate))) == []  # stage 1 never rolls out with it
    assert modules(deps.needed_by(fake_run(trainer_variant="stage2_rollout_aligned", **colocate))) == ["vllm"]
    assert modules(deps.needed_by(fake_run(**colocate), "eval")) == ["vllm"]
    assert modules(deps.needed_by(fake_run(**colocate), "serve")) == ["fastapi", "uvicorn"]
    assert modules(deps.needed_by(fake_run(), "serve_vllm")) == ["fastapi", "uvicorn", "vllm"]


def test_a_hidden_package_is_missing_and_require_names_every_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert not deps.installed("peft") and not deps.dependency("peft").installed()
    with pytest.raises(MissingDependencyError) as caught:
        deps.require_installed(fake_run(tuner__train_type="lora", training__deepspeed="zero2"))
    assert exit_code_for(caught.value) == EXIT_EXTERNAL
    assert "pip install 'peft>=0.13'" in caught.value.hint and "pip install 'coordexp[deepspeed]'" in caught.value.hint
    deps.require_installed(fake_run())  # nothing needed: nothing raised


@pytest.mark.parametrize("error, line", [
    (ModuleNotFoundError("No module named 'peft'", name="peft"), "pip install 'peft>=0.13'"),
    (ModuleNotFoundError("No module named 'fastapi'", name="fastapi"), "pip install 'coordexp[server]'"),
    (ModuleNotFoundError("No module named 'deepspeed.ops'", name="deepspeed.ops"), "coordexp[deepspeed]"),
    (ImportError("FlashAttention2 has been toggled on, but the package flash_attn seems to be not installed."),
     "pip install 'flash-attn'"),
])
def test_an_import_error_of_a_listed_package_is_exit_3_with_its_line(error, line, monkeypatch):
    for module in ("peft", "fastapi", "deepspeed", "flash_attn"):  # not installed here, as on a user's machine
        monkeypatch.setitem(sys.modules, module, None)
    wrapped = RuntimeError("loading failed")
    wrapped.__cause__ = error  # found through the chain too
    for exc in (error, wrapped):
        found = deps.as_missing_dependency(exc)
        assert found is not None and exit_code_for(found) == EXIT_EXTERNAL and line in found.hint


def test_other_errors_are_left_alone():
    assert deps.as_missing_dependency(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    assert deps.as_missing_dependency(ValueError("peft")) is None
    assert deps.as_missing_dependency(MissingDependencyError("x")) is None


def test_an_installed_package_that_fails_to_import_or_coordexps_own_import_error_is_no_missing_package(
        monkeypatch):
    """Regression (issue 56, item 12): any ImportError whose text named a listed package became "not installed"
    (exit 3): an installed-but-broken package and coordexp's own import errors included."""
    pytest.importorskip("peft")
    broken = ImportError("cannot import name 'LoraConfig' from partially initialized module 'peft'")
    own = ImportError("cannot import name 'attach_adapter' from 'coordexp.runtime.model.adapters' (peft helpers)")
    installed_but_failing = ModuleNotFoundError("No module named 'peft'", name="peft")  # raised by a broken install
    for error in (broken, own, installed_but_failing):
        assert deps.as_missing_dependency(error) is None
    monkeypatch.setitem(sys.modules, "peft", None)  # the same texts where peft really is missing
    assert deps.as_missing_dependency(installed_but_failing) is not None


def test_an_unreachable_hub_is_exit_3_naming_hf_download():
    """Regression (issue 44): a hub model.path while offline ended as 'internal error: OSError ... bug in coordexp'."""
    offline = OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.")
    found = deps.as_external_error(offline)
    assert found is not None and exit_code_for(found) == EXIT_EXTERNAL
    assert "hf download ORG/NAME --local-dir NAME" in found.hint and "huggingface-cli" not in found.hint
    assert deps.as_external_error(OSError("disk full")) is None


def test_the_cli_turns_a_listed_import_error_into_exit_3(capsys, monkeypatch):
    """Regression (issue 44): LoRA without peft, serve-rollout without fastapi ended as 'internal error ...
    ModuleNotFoundError ... This is a bug in coordexp' (exit 1)."""
    from coordexp.cli.frame import guarded

    monkeypatch.setitem(sys.modules, "peft", None)

    app = typer.Typer()

    def command() -> None:
        raise ModuleNotFoundError("No module named 'peft'", name="peft")

    app.command("x")(guarded(command))
    app.command("y")(lambda: None)
    result = CliRunner().invoke(app, ["x"])
    assert result.exit_code == EXIT_EXTERNAL
    assert "pip install 'peft>=0.13'" in result.output and "bug in coordexp" not in result.output


def test_pyproject_carries_every_extra_of_the_table_and_peft_in_the_base_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    for dep in deps.DEPENDENCIES:
        if dep.extra is not None:
            assert dep.requirement in extras[dep.extra], dep
    assert "peft>=0.13" in project["dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert all(f"`{extra}`" in readme for extra in {d.extra for d in deps.DEPENDENCIES if d.extra})
    assert "huggingface-cli" not in readme and "hf download" in readme


# ------------------------------------------------------------------------------------- the commands, hidden


HIDE = """import atexit, sys
for name in {hidden!r}:
    sys.modules[name] = None
atexit.register(lambda: print("MODEL_LIBRARY_IMPORTED", "transformers.models" in sys.modules, file=sys.stderr))
from coordexp.cli.app import main
main({argv!r})
"""


def run_hidden(hidden: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE.format(hidden=hidden, argv=argv)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.fixture()
def lora_config(write_config, tmp_path):
    return write_config({"tuner": {"train_type": "lora"}, "training": {"output_dir": str(tmp_path / "lora_run")}})


def test_validate_warns_about_a_missing_package(lora_config, monkeypatch):
    from coordexp.cli.app import app

    monkeypatch.setitem(sys.modules, "peft", None)
    result = CliRunner().invoke(app, ["validate", str(lora_config)])
    assert result.exit_code == 0, result.output
    assert "not installed" in result.output and "pip install 'peft>=0.13'" in result.output
    result = CliRunner().invoke(app, ["validate", str(lora_config), "--json"])
    assert json.loads(result.stdout)[0]["missing_packages"][0]["package"] == "peft"


@pytest.mark.slow
def test_train_of_a_lora_config_without_peft_exits_3_before_any_model_loads(lora_config):
    done = run_hidden(["peft"], ["train", str(lora_config)])
    assert done.returncode == EXIT_EXTERNAL, done.stderr
    assert "pip install 'peft>=0.13'" in done.stderr and "bug in coordexp" not in done.stderr
    assert "MODEL_LIBRARY_IMPORTED False" in done.stderr  # refused before a model class was even imported
    assert not (lora_config.parent / "lora_run").exists()


@pytest.mark.slow
def test_serve_rollout_without_fastapi_exits_3(write_config):
    config = write_config({})
    done = run_hidden(["fastapi", "uvicorn"], ["serve-rollout", str(config), "--engine", "hf", "--port", "0"])
    assert done.returncode == EXIT_EXTERNAL, done.stderr
    assert "pip install 'coordexp[server]'" in done.stderr and "loading" not in done.stderr
    assert "MODEL_LIBRARY_IMPORTED False" in done.stderr


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device", "runs/x/checkpoint-4/model.safetensors"),
    RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on "
                 "device\" })"),
])
def test_a_full_disk_is_exit_3_saying_what_was_kept(error, capsys):
    """Regression (issue 56, item 23): a full disk under output_dir ended as exit 1, 'a bug in coordexp'."""
    from coordexp.cli.frame import guarded

    app = typer.Typer()

    def command() -> None:
        raise error

    app.command("x")(guarded(command))
    app.command("y")(lambda: None)
    result = CliRunner().invoke(app, ["x"])
    assert result.exit_code == EXIT_EXTERNAL, result.output
    text = " ".join(result.output.split())
    assert "disk is full" in text and "kept" in text and "bug in coordexp" not in text


def test_every_report_to_value_transformers_accepts_names_its_package(monkeypatch):
    """Issue 55, item 6: `report_to: [wandb]` without wandb passed validation and ended as 'internal error ... a bug
    in coordexp'; every value is in the table now (kubeflow needs no package), refused before the model loads."""
    from coordexp.schema.hf_training_fields import REPORT_TO_CHOICES

    assert set(REPORT_TO_CHOICES) - set(deps.REPORT_TO_MODULES) == {"kubeflow"}
    for target, module in deps.REPORT_TO_MODULES.items():
        monkeypatch.setitem(sys.modules, module, None)
        found = deps.missing_for(fake_run(training__report_to=[target]))
        assert [d.module for d, _ in found][:1] == [module] and target in found[0][1]
    with pytest.raises(MissingDependencyError, match="wandb") as caught:
        deps.require_installed(fake_run(training__report_to=["wandb"]))
    assert "pip install 'wandb'" in caught.value.hint
