"""Adapters that plug coordexp pieces into third-party tools (ms-swift); each imports its tool lazily."""
