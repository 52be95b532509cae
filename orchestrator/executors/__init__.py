"""Executors: the only code that touches the world (SSH, Docker, Ansible)."""
