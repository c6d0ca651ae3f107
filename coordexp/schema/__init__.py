"""Config spine: typed schema, YAML loader, legacy-key table and the normalised run contract.

Imports pydantic, PyYAML and the standard library only (never torch, transformers, vllm, or coordexp.runtime).
"""

from coordexp.schema.contract import (
    PackingContract,
    RolloutMatchingContract,
    RunContract,
    ServerEndpoint,
    VllmColocateContract,
    VllmServerContract,
    HfBackendContract,
    build_contract,
    load_contract,
)
from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.loader import ValidationReport, load_config, validate_config_file
from coordexp.schema.root import CoordExpConfig

__all__ = [
    "CoordExpConfig",
    "ConfigError",
    "ConfigIssue",
    "PackingContract",
    "RolloutMatchingContract",
    "RunContract",
    "ServerEndpoint",
    "ValidationReport",
    "HfBackendContract",
    "VllmColocateContract",
    "VllmServerContract",
    "build_contract",
    "load_config",
    "load_contract",
    "validate_config_file",
]
