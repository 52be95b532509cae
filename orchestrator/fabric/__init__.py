"""The fabric between the hosts: which netdev carries NCCL on each host (detect.py, pure), and the check
that proves every link before launch (check.py: facts, pings, iperf3/perftest per pair, verdicts), plus
the netplan files that configure it (netplan.py). docs/fabric.md."""
