"""ms-swift plugin: ``swift rollout --external_plugins /path/to/swift_plugin.py`` gets coordexp's repeat guard.

For users who keep ms-swift's rollout server. At import (by path, as ms-swift does it, in the main process and
every engine worker) the plugin reads the FULL ``rollout_matching.repeat_terminate`` subtree from
``COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON`` (a JSON object) or ``..._JSON_PATH`` (a file), validated by the
coordexp schema (config first), and installs the same vLLM V1 batch logits processor that ``coordexp
serve-rollout`` and colocate use (:mod:`coordexp.runtime.rollout.vllm_repeat`: per-row repeat trackers, the offending row is
forced to EOS, other rows continue) into every ``VllmEngine`` ms-swift builds. An enabled guard that cannot be
activated (ms-swift or vLLM missing, bad JSON) fails at start-up with the reason, never silently off.
Imported as ``coordexp.integrations.swift_plugin`` (tests, tools) nothing is activated; call :func:`install`.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from coordexp.errors import ExternalSystemError
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.schema.rollout import RepeatTerminateConfig

__all__ = ["CONFIG_JSON_ENV", "CONFIG_PATH_ENV", "PluginError", "load_repeat_config", "patch_engine_class",
           "install", "END_OF_TURN_TOKEN"]

CONFIG_JSON_ENV = "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON"
CONFIG_PATH_ENV = "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON_PATH"
END_OF_TURN_TOKEN = "<|im_end|>"
SWIFT_ENGINE_MODULES = ("swift.llm.infer.infer_engine.vllm_engine", "swift.llm")  # ms-swift 3.x
logger = logging.getLogger("coordexp.swift_plugin")


class PluginError(ExternalSystemError, RuntimeError):
    """The repeat guard is required by the config but cannot be activated; the message says why and how to fix."""


def load_repeat_config(environ: Mapping[str, str] = os.environ) -> RepeatTerminateConfig | None:
    """The ``repeat_terminate`` subtree from the environment (None when neither variable is set).

    Accepts the subtree itself or a mapping that holds it under ``repeat_terminate`` (or
    ``rollout_matching.repeat_terminate``); an optional ``eos_token_id`` key is allowed next to the subtree."""
    raw, source = environ.get(CONFIG_JSON_ENV), CONFIG_JSON_ENV
    path = environ.get(CONFIG_PATH_ENV)
    if raw and path:
        raise PluginError(f"both {CONFIG_JSON_ENV} and {CONFIG_PATH_ENV} are set; set only one of them")
    if path:
        try:
            raw, source = Path(path).read_text(encoding="utf-8"), f"{CONFIG_PATH_ENV}={path}"
        except OSError as exc:
            raise PluginError(f"{CONFIG_PATH_ENV}={path} cannot be read ({exc}); point it to the JSON file of "
                              "rollout_matching.repeat_terminate") from None
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise PluginError(f"{source} is not valid JSON ({exc}); it must hold the repeat_terminate mapping, e.g. "
                          '{"enabled": true, "min_new_tokens": 256, ...}') from None
    data = _subtree(data)
    data.pop("eos_token_id", None)
    try:
        return RepeatTerminateConfig.model_validate(data)
    except ValueError as exc:
        raise PluginError(f"{source}: invalid repeat_terminate config: {exc}") from None


def _subtree(data: Any) -> dict:
    if isinstance(data, dict) and isinstance(data.get("rollout_matching"), dict):
        data = data["rollout_matching"]
    if isinstance(data, dict) and isinstance(data.get("repeat_terminate"), dict):
        data = data["repeat_terminate"]
    if not isinstance(data, dict):
        raise PluginError(f"the repeat_terminate config must be a JSON object, got {type(data).__name__}")
    return dict(data)


def _eos_id_from(environ: Mapping[str, str]) -> int | None:
    raw = environ.get(CONFIG_JSON_ENV) or (Path(environ[CONFIG_PATH_ENV]).read_text(encoding="utf-8")
                                          if environ.get(CONFIG_PATH_ENV) else None)
    value = json.loads(raw).get("eos_token_id") if raw else None
    return int(value) if value is not None else None


def patch_engine_class(engine_class: type, guard: RepeatGuard, *, eos_token_id: int | None = None,
                       environ: Any = os.environ) -> None:
    """Make ``engine_class._prepare_engine_kwargs`` (ms-swift ``VllmEngine``) install the coordexp logits processor
    and hand it its settings (through the env var vLLM's processor reads). Idempotent."""
    from coordexp.runtime.rollout.vllm_repeat import GUARD_ENV, PROCESSOR_QUALNAME, ProcessorSettings, encode_settings

    original = getattr(engine_class, "_prepare_engine_kwargs", None)
    if original is None:
        raise PluginError(f"{engine_class.__module__}.{engine_class.__name__} has no _prepare_engine_kwargs; this "
                          "ms-swift version is not supported by the coordexp plugin (use ms-swift 3.10, or coordexp "
                          "serve-rollout which has the repeat guard built in)")
    if getattr(original, "_coordexp_patched", False):
        return

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine_kwargs = original(self, *args, **kwargs)
        processors = list(engine_kwargs.get("logits_processors") or [])
        if PROCESSOR_QUALNAME not in processors:
            processors.append(PROCESSOR_QUALNAME)
        engine_kwargs["logits_processors"] = processors
        eos = eos_token_id if eos_token_id is not None else _resolve_eos(self)
        environ[GUARD_ENV] = encode_settings(ProcessorSettings(guard=guard, eos_token_id=eos))
        return engine_kwargs

    prepare._coordexp_patched = True  # type: ignore[attr-defined]
    engine_class._prepare_engine_kwargs = prepare


def _resolve_eos(engine: Any) -> int:
    tokenizer = getattr(engine, "tokenizer", None) or getattr(getattr(engine, "processor", None), "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        raise PluginError(f"the tokenizer has no {END_OF_TURN_TOKEN} token; add \"eos_token_id\" to {CONFIG_JSON_ENV}")
    return int(token_id)


def install(environ: Any = os.environ, *, import_module: Any = importlib.import_module) -> bool:
    """Activate the guard per the environment. Returns False when there is nothing to activate (no config, or
    ``enabled: false``); raises :class:`PluginError` when an enabled guard cannot be activated."""
    config = load_repeat_config(environ)
    if config is None or not config.enabled:
        logger.info("coordexp swift plugin: repeat_terminate not enabled (%s / %s); nothing installed",
                    CONFIG_JSON_ENV, CONFIG_PATH_ENV)
        return False
    guard = RepeatGuard.from_config(config)
    try:
        import_module("vllm")
    except ImportError as exc:
        raise PluginError(f"repeat_terminate is enabled but vLLM cannot be imported ({exc}); the plugin runs inside "
                          "`swift rollout` with vLLM installed") from None
    engine_class = None
    for name in SWIFT_ENGINE_MODULES:
        try:
            engine_class = getattr(import_module(name), "VllmEngine", None)
        except ImportError:
            continue
        if engine_class is not None:
            break
    if engine_class is None:
        raise PluginError("repeat_terminate is enabled but ms-swift's VllmEngine cannot be imported; this plugin is "
                          "for `swift rollout --external_plugins <path>` (pip install ms-swift==3.10.*). With "
                          "`coordexp serve-rollout` the repeat guard is built in and no plugin is needed")
    patch_engine_class(engine_class, guard, eos_token_id=_eos_id_from(environ), environ=environ)
    logger.info("coordexp swift plugin: repeat guard installed into %s.VllmEngine (%s)", engine_class.__module__, guard)
    return True


if __name__ != "coordexp.integrations.swift_plugin":  # loaded by path: swift rollout --external_plugins <file>
    install()
