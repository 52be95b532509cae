"""sync-model: every node gets the exact checkpoint (the stage is orchestrator/stages/sync_model.py).

  settings.py  options, timeouts, cache paths          manifest.py  Manifest, Verdict (pure)
  rsync.py     the head's rsync argv, output parsing   progress.py  bytes / rate / ETA per worker
  remote.py    running things over SSH                 (the stdlib script run on hosts: hostside/modelsync.py)
  push.py      model.source: head (default)            shared.py    model.source: shared

"Exact" means: every file of the head's checkpoint folder (links followed) is on the worker with
the same relative path, size and sha256. Hashes are cached per host in nvme_dir/.deployctl/modelsync/
keyed by size + mtime + ctime + inode, so a re-run on a synced cluster reads no file content and
finishes in seconds; `--rehash` ignores the caches. Files on a worker that the head lacks are
reported, never deleted (the folder may be a user's plain folder).

HF cache layout: the head's snapshots/REV holds links into ../../blobs; workers get regular files
(rsync --copy-links), a self-contained snapshot folder that works when only that folder is mounted.

What a real cluster needs (source: head): rsync >= 3.2.3 and python3 on every node; ON THE HEAD a
private key whose public half is in every worker's authorized_keys for the inventory user, and a
known_hosts file holding the workers' host keys under the inventory addresses (collect with
`ssh-keyscan ADDR` on the head, compare fingerprints). By default the inventory's key and
known_hosts paths are used on the head too (true on the test cluster, whose hosts share one
filesystem, and when deployctl runs on the head); otherwise pass --head-key / --head-known-hosts.
Workers are reached at their inventory addresses, so the copy takes that network.
"""
