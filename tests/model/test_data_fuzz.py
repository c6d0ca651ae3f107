"""Mutated JSONL (issue 15 item 3): ``load_records`` either raises the dataset error with ``file:line`` for every
problem, or returns records that pass every later stage (prompt encoding with the tiny processor, the GT target)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.serialize import loads_coord_json
from coordexp.runtime.model.data import DatasetError, load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample
from coordexp.schema.contract import load_contract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"

HOSTILE_VALUES = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["<|coord_5|>", "<|im_end|>", "a<|x|>b", "~nosuchuser/a.png", "img\x00.png", "x" * 300, "",
                     "\x1b[2J", "\\", '"', "}, {", "\u2028", "\ud800", "<|coord_1000|>", " <|coord_7|> "]),
    st.booleans(),
    st.none(),
    st.lists(st.integers(min_value=-5, max_value=1005), max_size=8),
    st.dictionaries(st.sampled_from(["desc", "bbox_2d", "poly", "x"]), st.integers(0, 999), max_size=3),
)
RAW_SNIPPETS = st.sampled_from([b"\xe9", b"\x00", b"[" * 2000, b"9" * 5000, b"1e30", b"-", b"\n", b'"', b"{", b"}",
                                b"<|im_end|>", b"NaN", b"\xef\xbb\xbf", b"\\u0000", b"\xff\xfe", b" "])


def _paths(value, prefix=()):
    """Every (path, leaf-or-container) position of a JSON value, so a mutation can target any field."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _set(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _set(value[head], rest, new)}
    return [(_set(item, rest, new) if i == head else item) for i, item in enumerate(value)]


@st.composite
def mutated_lines(draw, base_records):
    """1-3 JSONL lines from valid records, each possibly mutated structurally (a field replaced or deleted) and/or at
    the byte level (a hostile snippet inserted, or bytes replaced/deleted)."""
    lines = []
    for _ in range(draw(st.integers(1, 2))):
        record = draw(st.sampled_from(base_records))
        kind = draw(st.sampled_from(["none", "desc", "coord", "replace", "delete", "bytes", "both"]))
        objects = [p for p in _paths(record) if len(p) == 3 and p[0] == "objects" and p[2] in ("desc", "bbox_2d", "poly")]
        if kind == "desc" and objects:  # arbitrary text in a desc: the value most likely to reach later stages
            path = draw(st.sampled_from([p for p in objects if p[2] == "desc"]))
            record = _set(record, path, draw(st.text(min_size=1, max_size=20) | HOSTILE_VALUES))
        if kind == "coord" and objects:  # any in-range value or token form in a coord slot
            path = draw(st.sampled_from([p for p in _paths(record) if len(p) == 4 and p[0] == "objects"]))
            record = _set(record, path, draw(st.integers(0, 999) | st.integers(0, 1001).map("<|coord_{}|>".format)
                                             | HOSTILE_VALUES))
        if kind in ("replace", "both"):
            path = draw(st.sampled_from(list(_paths(record))))
            record = _set(record, path, draw(HOSTILE_VALUES))
        if kind == "delete":
            path = draw(st.sampled_from([p for p in _paths(record) if p and isinstance(p[-1], str)]))
            parent = path[:-1]
            container = record
            for key in parent:
                container = container[key]
            record = _set(record, parent, {k: v for k, v in container.items() if k != path[-1]})
        line = json.dumps(record, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
        if kind in ("bytes", "both"):
            at = draw(st.integers(0, len(line)))
            cut = draw(st.integers(0, 3))
            line = line[:at] + draw(RAW_SNIPPETS) + line[at + cut:]
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def base_records(synthetic_dataset):
    """The synthetic records with absolute image paths (so the fuzzed file can live anywhere)."""
    out = []
    for line in synthetic_dataset.train_jsonl.read_text(encoding="utf-8").splitlines()[:4]:
        record = json.loads(line)
        record["images"] = [str((synthetic_dataset.root / p).resolve()) for p in record["images"]]
        out.append(record)
    return out


@pytest.fixture(scope="module")
def ctx(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@settings(max_examples=int(os.environ.get("COORDEXP_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_jsonl_fails_with_file_line_or_passes_every_stage(data, base_records, ctx):
    lines = data.draw(mutated_lines(base_records))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        n_lines = path.read_bytes().count(b"\n")
        try:
            records = load_records(path)
        except DatasetError as error:
            assert error.exit_code == 2
            for problem in error.problems:
                match = re.match(rf"{re.escape(str(path))}:(\d+): \S", problem)
                if match is None:  # the only file-level problem a mutation can cause: every line blank
                    assert problem == f"{path}: contains no records; write one JSON object per line", problem
                else:
                    assert 1 <= int(match.group(1)) <= n_lines, problem
            return
        for record in records:  # accepted: every later stage must take it
            prompt = encode_prompt(ctx.processor, record, ctx.template)
            sample = build_gt_sample(record, prompt, ctx)
            text = ctx.tokenizer.decode(list(sample.target.ids[:-1]), skip_special_tokens=False)
            parsed = loads_coord_json(text)
            assert len(parsed) == len(record.objects)
            assert [o["desc"] for o in parsed.values()] == [o.desc for o in record.objects]


@pytest.mark.parametrize("desc", ["\ud800", "\u2028x", "a\\b", 'q"uote', "\x00", "\x1b[2J", "   x", "日本語", "😀",
                                  "<|", "|>", "a" * 500, "object_1", '"}, "object_9": {"desc": "x', "\t\n", "\r"])
def test_edge_descs_fail_at_load_or_pass_every_stage(tmp_path, base_records, ctx, desc):
    record = json.loads(json.dumps(next(r for r in base_records if r["objects"])))
    record["objects"][0]["desc"] = desc
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    try:
        (loaded,) = load_records(path)
    except DatasetError as error:
        assert all(p.startswith(f"{path}:1: objects[0].desc: ") for p in error.problems), error.problems
        return
    sample = build_gt_sample(loaded, encode_prompt(ctx.processor, loaded, ctx.template), ctx)
    text = ctx.tokenizer.decode(list(sample.target.ids[:-1]), skip_special_tokens=False)
    assert list(loads_coord_json(text).values())[0]["desc"] == loaded.objects[0].desc
