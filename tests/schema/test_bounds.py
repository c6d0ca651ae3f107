"""Every number in the schema is finite and bounded by what the runtime can hold (issue 12 item 3, issue 15 item 2):
each refused value exits 2 from ``coordexp validate`` naming its dotted path; whatever validates builds a contract
whose numbers the runtime can use."""

from __future__ import annotations

import copy
import json
import math
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.contract import build_contract
from coordexp.schema.loader import load_merged, validate_mapping

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
INF, NAN = float("inf"), float("nan")

_RM = "rollout_matching"
_COORD = f"{_RM}.pipeline.objective[1].config"

# (dotted path, value, extra settings the case needs): every value named in issue 12 "Why" item 3 and issue 15
# item 2, plus their nan/-inf and just-beyond-the-range siblings.
REFUSED = [
    ("training.learning_rate", INF, {}),
    ("training.learning_rate", NAN, {}),
    ("training.weight_decay", INF, {}),
    ("training.max_grad_norm", INF, {}),
    ("training.num_train_epochs", INF, {}),
    (f"{_RM}.pipeline.objective[0].weight", INF, {}),
    (f"{_RM}.pipeline.objective[2].config.ciou_weight", INF, {}),
    (f"{_COORD}.soft_ce_weight", NAN, {}),
    (f"{_COORD}.temperature", INF, {}),
    (f"{_COORD}.target_sigma", INF, {}),
    (f"{_COORD}.target_truncate", INF, {}),
    (f"{_RM}.decoding.temperature", INF, {}),
    (f"{_RM}.decoding.temperature", NAN, {}),
    (f"{_RM}.decoding.top_p", NAN, {}),
    (f"{_RM}.decoding.repetition_penalty", INF, {}),
    (f"{_RM}.ot.epsilon", INF, {}),
    (f"{_RM}.matching.fp_cost", INF, {}),
    (f"{_RM}.matching.maskiou_gate", NAN, {}),
    ("training.seed", 2**64, {}),
    ("training.seed", 2**32, {}),
    ("training.per_device_train_batch_size", 2**64, {}),
    ("training.gradient_accumulation_steps", 2**64, {}),
    ("training.max_steps", 2**64, {}),
    ("training.packing_buffer", 10**30, {}),
    ("global_max_length", 10**30, {}),
    (f"{_RM}.max_new_tokens", 10**30, {}),
    (f"{_RM}.max_new_tokens", 1e30, {}),  # issue 15: validated, then `train` hung
    (f"{_RM}.decode_batch_size", 10**30, {}),
    ("template.max_pixels", 10**30, {}),
    (f"{_RM}.decoding.top_k", 10**30, {}),
    (f"{_RM}.decoding.num_beams", 10**6, {f"{_RM}.rollout_backend": "hf"}),
    (f"{_RM}.vllm.tensor_parallel_size", 10**30, {}),
    (f"{_RM}.vllm.gpu_memory_utilization", 1.5, {}),
    (f"{_RM}.vllm.gpu_memory_utilization", 0.0, {}),
    (f"{_RM}.vllm.gpu_memory_utilization", NAN, {}),
    (f"{_RM}.vllm.max_model_len", 10**30, {}),
    (f"{_RM}.repeat_terminate.ngram_size", 10**30, {}),
    (f"{_RM}.hf_generate.draft_tokens", 0, {}),
    (f"{_RM}.hf_generate.draft_tokens", 65, {}),
    (f"{_RM}.hf_generate.label_drafts", "sometimes", {}),
    (f"{_RM}.repeat_unlikelihood.weight", INF, {f"{_RM}.repeats": "unlikelihood"}),
    (f"{_RM}.repeat_unlikelihood.band", 101, {f"{_RM}.repeats": "unlikelihood"}),
    (f"{_RM}.repeats", "unlike", {}),
    (f"{_RM}.vllm.server.timeout_s", INF, {f"{_RM}.vllm.mode": "server", f"{_RM}.vllm.server.servers":
                                           [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}),
    ("training.output_dir", "runs/\x00evil", {}),
    ("data.train_jsonl", "data/\x00.jsonl", {}),
    ("model.path", "./model\x00", {}),
    # binding decision 6: HF beam search cannot sample; refused at validation, not after the model loaded
    (f"{_RM}.decoding.num_beams", 2, {f"{_RM}.rollout_backend": "hf", f"{_RM}.decoding.temperature": 0.7}),
]


def _tokens(dotted: str) -> list:
    out = []
    for piece in dotted.split("."):
        name, _, index = piece.partition("[")
        out.append(name)
        if index:
            out.append(int(index.rstrip("]")))
    return out


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = _tokens(dotted)
    node = data
    for part in parents:
        node = node[part] if isinstance(part, int) else node.setdefault(part, {})
    node[last] = value


def _cli_errors(tmp_path: Path, data: dict) -> tuple[int, list[dict]]:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    result = runner.invoke(app, ["validate", "--json", str(path)], catch_exceptions=False)
    (item,) = json.loads(result.stdout)
    return result.exit_code, item["errors"]


@pytest.mark.parametrize(("dotted", "value", "extra"), REFUSED, ids=lambda v: repr(v)[:40])
def test_out_of_range_value_exits_2_naming_its_path(stage2_config, tmp_path, dotted, value, extra):
    for key, setting in extra.items():
        _set(stage2_config, key, setting)
    code, errors = _cli_errors(tmp_path, stage2_config)
    assert code == 0, errors  # the case's own settings are valid: the value below is what gets refused
    _set(stage2_config, dotted, value)
    code, errors = _cli_errors(tmp_path, stage2_config)
    assert code == 2
    assert dotted in [e["path"] for e in errors], errors


def test_nul_byte_in_a_path_prints_escaped_and_names_the_path(stage2_config, tmp_path):
    stage2_config["training"]["output_dir"] = "runs/\x00x"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(stage2_config), encoding="utf-8")
    result = runner.invoke(app, ["validate", str(path)], catch_exceptions=False)
    assert result.exit_code == 2 and "training.output_dir" in result.output and "NUL" in result.output


