"""Image chains: a serving image built as a chain of steps described as data (dockerfiles/chains/).

- spec.py     the chain and lock file schemas, loading (for a head's architecture), variables, checks of the inputs
- wheelhouse.py  the sha256-pinned wheels of a chain, a lock section per architecture, fetched on the controller
- digest.py   content hashing of inputs and the per-step digest (pure given contents + parent ID)
- context.py  build-context and upload tars (the same file walk the digest hashes)
- builder.py  runs a chain against a Docker SDK client: cache lookup, build, checks, verification
- lock.py     `--update-lock`: re-resolving the base tag to a digest

Planning imports only spec.py; the builder gets its engine client from executors/docker_engine.py.
"""
