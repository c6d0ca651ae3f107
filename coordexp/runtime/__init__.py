"""Runtime: one module per concern (tokens, parsing, matching, targets, losses, packing, telemetry, ...).

Runtime modules import ``coordexp.schema`` contracts only, never ``coordexp.cli``.
"""
