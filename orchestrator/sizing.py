"""Memory budget per node: where every byte of the model goes, and whether it fits.

Pure (no I/O, plan layer). Inputs: the recipe (model facts, table geometry and placement,
engine args, its `sizing:` block) and the inventory (hosts, hardware kind). docs/sizing.md
explains the model; docs/deployment-facts.md "Sizing rules" is where it comes from.

Per node, one budget per resource, each a list of lines (name, GB = 1e9 bytes, source, and the
report's own figure where the recipe's `sizing.reference` gives one):

- unified memory (DGX Spark) / GPU memory (discrete GPUs): the engine's pool, i.e. its memory
  fraction (`gpu-memory-utilization`, `mem-fraction-static`) of the memory, holding the weights'
  share, resident tables, offload buffers, recurrent state and what is left for the KV cache; and
  beside the pool what the engine does not count (OS and page cache on a Spark, SGLang's
  activations). Without a fraction the KV cache is kv_bytes_per_token x context x concurrency.
- host RAM (discrete GPUs): pinned or pageable tables and the page cache of a table on NVMe;
  its capacity is measured by preflight (MemAvailable) unless the inventory declares host_ram_gb.
- NVMe: the node's staged table share (Engram rows incl. scales, or the PLE file) + margin;
  its capacity is measured by preflight (df).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .errors import InputError
from .hardware import KINDS, HardwareKind
from .hostside.geometry import rank_ranges, total_rows

GB = 1e9
GIB = float(2 ** 30)
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "E8M0": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}
# engine kind -> (engine.args key of its memory fraction, activations inside the fraction?)
# vLLM's gpu-memory-utilization bounds all the engine allocates (weights, activations, CUDA graphs,
# KV); SGLang's mem-fraction-static bounds weights and KV/state pools, activations come on top.
FRACTION = {"vllm": ("gpu-memory-utilization", True), "sglang": ("mem-fraction-static", False)}
CONTEXT_ARG = {"vllm": "max-model-len", "sglang": "context-length"}
UNIFIED, GPU, HOST_RAM, NVME = "unified memory", "GPU memory", "host RAM", "NVMe"
TABLE_LABEL = {"engram": "Engram tables", "ple": "PLE table"}
WHERE_TEXT = {"nvme": "on NVMe", "pinned": "in pinned host RAM", "memory": "in memory", "gpu": "in GPU memory"}


@dataclass(frozen=True)
class Line:
    key: str                  # weights, engram, ple, activations, buffers, recurrent, kv, os, page_cache, ...
    name: str
    gb: float
    source: str               # the recipe key or fact it comes from
    in_engine: bool = False   # inside the engine's memory fraction
    path: str = ""            # NVMe lines: the folder it lands in
    report: str = ""          # the report's own figure (recipe sizing.reference)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "name": self.name, "gb": round(self.gb, 2), "source": self.source}
        if self.in_engine:
            d["in_engine"] = True
        if self.path:
            d["path"] = self.path
        if self.report:
            d["report"] = self.report
        return d


@dataclass(frozen=True)
class Problem:
    host: str
    resource: str
    shortfall_gb: float
    message: str              # what does not fit, with the figures
    fix: str
    key: str = ""             # the recipe key to change

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "resource": self.resource, "shortfall_gb": round(self.shortfall_gb, 2),
                "message": self.message, "fix": self.fix, "key": self.key}


@dataclass(frozen=True)
class Budget:
    resource: str
    lines: tuple[Line, ...]
    capacity_gb: float | None             # None: measured by preflight
    capacity_source: str
    engine_gb: float | None = None        # the engine's pool (memory budgets)
    engine_source: str = ""
    kv_required_gb: float = 0.0
    problems: tuple[Problem, ...] = ()

    @property
    def total_gb(self) -> float:
        """What the resource must hold: the engine's pool (or what the engine needs, when more) + the rest."""
        return max(self.engine_gb or 0.0, self.engine_need_gb) + sum(ln.gb for ln in self.lines if not ln.in_engine)

    @property
    def engine_need_gb(self) -> float:
        """The engine's lines without the KV pool, plus the KV cache it must at least get."""
        return sum(ln.gb for ln in self.lines if ln.in_engine and ln.key != "kv") + self.kv_required_gb

    @property
    def headroom_gb(self) -> float | None:
        return None if self.capacity_gb is None else self.capacity_gb - self.total_gb

    def line_gb(self, key: str) -> float:
        return sum(ln.gb for ln in self.lines if ln.key == key)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"resource": self.resource, "capacity_gb": _r(self.capacity_gb),
                             "capacity_source": self.capacity_source,
                             "lines": [ln.to_json() for ln in self.lines],
                             "total_gb": _r(self.total_gb), "headroom_gb": _r(self.headroom_gb),
                             "fits": None if self.capacity_gb is None else not self.problems}
        if self.engine_gb is not None:
            d["engine_gb"], d["engine_source"] = _r(self.engine_gb), self.engine_source
        if self.kv_required_gb:
            d["kv_required_gb"] = _r(self.kv_required_gb)
        return d


