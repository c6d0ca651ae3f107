"""The per-sample token cap (issue 23 item 5): ``template.max_length`` or ``global_max_length`` holds for every
teacher-forced sample, packed or not. Packing refused an over-long segment; stage 1 without packing trained a
2,501-token ``desc`` under a 1,024 cap. ``encode_teacher_forced(max_length=...)`` now refuses it (exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.errors import EXIT_INVALID, exit_code_for
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import (
    SampleLengthError,
    check_sample_length,
    encode_prompt,
    encode_teacher_forced,
)
from coordexp.schema.contract import build_contract
from coordexp.schema.loader import validate_mapping
from coordexp.schema.template import TemplateConfig
from testkit import REPO, STAGE2_CONFIG

TEMPLATE = TemplateConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


def test_check_sample_length_names_the_record_both_lengths_and_the_fix():
    check_sample_length("a.jsonl:3", 1024, 1024)  # at the cap: fine
    with pytest.raises(SampleLengthError) as caught:
        check_sample_length("a.jsonl:3", 2501, 1024)
    text = str(caught.value) + caught.value.hint
    assert exit_code_for(caught.value) == EXIT_INVALID
    assert "a.jsonl:3" in text and "2501 tokens" in text and "1024" in text and "global_max_length" in text


def test_encode_teacher_forced_refuses_a_sample_over_the_cap(tiny_processor, synthetic_dataset):
    record = load_records(synthetic_dataset.train_jsonl)[0]
    prompt = encode_prompt(tiny_processor, record, TEMPLATE)
    response = [5] * 100
    total = prompt.prompt_len + len(response)
    sample = encode_teacher_forced(tiny_processor, record, TEMPLATE, response, prompt=prompt, max_length=total)
    assert sample.input_ids.numel() == total
    with pytest.raises(SampleLengthError, match=f"{total} tokens"):
        encode_teacher_forced(tiny_processor, record, TEMPLATE, response, prompt=prompt, max_length=total - 1)
    assert encode_teacher_forced(tiny_processor, record, TEMPLATE, response, prompt=prompt).input_ids.numel() == total


@pytest.mark.parametrize("template_max, expected", [(None, 2048), (512, 512)])
def test_the_contract_resolves_the_cap(template_max, expected):
    data = json.loads(json.dumps(STAGE2_CONFIG))
    if template_max is not None:
        data["template"] = {"max_length": template_max}
    assert build_contract(validate_mapping(data).config).sample_max_length == expected


@pytest.mark.slow
def test_stage1_without_packing_refuses_a_sample_over_global_max_length(tmp_path, tiny_model_dir, synthetic_dataset):
    records = [json.loads(line) for line in synthetic_dataset.train_jsonl.read_text().splitlines() if line.strip()]
    record = records[0]
    record["images"] = [str((synthetic_dataset.train_jsonl.parent / p).resolve()) for p in record["images"]]
    record["objects"] = [{"desc": "x" * 2501, "bbox_2d": [10, 10, 200, 200]}]  # 2,501 tokens (tiny tokenizer)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps(record) + "\n")
    config = {
        "extends": str(REPO / "examples" / "demo_stage1.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "per_device_train_batch_size": 1,
                     "packing": False},
    }
    path = tmp_path / "stage1.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == EXIT_INVALID, result.output
    assert "over the cap of 1024" in " ".join(result.output.split())
