"""Human renderings of plans (stdout): one block per stage, one line per host, then its command."""
from __future__ import annotations

import json
import shlex

from rich.console import Console
from rich.markup import escape

from ..plan import Plan


def print_plan(plan: Plan, verbose: int = 0, console: Console | None = None) -> None:
    doc = plan.to_json()              # masked: what people see is what the record holds
    c = console or Console(highlight=False, soft_wrap=True)
    r = doc["recipe"]
    c.print(f"[bold]{escape(doc['deployment'])}[/bold]: recipe {escape(r['name'])} ({escape(r['path'])}, "
            f"digest {r['digest']})" + (f", overrides: {escape(' '.join(r['overrides']))}" if r["overrides"] else ""))
    listen = doc.get("api_listen") or {}
    c.print(f"head {doc['head']}, API {doc['api']} (listening on {listen.get('address')}: "
            f"{listen.get('scope')}), {len(doc['hosts'])} host(s)")
    if rep := doc.get("replica"):
        c.print(f"replica {rep['index']} of {rep['count']} of {escape(rep['of'])}: group "
                f"{', '.join(h['name'] for h in doc['hosts'])} (its own head, ranks, tables and supervisor; "
                f"behind the router under the model's one name)")
    for key in plan.extra:
        extra = doc.get(key)
        text = extra.get("text") if isinstance(extra, dict) else None
        if text:
            c.print(text)
    for st in doc["stages"]:
        if not st["actions"]:
            c.print(f"[bold]{st['name']}[/bold] [dim]- nothing to do ({escape(st.get('note', ''))})[/dim]")
            continue
        c.print(f"[bold]{st['name']}[/bold]")
        for a in st["actions"]:
            c.print(f"  [cyan]{escape(a['host'])}[/cyan]: {escape(a['summary'])}")
            if a.get("command"):
                c.print(f"      $ {escape(shlex.join(a['command']))}")
            if a.get("api"):
                c.print(f"      {escape(a['api'])}")
            if verbose and a.get("details"):
                c.print(f"      [dim]{escape(json.dumps(a['details'], default=str))}[/dim]")