@dataclass(frozen=True)
class NodeBudget:
    host: str
    rank: int
    hardware: str
    budgets: tuple[Budget, ...]

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(p for b in self.budgets for p in b.problems)

    def budget(self, resource: str) -> Budget | None:
        return next((b for b in self.budgets if b.resource == resource), None)

    def nvme_needs(self) -> list[tuple[str, float]]:
        """(folder, GB) the node's NVMe must have free: what preflight checks with df."""
        b = self.budget(NVME)
        out: dict[str, float] = {}
        for ln in b.lines if b else ():
            out[ln.path] = out.get(ln.path, 0.0) + ln.gb
        return list(out.items())

    def host_ram_need_gb(self) -> float:
        """Available host RAM (MemAvailable) the node needs besides the OS: what preflight checks."""
        b = self.budget(HOST_RAM)
        return b.total_gb if b else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "hardware": self.hardware, "fits": not self.problems,
                "budgets": [b.to_json() for b in self.budgets],
                "problems": [p.to_json() for p in self.problems]}


@dataclass(frozen=True)
class Sizing:
    recipe: str
    nodes: tuple[NodeBudget, ...]

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(p for n in self.nodes for p in n.problems)

    @property
    def fits(self) -> bool:
        return not self.problems

    def node(self, host: str) -> NodeBudget:
        return next(n for n in self.nodes if n.host == host)

    def refusal(self) -> str:
        return refusal([p.to_json() for p in self.problems])

    def to_json(self) -> dict[str, Any]:
        totals: dict[str, dict[str, Any]] = {}
        for n in self.nodes:
            for b in n.budgets:
                t = totals.setdefault(b.resource, {"need_gb": 0.0, "capacity_gb": 0.0})
                t["need_gb"] += b.total_gb
                t["capacity_gb"] = None if b.capacity_gb is None or t["capacity_gb"] is None \
                    else t["capacity_gb"] + b.capacity_gb
        for t in totals.values():
            t["need_gb"] = _r(t["need_gb"])
            t["capacity_gb"] = _r(t["capacity_gb"])
            t["headroom_gb"] = None if t["capacity_gb"] is None else _r(t["capacity_gb"] - t["need_gb"])
        return {"verdict": "fits" if self.fits else "does not fit", "fits": self.fits,
                "units": "GB = 10^9 bytes, per node", "recipe": self.recipe,
                "nodes": [n.to_json() for n in self.nodes], "totals": totals,
                "problems": [p.to_json() for p in self.problems], "text": render(self)}


def refusal(problems: list[dict[str, Any]]) -> str:
    """One line per problem (nodes with the same problem together): nodes, shortfall, fix."""
    groups: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        groups.setdefault((p["message"], p["fix"]), []).append(p["host"])
    return "\n".join(f"{', '.join(hosts)}: {msg}; fix: {fix}" for (msg, fix), hosts in groups.items())


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _g(x: float) -> str:
    return f"{x:.1f}"


# ---------------------------------------------------------------------------------------------
# Inputs read once per deployment (errors name the recipe key)

