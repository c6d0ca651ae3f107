"""A real uvicorn rollout server whose engine sleeps in generate (health during inference, shutdown while busy, a
rendezvous with no learner).

Usage: python _slow_server.py MODEL_DIR IMAGE_ROOT DELAY_S [MAX_MODEL_LEN [SYNC_TIMEOUT_MAX_S]]; prints the ready
line with the port it bound. Each output's ids are (request index, seed % 100000), so the client can check order
and seeds.
"""

from __future__ import annotations

import sys
import time

import torch

from coordexp.runtime.model.encoding import load_processor
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.server.app import create_app
from coordexp.runtime.server.rendezvous import RendezvousPolicy
from coordexp.runtime.server.serve import bind_socket, serve
from coordexp.schema.rollout import RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig


class SlowEngine:
    """Sleeps ``delay_s`` per generate call; ``calls`` counts them (tests read it in process)."""

    engine_type = "SlowEngine"
    world_size = 2
    supports_adapter = False
    device = torch.device("cpu")
    repeat_terminate = RepeatTerminateConfig()

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.calls = 0

    def generate(self, requests, params):
        self.calls += 1
        time.sleep(self.delay_s)
        return [RolloutOutput(tuple(r.prompt.input_ids.tolist()), (r.index, r.seed % 100000), f"r{r.index}", "stop")
                for r in requests]

    def load_weights(self, named_tensors):
        list(named_tensors)

    def load_adapter(self, lora_int_id, peft_config, named_tensors):
        raise NotImplementedError

    def reset_caches(self):
        return True

    def close(self):
        pass


if __name__ == "__main__":
    model_dir, image_root, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    max_model_len = int(sys.argv[4]) if len(sys.argv) > 4 else None
    sync_cap = float(sys.argv[5]) if len(sys.argv) > 5 else 240.0
    template = TemplateConfig(max_pixels=12544, min_pixels=3136)
    app = create_app(SlowEngine(delay), load_processor(model_dir), template, image_root=image_root,
                     max_model_len=max_model_len,
                     policy=RendezvousPolicy.resolve(http_host="127.0.0.1", max_timeout_s=sync_cap))
    serve(app, bind_socket("127.0.0.1", 0), log_level="info")
