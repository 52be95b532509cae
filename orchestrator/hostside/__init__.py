"""What runs on the hosts: standard-library programs deployctl sends there (hosts have python3, not deployctl).

- the table operations, shipped as one zipapp (bundle.py, `python3 deployctl-tables.pyz OP`):
  engram_stage.py (Engram rows onto NVMe), ple_write.py (the PLE file), with their pure helpers
  geometry.py, ple_layout.py, safetensors.py, bulkcopy.py, which the controller imports too;
- modelsync.py: sync-model's manifest/verify script, sent on stdin (`python3 -c BOOTSTRAP`);
- ship_agent.py (with image_layers.py prepended) run on the head, ship_relay.py run on each worker.

Modules here import only the standard library, `orchestrator.errors` and `orchestrator.fsutil`.
"""