@dataclass(frozen=True)
class _Table:
    key: str                  # engram | ple
    placement: str
    total_gb: float           # the whole table, all ranks (offloaded from the checkpoint)
    rank_gb: tuple[float, ...]  # per TP rank (PLE: the whole table for every rank)
    row_bytes: int
    source: str
    page_cache_gb: float = 0.0      # PLE on NVMe: page-cache budget
    min_host_ram_gb: float = 0.0    # pinned/memory: available host RAM the table needs (incl. headroom)
    free_margin_gb: float = 0.0


@dataclass(frozen=True)
class _Inputs:
    file: str
    tp: int
    gpn: int
    weights_per_gpu: float
    weights_source: str
    tables: tuple[_Table, ...]
    fraction: float | None
    fraction_arg: str
    activations_inside: bool
    kv_required: float
    kv_source: str


def _dtype_bytes(dtype: str, file: str, key: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise InputError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})", file=file, key=key)
    return DTYPE_BYTES[dtype]


def _tables(r, file: str) -> list[_Table]:
    tp = r.parallelism.tensor_parallel
    out = []
    if r.engram is not None:
        e, g = r.engram, r.engram.geometry
        row = g.row_values * _dtype_bytes(g.dtype, file, "engram.geometry.dtype")
        if e.scale_tensor:
            row += e.scale_values_per_row * _dtype_bytes(e.scale_dtype, file, "engram.scale_dtype")
        ranks = tuple(sum(x.rows for x in rank_ranges(g, tp, k)) * row / GB for k in range(tp))
        out.append(_Table("engram", e.placement, total_rows(g) * row / GB, ranks, row,
                          f"engram.geometry: {total_rows(g):,} rows x {row} B (incl. scales), "
                          f"whole heads per rank", free_margin_gb=e.free_margin_gb))
    if r.ple is not None:
        p, g = r.ple, r.ple.geometry
        row = g.row_values * _dtype_bytes(g.dtype, file, "ple.geometry.dtype")
        total = total_rows(g) * row / GB
        out.append(_Table("ple", p.placement, total, (total,) * tp, row,
                          f"ple.geometry: {total_rows(g):,} rows x {row} B",
                          page_cache_gb=p.page_cache_budget_gib * GIB / GB,
                          min_host_ram_gb=p.min_host_ram_gb if p.placement == "pinned" else 0.0,
                          free_margin_gb=p.free_margin_gb))
    return out


def _inputs(dep) -> _Inputs:
    r, file = dep.recipe, str(dep.loaded.path)
    par, m, sz = r.parallelism, r.model, r.sizing
    tables = _tables(r, file)
    offloaded = sum(t.total_gb for t in tables)
    rest = m.checkpoint_gb - offloaded
    if m.checkpoint_gb <= 0 or rest < 0:
        raise InputError(f"model.checkpoint_gb is {m.checkpoint_gb:g} GB but the tables the geometry "
                         f"describes take {offloaded:.1f} GB: give the whole checkpoint's size "
                         "(tables included) or shrink the geometry", file=file, key="model.checkpoint_gb")
    weights_source = (f"model.checkpoint_gb {m.checkpoint_gb:g}" +
                      (f" - tables {offloaded:.1f}" if tables else "") +
                      f", / tensor_parallel {par.tensor_parallel}")
    arg, inside = FRACTION.get(r.engine.kind, ("", True))
    fraction = r.engine.args.get(arg) if arg else None
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise InputError(f"expected a fraction in (0, 1], got {fraction!r}", file=file,
                             key=f"engine.args.{arg}")
        fraction = float(fraction)
    ctx_arg = CONTEXT_ARG.get(r.engine.kind, "")
    context = r.engine.args.get(ctx_arg) or m.max_context
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise InputError(f"expected a token count, got {context!r}", file=file, key=f"engine.args.{ctx_arg}")
    kv_tokens = m.kv_bytes_per_token * context * sz.concurrency / GB
    kv_required = max(kv_tokens, sz.min_kv_gb)
    if m.kv_bytes_per_token:
        kv_source = (f"needs >= {_g(kv_required)} = max(sizing.min_kv_gb {sz.min_kv_gb:g}, model.kv_bytes_per_token "
                     f"{m.kv_bytes_per_token} x {ctx_arg or 'max_context'} {context} x sizing.concurrency "
                     f"{sz.concurrency} = {_g(kv_tokens)})")
    else:
        kv_source = f"needs >= sizing.min_kv_gb {sz.min_kv_gb:g} (the recipe gives no kv_bytes_per_token)"
    return _Inputs(file, par.tensor_parallel, par.gpus_per_node, rest / par.tensor_parallel, weights_source,
                   tuple(tables), fraction, arg, inside, kv_required, kv_source)


