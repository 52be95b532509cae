"""Chain distribution: the head sends each byte once, every node forwards to the next while it receives.

route.py (pure): the chain's order and the address each hop connects to (the fabric's, else the
management network's, said in the plan). run.py: one pass over SSH-started nodes
(hostside/chain_node.py), with progress and per-node outcomes. gather.py: the per-host threads of a
stage meet there, and one chain runs for all of them.
"""
