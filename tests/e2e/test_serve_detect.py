"""The README's serving example end to end: a tiny model trained a few steps on one image, served with
``coordexp serve-rollout --checkpoint RUN --engine hf``, answers ``POST /detect/`` for its training image with pixel
boxes and scores; a request without a system message gets the config's system prompt; no access log by default."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from coordexp.runtime.server.serve import READY_PREFIX
from testkit import read_until_ready

REPO = Path(__file__).resolve().parents[2]
STEPS = 80  # 40 already writes a valid object (30 did not); 80 keeps a margin
pytestmark = pytest.mark.slow


def test_a_trained_tiny_detector_answers_detect_with_pixel_boxes(tmp_path, tiny_model_dir):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "data", n_train=1, n_val=0, seed=7, min_objects=1, max_objects=1)
    config = tmp_path / "stage1.yaml"
    config.write_text(yaml.safe_dump({
        "extends": str(REPO / "examples" / "stage1_cpu.yaml"), "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": STEPS, "per_device_train_batch_size": 1,
                     "learning_rate": 0.002, "save_strategy": "no", "eval_strategy": "no", "logging_steps": 40}}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    trained = subprocess.run([sys.executable, "-m", "coordexp", "train", str(config)], capture_output=True, text=True,
                             timeout=900, env=env, cwd=REPO)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "Loading weights" not in trained.stderr and "Writing model shards" not in trained.stderr
    mask = os.umask(0)
    os.umask(mask)  # the saved weights are readable as any file this process writes (safetensors wrote 0600)
    assert stat.S_IMODE((tmp_path / "run" / "model.safetensors").stat().st_mode) == 0o666 & ~mask

    record = json.loads(data.train_jsonl.read_text(encoding="utf-8").splitlines()[0])
    server = subprocess.Popen([sys.executable, "-m", "coordexp", "serve-rollout", str(config), "--checkpoint",
                               str(tmp_path / "run"), "--engine", "hf", "--port", "0", "--image-root", str(data.root)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        url, lines = read_until_ready(server, READY_PREFIX, 300)
        reply = httpx.post(f"{url}/detect/", json={"image": record["images"][0], "decoding": {"max_tokens": 64}},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["objects"], body
        for obj in body["objects"]:
            assert obj["desc"] and len(obj["bbox_2d"]) == 4 and 0 < obj["score"] <= 1
            x1, y1, x2, y2 = obj["bbox_2d"]
            assert 0 <= x1 <= x2 <= record["width"] and 0 <= y1 <= y2 <= record["height"]
        assert body["parse"]["image_size"] == [record["width"], record["height"]] and body["text"].startswith("{")
        # the swift protocol without a system message: the config's system prompt (the one the model was trained on)
        infer = httpx.post(f"{url}/infer/", json={"infer_requests": [{
            "messages": [{"role": "user", "content": "<image>Detect every object in the image."}],
            "images": [record["images"][0]]}], "request_config": {"max_tokens": 4, "return_details": True}},
            timeout=120).json()
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(str(tmp_path / "run")).decode(infer[0]["response"]["prompt_token_ids"])
        assert "You are a visual detector" in prompt
        time.sleep(1.0)  # the reader thread has every line the server printed for these requests
        assert not [line for line in lines if "POST /detect/" in line]  # no access log without --verbose
    finally:
        server.terminate()
        server.wait(timeout=60)