# ---------------------------------------------------------------------------------------------
# One node

def _where(kind: HardwareKind, placement: str) -> str:
    """engine (GPU or unified memory, inside the engine's pool), host (host RAM) or nvme."""
    if placement == "nvme":
        return "nvme"
    if kind.unified_memory or placement == "gpu":
        return "engine"
    return "host"


def _memory_budget(inp: _Inputs, sz, kind: HardwareKind, tables: list[tuple[_Table, float]],
                   ref: dict[str, str], host_ram_gb: float | None = None) -> Budget:
    """The unified pool (Spark) or one GPU's memory (discrete): engine pool + what sits beside it.
    A CPU host's pool is its RAM (HOST_RAM_GB when the inventory declares it)."""
    unified = kind.unified_memory
    cap = host_ram_gb if kind.ram_pool and host_ram_gb else kind.gpu_memory_gb
    frac_name = f"{inp.fraction_arg} {inp.fraction:g}" if inp.fraction is not None else ""
    lines = [Line("weights", "weights share", inp.weights_per_gpu * (inp.gpn if unified else 1),
                  inp.weights_source, True, report=ref.get("weights", ""))]
    offloaded = False
    for t, gb in tables:
        where = _where(kind, t.placement)
        if where == "engine":
            lines.append(Line(t.key, f"{TABLE_LABEL[t.key]}, rank share {WHERE_TEXT[t.placement]}", gb,
                              t.source + f"; {t.key}.placement {t.placement}", True, report=ref.get(t.key, "")))
        else:
            offloaded = True
    act = Line("activations", "activations, CUDA graphs, CUDA context", sz.activations_gb,
               "sizing.activations_gb" + (f" (inside {inp.fraction_arg})" if inp.activations_inside and frac_name
                                          else f" (beside {inp.fraction_arg})" if frac_name else ""),
               inp.activations_inside, report=ref.get("activations", ""))
    if offloaded:
        lines.append(Line("buffers", "offload staging buffers", sz.buffers_gb,
                          "sizing.buffers_gb (a table is offloaded)", True, report=ref.get("buffers", "")))
    if sz.recurrent_state_gb:
        lines.append(Line("recurrent", "recurrent-state pools", sz.recurrent_state_gb,
                          "sizing.recurrent_state_gb", True, report=ref.get("recurrent", "")))
    beside = []
    if inp.activations_inside:
        lines.append(act)
    else:
        beside.append(act)
    fixed = sum(ln.gb for ln in lines)
    if inp.fraction is not None:
        engine: float | None = inp.fraction * cap
        kv = engine - fixed
        kv_src = f"engine pool {_g(engine)} - the lines above; {inp.kv_source}"
        engine_src = f"engine.args.{frac_name} x {_g(cap)} GB"
    else:
        engine, kv = None, inp.kv_required
        kv_src, engine_src = inp.kv_source, ""
    lines.append(Line("kv", "KV cache pool", kv, kv_src, True, report=ref.get("kv", "")))
    if unified:
        beside.append(Line("os", "OS reserve", sz.os_reserve_gb, "sizing.os_reserve_gb (shares the pool)",
                           report=ref.get("os", "")))
        for t, _ in tables:
            if t.page_cache_gb and _where(kind, t.placement) == "nvme":
                beside.append(Line("page_cache", f"page cache for the {TABLE_LABEL[t.key]} on NVMe",
                                   t.page_cache_gb, f"{t.key}.page_cache_budget_gib (shares the pool)",
                                   report=ref.get("page_cache", "")))
    lines += beside
    if kind.ram_pool:
        cap_src = (f"host_ram_gb {_g(cap)} GB (the engine's CPU build: weights, KV cache and the OS share it)"
                   if host_ram_gb else f"hardware {kind.name}: {_g(cap)} GB of RAM assumed (declare host_ram_gb)")
    elif unified:
        cap_src = f"hardware {kind.name}: {_g(cap)} GB shared by CPU and GPU"
    else:
        cap_src = f"hardware {kind.name}: {_g(cap)} GB per GPU" + (f", budget of one of {inp.gpn}" if inp.gpn > 1 else "")
    return Budget(UNIFIED if unified else GPU, tuple(lines), cap, cap_src, engine, engine_src, inp.kv_required)


