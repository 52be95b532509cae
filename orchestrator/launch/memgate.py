"""The launch memory gate, pure (no executors, so preflight can judge it while planning stays
free of paramiko/docker): the script run before a container starts and the verdict on its output.
launch/containers.py `memory_gate` runs it on a host."""
from __future__ import annotations

# Before a container starts on a host (boot 10's launch/dsv41-tp4.sh): $1 = "1" to drop the page
# cache first (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root or through passwordless sudo; else
# one "drop: skipped ..." line), $2 = a folder to create ("" = none). Then the MemAvailable line.
MEMGATE_SH = (
    'if [ "$1" = 1 ]; then sync; '
    'if [ "$(id -u)" = 0 ]; then '
    '  if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then echo "drop: done"; '
    '  else echo "drop: skipped (root, but /proc/sys/vm/drop_caches is not writable here)"; fi; '
    'elif sudo -n true 2>/dev/null; then '
    '  if echo 3 | sudo -n tee /proc/sys/vm/drop_caches >/dev/null 2>&1; then echo "drop: done (sudo)"; '
    '  else echo "drop: skipped (sudo tee /proc/sys/vm/drop_caches failed)"; fi; '
    'else echo "drop: skipped (not root and no passwordless sudo on this host)"; fi; fi; '
    'if [ -n "$2" ]; then mkdir -p -- "$2" || exit 5; fi; '
    'grep "^MemAvailable:" /proc/meminfo')

GIB = 1 << 30


def memgate_argv(drop: bool, mkdir: str = "") -> list[str]:
    return ["sh", "-c", MEMGATE_SH, "sh", "1" if drop else "0", mkdir]


def mem_available_kib(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise ValueError("no MemAvailable line in /proc/meminfo")


def memgate_verdict(host: str, mem_available_kib_: int, min_gib: float) -> tuple[bool, str]:
    """(ok, message): MemAvailable against the recipe's engine.min_mem_available_gib."""
    avail = mem_available_kib_ * 1024 / GIB
    if min_gib and avail < min_gib:
        return False, (f"{host}: MemAvailable {avail:.1f} GiB < {min_gib:g} GiB "
                       f"(engine.min_mem_available_gib), refusing to start the engine there: free memory "
                       f"on {host} (other containers, processes, caches) or lower the threshold")
    return True, f"MemAvailable {avail:.1f} GiB" + (f" >= {min_gib:g} GiB" if min_gib else "")
