"""Launching the engine: argv/env/container rendering (pure), fabric choice, and lifecycle."""