def _host_ram_budget(sz, host, tables: list[tuple[_Table, float]], kind: HardwareKind,
                     ref: dict[str, str]) -> Budget | None:
    lines = []
    for t, gb in tables:
        where = _where(kind, t.placement)
        if where == "host":
            lines.append(Line(t.key, f"{TABLE_LABEL[t.key]} {WHERE_TEXT[t.placement]}", gb, t.source,
                              report=ref.get(t.key, "")))
            if t.min_host_ram_gb > gb:
                lines.append(Line("host_ram", "pinning headroom", t.min_host_ram_gb - gb,
                                  f"{t.key}.min_host_ram_gb {t.min_host_ram_gb:g} - the table",
                                  report=ref.get("host_ram", "")))
        elif where == "nvme" and t.page_cache_gb:
            lines.append(Line("page_cache", f"page cache for the {TABLE_LABEL[t.key]} on NVMe", t.page_cache_gb,
                              f"{t.key}.page_cache_budget_gib", report=ref.get("page_cache", "")))
    if not lines:
        return None
    if host.host_ram_gb is not None:
        cap: float | None = host.host_ram_gb - sz.os_reserve_gb
        cap_src = f"inventory host_ram_gb {host.host_ram_gb:g} - sizing.os_reserve_gb {sz.os_reserve_gb:g}"
    else:
        cap, cap_src = None, "measured by preflight (MemAvailable)"
    return Budget(HOST_RAM, tuple(lines), cap, cap_src)


def _nvme_budget(dep, host, tables: list[tuple[_Table, float]], ref: dict[str, str]) -> Budget | None:
    lines = []
    for t, gb in tables:
        if t.placement != "nvme":
            continue
        folder = dep.engram_dir(host) if t.key == "engram" else dep.ple_dir(host)
        what = "Engram rows + scales of this node's ranks" if t.key == "engram" else "PLE file"
        lines.append(Line(t.key, what, gb, t.source, path=folder, report=ref.get("nvme", "")))
        lines.append(Line("margin", "free-space margin", t.free_margin_gb, f"{t.key}.free_margin_gb", path=folder))
    if not lines:
        return None
    return Budget(NVME, tuple(lines), None, "measured by preflight (df on the folder's filesystem)")


def _node(dep, inp: _Inputs, host, placements: dict[str, str]) -> NodeBudget:
    r = dep.recipe
    kind = KINDS[host.hardware]
    sz, ref = r.sizing, r.sizing.reference
    ranks = range(host.rank * inp.gpn, (host.rank + 1) * inp.gpn)
    node_tables, gpu_tables = [], []
    for t in inp.tables:
        t = replace(t, placement=placements.get(t.key, t.placement))
        shares = [t.rank_gb[k] for k in ranks if k < len(t.rank_gb)]
        node_tables.append((t, sum(shares) if t.key == "engram" else t.total_gb))
        gpu_tables.append((t, sum(shares) if kind.unified_memory and t.key == "engram"
                           else max(shares, default=0.0)))
    mem = _memory_budget(inp, sz, kind, gpu_tables, ref, host.host_ram_gb)
    budgets = [mem]
    if not kind.unified_memory:
        ram = _host_ram_budget(sz, host, node_tables, kind, ref)
        if ram:
            budgets.append(ram)
    nvme = _nvme_budget(dep, host, node_tables, ref)
    if nvme:
        budgets.append(nvme)
    return NodeBudget(host.name, host.rank, host.hardware, tuple(budgets))


# ---------------------------------------------------------------------------------------------
# Verdicts and fixes

