"""Schema behaviour: spec defaults, strict scalars, unknown keys at every depth, cross-field rules, warnings."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.schema.loader import validate_config_file, validate_mapping
from coordexp.schema.root import CoordExpConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _set(data: dict, dotted: str, value) -> dict:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


def _errors(data: dict) -> dict[str, str]:
    report = validate_mapping(data)
    return {i.path: f"{i.message} | {i.hint}" for i in report.errors}


def test_examples_exist_and_validate():
    names = {p.name for p in EXAMPLES}
    assert {"stage2_colocate_4gpu.yaml", "stage2_server_3v1.yaml", "stage2_cpu_hf.yaml", "stage1_sft.yaml"} <= names
    for path in EXAMPLES:
        report = validate_config_file(path)
        assert report.ok, (path, [i.render() for i in report.errors])
        assert report.warnings == (), (path, report.warnings)


def test_spec_defaults(stage2_config):
    cfg = validate_mapping(stage2_config).config
    rm = cfg.rollout_matching
    assert (rm.rollout_backend, rm.decode_batch_size, rm.vllm.mode) == ("vllm", 1, "colocate")
    assert (rm.vllm.gpu_memory_utilization, rm.vllm.tensor_parallel_size) == (0.45, 4)
    assert (rm.vllm.sync.mode, rm.vllm.sync.fallback_to_full) == ("full", True)
    assert (rm.decoding.temperature, rm.decoding.top_p, rm.decoding.top_k, rm.decoding.num_beams) == (0.0, 1.0, -1, 1)
    assert rm.decoding.repetition_penalty == 1.0
    m = rm.matching
    assert (m.candidate_top_k, m.maskiou_gate, m.maskiou_resolution, m.fp_cost, m.fn_cost) == (10, 0.3, 256, 1.0, 1.0)
    assert (rm.ot.cost, rm.ot.epsilon, rm.ot.iters) == ("l2", 10.0, 30)
    assert (rm.offload.enabled, rm.offload.offload_model, rm.offload.offload_optimizer) == (False, False, False)
    assert cfg.custom.object_field_order == "desc_first"


def test_server_defaults(stage2_config):
    _set(stage2_config, "rollout_matching.vllm", {"mode": "server", "server": {"servers": [
        {"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}})
    server = validate_mapping(stage2_config).config.rollout_matching.vllm.server
    assert (server.timeout_s, server.infer_timeout_s) == (240.0, None)


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("rollout_matching.decode_batch_size", "4", "without quotes"),
        ("rollout_matching.repeat_terminate.enabled", "yes", "true or false"),
        ("training.packing", 1, "valid boolean"),
        ("global_max_length", 2048.0, "valid integer"),
        ("rollout_matching.decoding.top_k", "5", "valid integer"),
        ("model.path", 123, "valid string"),
    ],
)
def test_scalars_are_strict(stage2_config, path, value, needle):
    errors = _errors(_set(stage2_config, path, value))
    assert list(errors) == [path]
    assert needle in errors[path]


def test_yaml_yes_is_a_string_not_a_bool(stage2_config, write_yaml):
    text = write_yaml(stage2_config).read_text() + "\n"
    path = write_yaml(text.replace("output_dir: runs/test", "output_dir: runs/test\n  packing: yes"))
    report = validate_config_file(path)
    assert [i.path for i in report.errors] == ["training.packing"]
    assert "got 'yes'" in report.errors[0].message


@pytest.mark.parametrize(
    "loc",
    [
        ("zz_top",),
        ("model", "zz_model"),
        ("training", "zz"),
        ("rollout_matching", "unknown_rollout_key"),
        ("rollout_matching", "decoding", "unknown_decoding_key"),
        ("rollout_matching", "vllm", "sync", "zz"),
        ("rollout_matching", "pipeline", "objective", 0, "zz"),
        ("rollout_matching", "pipeline", "objective", 1, "config", "zz"),
        ("rollout_matching", "pipeline", "diagnostics", 0, "config", "zz"),
    ],
)
def test_unknown_keys_fail_with_exact_path(stage2_config, loc):
    node = stage2_config
    for part in loc[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[loc[-1]] = 1
    errors = _errors(stage2_config)
    expected = ".".join(str(p) for p in loc).replace(".0.", "[0].").replace(".1.", "[1].")
    assert list(errors) == [expected]
    assert errors[expected].startswith("unknown key")


def test_unknown_server_flag_names_list_index(stage2_config):
    _set(stage2_config, "rollout_matching.vllm", {"mode": "server", "server": {"servers": [
        {"base_url": "http://a:8000", "group_port": 1},
        {"base_url": "http://b:8000", "group_port": 2, "unknown_flag": True}]}})
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.vllm.server.servers[1].unknown_flag"]
    assert "Allowed keys here: base_url, group_port" in errors["rollout_matching.vllm.server.servers[1].unknown_flag"]


def test_typo_gets_a_suggestion(stage2_config):
    _set(stage2_config, "rollout_matching.decoding.temprature", 0.5)
    assert "Did you mean 'temperature'?" in _errors(stage2_config)["rollout_matching.decoding.temprature"]


def test_all_errors_are_collected(stage2_config):
    _set(stage2_config, "training.zz", 1)
    _set(stage2_config, "model.dtype", "fp8")
    _set(stage2_config, "rollout_matching.decoding.top_p", 0.0)
    _set(stage2_config, "rollout_matching.matching.maskiou_gate", 2.0)
    assert set(_errors(stage2_config)) == {
        "training.zz", "model.dtype", "rollout_matching.decoding.top_p", "rollout_matching.matching.maskiou_gate"}


@pytest.mark.parametrize(
    ("updates", "path", "needle"),
    [
        ({"rollout_matching.vllm.sync": {"mode": "adapter"}}, "rollout_matching.vllm.sync.mode", "enable_lora: true"),
        ({"training.packing": True, "training.packing_drop_last": False}, "training.packing_drop_last",
         "requires packing_drop_last: true"),
        ({"rollout_matching.vllm.max_model_len": 1024}, "rollout_matching.vllm.max_model_len",
         "must be >= global_max_length (2048)"),
        ({"rollout_matching.vllm.max_model_len": 4096, "rollout_matching.max_new_tokens": 4096},
         "rollout_matching.max_new_tokens", "must be < vllm.max_model_len (4096)"),
        ({"rollout_matching.decoding.num_beams": 4}, "rollout_matching.decoding.num_beams", "rollout_backend: hf"),
        ({"rollout_matching.decoding.top_k": 0}, "rollout_matching.decoding.top_k", "-1 (disabled) or >= 1"),
        ({"rollout_matching.decoding.temperature": -0.1}, "rollout_matching.decoding.temperature", "greater than"),
        ({"rollout_matching.decoding.repetition_penalty": 0.0}, "rollout_matching.decoding.repetition_penalty",
         "greater than or equal to 0.01"),
        ({"rollout_matching.vllm.mode": "server"}, "rollout_matching.vllm.server", "needs vllm.server.servers"),
        ({"rollout_matching.offload.enabled": True}, "rollout_matching.offload.enabled", "nothing moves"),
        ({"template.max_length": 4096}, "template.max_length", "exceeds global_max_length"),
        ({"template.min_pixels": 10_000_000}, "template.min_pixels", "larger than max_pixels"),
    ],
)
def test_cross_field_rules(stage2_config, updates, path, needle):
    for dotted, value in updates.items():
        _set(stage2_config, dotted, value)
    errors = _errors(stage2_config)
    assert list(errors) == [path], errors
    assert needle in errors[path]


def test_adapter_sync_is_fine_with_lora(stage2_config):
    _set(stage2_config, "rollout_matching.vllm", {"enable_lora": True, "sync": {"mode": "adapter"}})
    assert validate_mapping(stage2_config).ok


def test_beam_search_is_fine_with_hf(stage2_config):
    _set(stage2_config, "rollout_matching.rollout_backend", "hf")
    _set(stage2_config, "rollout_matching.decoding.num_beams", 4)
    assert validate_mapping(stage2_config).ok


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("127.0.0.1:8000", "http:// or https://"),
        ("ftp://host:21", "http:// or https://"),
        ("http://", "with a host"),
        ("http://0.0.0.0:8000", "bind address"),
        ("http://host:99999", "invalid port"),
    ],
)
def test_server_urls_are_checked(stage2_config, url, needle):
    _set(stage2_config, "rollout_matching.vllm", {"mode": "server", "server": {"servers": [
        {"base_url": url, "group_port": 51216}]}})
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.vllm.server.servers[0].base_url"]
    assert needle in errors["rollout_matching.vllm.server.servers[0].base_url"]


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_group_port_range(stage2_config, port):
    _set(stage2_config, "rollout_matching.vllm", {"mode": "server", "server": {"servers": [
        {"base_url": "http://h:1", "group_port": port}]}})
    assert list(_errors(stage2_config)) == ["rollout_matching.vllm.server.servers[0].group_port"]


def test_servers_must_be_non_empty_and_distinct(stage2_config):
    _set(stage2_config, "rollout_matching.vllm", {"mode": "server", "server": {"servers": []}})
    assert list(_errors(stage2_config)) == ["rollout_matching.vllm.server.servers"]
    entry = {"base_url": "http://h:1", "group_port": 5}
    _set(stage2_config, "rollout_matching.vllm.server.servers", [entry, {**entry, "base_url": "http://h:1/"}])
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.vllm.server.servers[1].base_url"]
    assert "duplicate server" in errors["rollout_matching.vllm.server.servers[1].base_url"]


@pytest.mark.parametrize("variant", ["stage2_rollout_aligned", "stage1_sft"])
def test_pipeline_is_required(stage2_config, variant):
    del stage2_config["rollout_matching"]["pipeline"]
    _set(stage2_config, "custom.trainer_variant", variant)
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.pipeline"]
    assert f"rollout_matching.pipeline is required when custom.trainer_variant={variant}" in errors[
        "rollout_matching.pipeline"]


def test_pipeline_module_config_must_be_complete(stage2_config):
    del stage2_config["rollout_matching"]["pipeline"]["objective"][1]["config"]["w1_weight"]
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.pipeline.objective[1].config.w1_weight"]
    assert errors["rollout_matching.pipeline.objective[1].config.w1_weight"].startswith("required key is missing")


def test_unknown_module_name(stage2_config):
    stage2_config["rollout_matching"]["pipeline"]["objective"][0]["name"] = "token_cee"
    errors = _errors(stage2_config)
    assert list(errors) == ["rollout_matching.pipeline.objective[0]"]
    assert "token_ce" in errors["rollout_matching.pipeline.objective[0]"]


def test_inert_module_warns_but_validates(stage2_config):
    stage2_config["rollout_matching"]["pipeline"]["objective"][2]["channels"] = ["A"]
    report = validate_mapping(stage2_config)
    assert report.ok
    assert [w.path for w in report.warnings] == ["rollout_matching.pipeline.objective[2].channels"]
    assert "inert" in report.warnings[0].message


def test_ignored_settings_warn(stage2_config):
    _set(stage2_config, "rollout_matching.rollout_backend", "hf")
    _set(stage2_config, "rollout_matching.vllm.tensor_parallel_size", 2)
    _set(stage2_config, "rollout_matching.offload", {"enabled": True, "offload_model": True})
    report = validate_mapping(stage2_config)
    assert report.ok
    assert [w.path for w in report.warnings] == ["rollout_matching.vllm", "rollout_matching.offload.enabled"]


def test_config_is_frozen(stage2_config):
    cfg = validate_mapping(stage2_config).config
    with pytest.raises(Exception, match="frozen"):
        cfg.rollout_matching.decode_batch_size = 3  # type: ignore[misc]


# -- property: any unknown key anywhere is reported at exactly its path ------------------------------------------

def _dict_nodes(node, path=()):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _dict_nodes(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _dict_nodes(value, (*path, i))


def _dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _complete(stage2: dict) -> dict:
    """Every key present (defaults dumped), server mode so vllm.server exists too."""
    data = copy.deepcopy(stage2)
    _set(data, "rollout_matching.vllm", {"mode": "server", "server": {"servers": [
        {"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}})
    return CoordExpConfig.model_validate(data).model_dump(mode="python")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.from_regex(r"zz_[a-z][a-z0-9_]{0,12}", fullmatch=True))
def test_random_unknown_key_is_reported_at_its_path(stage2_config, data, key):
    full = _complete(stage2_config)
    nodes = list(_dict_nodes(full))
    path, node = data.draw(st.sampled_from(nodes))
    node[key] = data.draw(st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none()))
    report = validate_mapping(full)
    assert [i.path for i in report.errors] == [_dotted((*path, key))]
    assert report.errors[0].message == "unknown key"


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(
        st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), st.integers(0, 999)), min_size=1, max_size=6
    ).filter(lambda p: isinstance(p[0], str))
)
def test_parse_path_inverts_format_path(parts):
    from coordexp.schema.errors import format_path, parse_path

    assert parse_path(format_path(parts)) == tuple(parts)


def test_parse_path_keeps_wildcard_indices_and_names():
    from coordexp.schema.errors import parse_path

    assert parse_path("a.objective[*].config.*") == ("a", "objective", "[*]", "config", "*")
    assert parse_path("m[0][12].x") == ("m", 0, 12, "x")