@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("training.seed", 2**32 - 1),  # the largest seed numpy takes
        (f"{_RM}.max_new_tokens", 1_000_000),
        (f"{_RM}.decoding.top_k", 50),
        (f"{_RM}.decoding.top_k", -1),
        (f"{_RM}.vllm.gpu_memory_utilization", 1.0),
        ("training.weight_decay", 0.0),
    ],
)
def test_large_but_sane_values_still_validate(stage2_config, dotted, value):
    _set(stage2_config, dotted, value)
    report = validate_mapping(stage2_config)
    assert report.ok, [e.render() for e in report.errors]


def test_hf_beam_search_without_sampling_and_vllm_sampling_stay_valid(stage2_config):
    rm = stage2_config[_RM]
    rm.update(rollout_backend="hf", decoding={"num_beams": 4, "temperature": 0.0})
    assert validate_mapping(stage2_config).ok
    rm.update(rollout_backend="vllm", decoding={"num_beams": 1, "temperature": 0.7})
    assert validate_mapping(stage2_config).ok


# --- generated configs ---------------------------------------------------------------------------------------

def _numeric_leaves(node, path=()) -> list[tuple]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _numeric_leaves(v, (*path, k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _numeric_leaves(v, (*path, i))]
    return [path] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


EXAMPLE_DATA = [load_merged(p).data for p in sorted((REPO / "examples").glob("*.yaml"))]
EXAMPLE_LEAVES = [_numeric_leaves(d) for d in EXAMPLE_DATA]

EXTREMES = st.one_of(
    st.sampled_from([INF, -INF, NAN, 0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63, 2**64, 10**30, 1e30,
                     1e308, 1e-300, -0.0, 0.5, 1.0, 999]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)

_LENGTHS = {"global_max_length", "max_new_tokens", "max_model_len", "max_length", "min_new_tokens", "ngram_size",
            "max_consecutive_token_repeats"}


def _dump_leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _dump_leaves(v, (*path, k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _dump_leaves(v, (*path, i))
    else:
        yield path, node


def _assert_runtime_can_hold(config) -> None:
    """Independent runtime facts, not the schema's own table: RNGs take the seed, ints fit int64, floats are
    finite, lengths are at most 2**20 tokens, timeouts fit a thread wait."""
    random.Random(config.training.seed)
    np.random.RandomState(config.training.seed)
    for path, value in _dump_leaves(config.model_dump()):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        where = ".".join(map(str, path))
        if isinstance(value, float):
            assert math.isfinite(value), where
        if isinstance(value, int):
            assert -(2**63) <= value < 2**63, where
        if path[-1] in _LENGTHS:
            assert value <= 1_048_576, where
        if path[-1].endswith("timeout_s"):
            assert value <= threading.TIMEOUT_MAX, where


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_extreme_configs_are_refused_with_a_path_or_hold(data):
    which = data.draw(st.integers(0, len(EXAMPLE_DATA) - 1))
    config = copy.deepcopy(EXAMPLE_DATA[which])
    leaves = EXAMPLE_LEAVES[which]
    mutated = data.draw(st.lists(st.sampled_from(leaves), min_size=1, max_size=3, unique=True))
    for path in mutated:
        node = config
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = data.draw(EXTREMES)
    report = validate_mapping(config)
    if not report.ok:
        assert all(e.path for e in report.errors), [e.render() for e in report.errors]
        return
    contract = build_contract(report.config)
    json.dumps(contract.to_dict(), allow_nan=False)  # every number in the contract is finite
    _assert_runtime_can_hold(report.config)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_extreme_configs_through_the_cli_exit_0_or_2(tmp_path, data):
    config = copy.deepcopy(EXAMPLE_DATA[0])
    path = data.draw(st.sampled_from(EXAMPLE_LEAVES[0]))
    node = config
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = data.draw(EXTREMES)
    code, errors = _cli_errors(tmp_path, config)
    assert code in (0, 2)
    assert (code == 2) == bool(errors) and all(e["path"] for e in errors)


# --- every numeric field, present and future -------------------------------------------------------------------

def _constraints(annotation) -> list:
    """Constraint objects of an annotation, through Optional/Union and nested Annotated."""
    import typing

    from pydantic.fields import FieldInfo

    found = []
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        for extra in args[1:]:
            found += list(extra.metadata) if isinstance(extra, FieldInfo) else [extra]
        return found + _constraints(args[0])
    if origin is typing.Union:
        return [c for member in args for c in _constraints(member)]
    return found


def _numeric_fields(model, prefix=""):
    import typing

    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        pending, kinds = [info.annotation], set()
        while pending:
            current = pending.pop()
            origin, args = typing.get_origin(current), typing.get_args(current)
            if origin is typing.Annotated:
                pending.append(args[0])
            elif origin in (typing.Union, list) or str(origin) == "<class 'types.UnionType'>":
                pending.extend(args)
            elif isinstance(current, type) and issubclass(current, BaseModel):
                yield from _numeric_fields(current, f"{prefix}{name}.")
            elif current in (int, float):
                kinds.add(current)
        if kinds:
            yield f"{prefix}{name}", kinds, [*info.metadata, *_constraints(info.annotation)]


def _all_numeric_fields():
    from coordexp.schema.pipeline import BboxGeoModule, CoordDiagModule, CoordRegModule, TokenCeModule
    from coordexp.schema.root import CoordExpConfig

    for model in (CoordExpConfig, TokenCeModule, CoordRegModule, BboxGeoModule, CoordDiagModule):
        yield from _numeric_fields(model, f"{model.__name__}:")


def test_every_numeric_field_has_both_bounds_and_floats_refuse_inf_and_nan():
    fields = list(_all_numeric_fields())
    assert len(fields) > 50  # the walk reaches the nested sections and the pipeline modules
    problems = []
    for path, kinds, constraints in fields:
        names = {type(c).__name__ for c in constraints}
        if not names & {"Ge", "Gt"} or not names & {"Le", "Lt"}:
            problems.append(f"{path}: needs a lower and an upper bound")
        if float in kinds and not any(getattr(c, "allow_inf_nan", None) is False for c in constraints):
            problems.append(f"{path}: float must refuse inf/nan")
    assert problems == []