def _memory_shortfall(b: Budget) -> tuple[float, float]:
    """(short of the capacity, short of the engine's pool) for a memory budget."""
    short_pool = b.engine_need_gb - b.engine_gb if b.engine_gb is not None else 0.0
    return b.total_gb - (b.capacity_gb or 0.0), short_pool


def _fits_memory(n: NodeBudget) -> bool:
    return all(max(_memory_shortfall(b)) <= 0 for b in n.budgets if b.resource in (UNIFIED, GPU)) and \
        all(b.capacity_gb is None or b.headroom_gb >= 0 for b in n.budgets if b.resource == HOST_RAM)


def _placement_fix(dep, inp: _Inputs, host, placements: dict[str, str]) -> tuple[str, str] | None:
    """The first placement change (in the hardware kind's order) that makes this node fit."""
    kind = KINDS[host.hardware]
    for t in inp.tables:
        current = placements.get(t.key, t.placement)
        for alt in kind.placements:
            if alt == current or (alt == "pinned" and kind.unified_memory) or \
                    _where(kind, alt) == _where(kind, current):
                continue
            trial = _node(dep, inp, host, {**placements, t.key: alt})
            if _fits_memory(trial):
                return (f"put the {TABLE_LABEL[t.key]} {WHERE_TEXT[alt]}: --set {t.key}.placement={alt}",
                        f"{t.key}.placement")
    return None


def _problems(dep, inp: _Inputs, host, n: NodeBudget) -> NodeBudget:
    placement_fix: tuple[str, str] | None | bool = False      # False: not computed yet
    out = []
    for b in n.budgets:
        probs: list[Problem] = []
        if b.resource in (UNIFIED, GPU):
            short_cap, short_pool = _memory_shortfall(b)
            if short_cap <= 0 and short_pool <= 0:
                out.append(b)
                continue
            if placement_fix is False:
                placement_fix = _placement_fix(dep, inp, host, {})
            cap, need = b.capacity_gb or 0.0, b.engine_need_gb
            beside = b.total_gb - max(b.engine_gb or 0.0, need)
            if short_cap > 0:
                msg = f"{b.resource} needs {_g(b.total_gb)} GB of {_g(cap)} GB (short by {_g(short_cap)} GB)"
            else:
                msg = (f"{b.resource}: {b.engine_source} gives the engine {_g(b.engine_gb or 0)} GB, it needs "
                       f"{_g(need)} GB incl. >= {_g(b.kv_required_gb)} GB KV cache (short by {_g(short_pool)} GB)")
            arg = f"engine.args.{inp.fraction_arg}"
            if placement_fix:
                fix, key = placement_fix
            elif inp.fraction is not None and need + beside <= cap:
                if short_pool > 0:
                    fix = f"raise the engine's memory fraction: --set {arg}={math.ceil(need / cap * 100) / 100:g}"
                else:           # the fraction leaves too little beside the engine (OS, page cache)
                    fix = (f"lower the engine's memory fraction: --set "
                           f"{arg}={math.floor((cap - beside) / cap * 100) / 100:g}")
                key = arg
            else:
                fix = ("shorten the context or lower sizing.concurrency, offload a table, or use more "
                       "nodes (a larger tensor_parallel)")
                key = "parallelism.tensor_parallel"
            probs.append(Problem(n.host, b.resource, short_cap if short_cap > 0 else short_pool, msg, fix, key))
        elif b.resource == HOST_RAM and b.capacity_gb is not None and (b.headroom_gb or 0) < 0:
            probs.append(host_ram_problem(n.host, b.total_gb, b.capacity_gb, b.capacity_source))
        out.append(replace(b, problems=tuple(probs)))
    return replace(n, budgets=tuple(out))


def host_ram_problem(host: str, need_gb: float, available_gb: float, measured: str) -> Problem:
    """The host-RAM shortfall message plan (declared RAM) and preflight (MemAvailable) both give."""
    short = need_gb - available_gb
    return Problem(host, HOST_RAM, short,
                   f"host RAM: {_g(available_gb)} GB available ({measured}), short by {_g(short)} GB",
                   f"needs >= {_g(need_gb)} GB available host RAM for the pinned table (free memory on "
                   "the host, or --set ple.placement=nvme)", "ple.placement")


