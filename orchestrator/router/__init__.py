"""The one OpenAI endpoint in front of an inventory's deployments (all.vars.router; docs/router.md).

config.py   what the inventory says (pure)
layout.py   the router's container, files and the worker entry of a deployment (pure)
control.py  its side effects on the router host: image, container, registrations, status, removal
The router itself is the SGLang router (sglang-router, IGW mode); what runs beside it in its container,
registering the healthy deployments, is orchestrator/hostside/router_keeper.py.
"""
