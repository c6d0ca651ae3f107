"""Dotted-path access to raw config mappings, shared by the ``migrate`` modules."""

from __future__ import annotations

from typing import Any

__all__ = ["ABSENT", "split", "get", "pop"]

ABSENT = object()


def split(dotted: str) -> list[str]:
    return dotted.split(".")


def get(data: dict, dotted: str, default: Any = ABSENT) -> Any:
    node: Any = data
    for part in split(dotted):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def pop(data: dict, dotted: str) -> Any:
    parts = split(dotted)
    trail = [data]
    for part in parts[:-1]:
        nxt = trail[-1].get(part) if isinstance(trail[-1], dict) else None
        if not isinstance(nxt, dict):
            return ABSENT
        trail.append(nxt)
    value = trail[-1].pop(parts[-1], ABSENT)
    for depth in range(len(parts) - 1, 0, -1):  # drop mappings the move left empty
        if not trail[depth]:
            del trail[depth - 1][parts[depth - 1]]
        else:
            break
    return value