def nvme_problem(host: str, folder: str, need_gb: float, free_gb: float, fs: str) -> Problem:
    """The NVMe shortfall message of preflight."""
    short = need_gb - free_gb
    return Problem(host, NVME, short,
                   f"NVMe: {_g(free_gb)} GB free on {fs} for {folder}, short by {_g(short)} GB",
                   f"needs {_g(need_gb)} GB free on {folder} (free space there, or point nvme_dir at a "
                   "larger disk)", "nvme_dir")


# ---------------------------------------------------------------------------------------------
# Entry points

def size(dep) -> Sizing:
    """The budget of every node of the deployment, with its problems and fixes."""
    inp = _inputs(dep)
    nodes = tuple(_problems(dep, inp, h, _node(dep, inp, h, {})) for h in dep.cluster.hosts)
    return Sizing(dep.recipe.name, nodes)


def plan_extra(dep) -> dict[str, Any]:
    return {"sizing": size(dep).to_json()}


def require_fit(dep) -> None:
    """InputError (exit 2) naming node, shortfall and fix unless every node fits."""
    s = size(dep)
    if s.fits:
        return
    key = s.problems[0].key
    raise InputError(f"recipe {s.recipe} does not fit ({len({p.host for p in s.problems})} node(s)); "
                     f"`deployctl plan` shows the budget:\n{s.refusal()}", file=str(dep.loaded.path), key=key)


# ---------------------------------------------------------------------------------------------
# The table `plan` prints

def _hosts_label(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 2 else f"{names[0]}..{names[-1]}"


def render(s: Sizing) -> str:
    """Per resource, one row per budget line and one column per group of nodes with equal figures."""
    out = [f"sizing ({s.recipe}; GB = 10^9 bytes, per node): {'FITS' if s.fits else 'DOES NOT FIT'}"]
    resources: list[str] = []
    for n in s.nodes:
        resources += [b.resource for b in n.budgets if b.resource not in resources]
    for res in resources:
        groups: dict[tuple, list[NodeBudget]] = {}
        for n in s.nodes:
            b = n.budget(res)
            if b is not None:
                sig = tuple(_g(ln.gb) for ln in b.lines) + (_g(b.total_gb), b.capacity_gb)
                groups.setdefault(sig, []).append(n)
        first = groups[next(iter(groups))][0].budget(res)
        assert first is not None
        cols = [(_hosts_label([n.host for n in ns]), [n.budget(res) for n in ns][0]) for ns in groups.values()]
        widths = [max(8, len(label)) for label, _ in cols]
        head = res + (f", folder {first.lines[0].path}" if res == NVME else "")
        head += (f" (capacity {_g(first.capacity_gb)} GB: {first.capacity_source})"
                 if first.capacity_gb is not None else f" (capacity {first.capacity_source})")
        out.append(head)
        namew = 44

        def row(name: str, values: list[str], note: str = "") -> str:
            cells = "  ".join(v.rjust(w) for v, w in zip(values, widths))
            return f"  {name.ljust(namew)}{cells}" + (f"  {note}" if note else "")

        out.append(row("", [label for label, _ in cols], "source"))
        for i, ln in enumerate(first.lines):
            note = ln.source + (f"; report: {ln.report}" if ln.report else "")
            out.append(row(ln.name, [_g(b.lines[i].gb) for _, b in cols], note))
            last_inside = ln.in_engine and (i + 1 == len(first.lines) or not first.lines[i + 1].in_engine)
            if last_inside and first.engine_gb is not None:
                out.append(row("= engine pool", [_g(b.engine_gb or 0) for _, b in cols], first.engine_source))
        out.append(row("total", [_g(b.total_gb) for _, b in cols]))
        if first.capacity_gb is not None:
            out.append(row("headroom", [_g(b.headroom_gb or 0) for _, b in cols]))
    if s.fits:
        out.append("verdict: fits")
    else:
        out.append("verdict: DOES NOT FIT")
        out += ["  " + line for line in s.refusal().splitlines()]
    return "\n".join(out)
