"""The rollout server (``coordexp serve-rollout``): ms-swift v3.10 wire protocol, engine protocol, FastAPI app.

Import the submodules directly; this package imports nothing heavy (the client uses :mod:`.protocol` only).
"""
