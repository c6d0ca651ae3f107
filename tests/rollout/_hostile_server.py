"""A real uvicorn rollout server for the hostile-rendezvous tests: the instant engine of ``tests/server/_slow_server.py``
(no model weights), loopback, and the weight-sync token from ``COORDEXP_SYNC_TOKEN`` when set.

Usage: python _hostile_server.py MODEL_DIR IMAGE_ROOT; prints the ready line with the port it bound."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from _slow_server import SlowEngine  # noqa: E402

from coordexp.runtime.model.encoding import load_processor  # noqa: E402
from coordexp.runtime.server.app import create_app  # noqa: E402
from coordexp.runtime.server.rendezvous import TOKEN_ENV, RendezvousPolicy  # noqa: E402
from coordexp.runtime.server.serve import bind_socket, serve  # noqa: E402
from coordexp.schema.template import TemplateConfig  # noqa: E402

if __name__ == "__main__":
    model_dir, image_root = sys.argv[1], sys.argv[2]
    policy = RendezvousPolicy.resolve(http_host="127.0.0.1", token=os.environ.get(TOKEN_ENV), max_timeout_s=60.0)
    app = create_app(SlowEngine(0.0), load_processor(model_dir), TemplateConfig(max_pixels=12544, min_pixels=3136),
                     image_root=image_root, policy=policy)
    serve(app, bind_socket("127.0.0.1", 0), log_level="info")
