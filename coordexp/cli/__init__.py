"""Typer command-line interface; wires schema and runtime together."""
