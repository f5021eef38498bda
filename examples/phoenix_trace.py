"""The agent demo traced into a local Arize Phoenix, read back through Phoenix's API.

Run it (about a minute on 2 CPU cores, plus Phoenix's start; needs the dev extras:
``arize-phoenix``, ``opentelemetry-exporter-otlp-proto-http``, ``openinference-instrumentation-langchain``):

    .venv/bin/python examples/phoenix_trace.py [--tasks 1] [--max-tokens 48] [--url URL] [--keep]
        [--screenshot docs/phoenix_trace.png]

Starts ``phoenix serve`` on free loopback ports with a temporary database (or uses the Phoenix at
``--url``), runs the agent of ``agent_demo.py`` on ``ChatSpecDecode()`` with the LangChain run traced
by OpenInference and every model call traced by agentspec, exports the spans over OTLP/HTTP, then
reads them back with ``phoenix.client`` and prints each trace as a tree: the agent's steps, the
LangChain model run of each step, and under it agentspec's ``chat`` span with its tokens, drafts,
cache reads and estimated latency saved. ``--screenshot`` opens the first trace in Phoenix's web UI
with headless Chromium (``playwright`` driving the system's ``chromium``, e.g. Debian's package:
playwright's own browser download is not needed) and saves a PNG; ``--keep``
leaves Phoenix running until Enter is pressed, to look at it in a browser.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path

import agent_demo
import torch
from phoenix_local import local_phoenix, spans_dataframe

import agentspec
from agentspec.cost import calibrate
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode


def wait_for_spans(url: str, count: int, timeout_s: float = 60.0):
    """Phoenix's spans once it holds ``count`` of them (it ingests asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        df = spans_dataframe(url)
        if len(df) >= count or time.monotonic() > deadline:
            return df
        time.sleep(1)


def _attr(row, dotted: str, default=None):
    head, *rest = dotted.split(".")
    value = row.get(f"attributes.{head}")
    for key in rest:
        if not isinstance(value, dict):
            return default
        value = value.get(key)
    return default if value is None else value


def print_trees(df) -> list[str]:
    """Each trace as an indented tree; our chat spans with their agentspec attributes. Returns trace ids."""
    rows = {row["context.span_id"]: row for _, row in df.iterrows()}
    children: dict[str, list] = {}
    roots = []
    for row in sorted(rows.values(), key=lambda r: r["start_time"]):
        parent = row["parent_id"]
        if isinstance(parent, str) and parent in rows:
            children.setdefault(parent, []).append(row)
        else:
            roots.append(row)

    def show(row, depth: int) -> None:
        seconds = (row["end_time"] - row["start_time"]).total_seconds()
        line = f"{'  ' * depth}{row['name']} [{row['span_kind']}] {seconds:.2f} s"
        if _attr(row, A.OPERATION_NAME) == "chat":
            line += (
                f"  saved {_attr(row, A.LATENCY_SAVED, 0.0):+.2f} s, accepted/drafted "
                f"{_attr(row, A.ACCEPTED_TOKENS, 0)}/{_attr(row, A.DRAFT_TOKENS, 0)}, cache read "
                # agentspec's own counts: gen_ai.usage.* is left to OpenInference's LLM span here
                f"{_attr(row, A.PREFIX_TOKENS_RESTORED, 0)}/"
                f"{_attr(row, A.PREFIX_TOKENS_RESTORED, 0) + _attr(row, A.PREFILL_TOKENS, 0)}"
            )
        print(line)
        for child in children.get(row["context.span_id"], []):
            show(child, depth + 1)

    for root in roots:
        print(f"\ntrace {root['context.trace_id']}:")
        show(root, 1)
    return [root["context.trace_id"] for root in roots]


def screenshot(url: str, trace_id: str, path: Path, model: str) -> None:
    """Phoenix's view of one trace, an agentspec ``chat`` span selected, its agentspec.* attributes shown."""
    from phoenix.client import Client
    from playwright.sync_api import sync_playwright

    project = Client(base_url=url).projects.get(project_name="default")
    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1100})
        page.goto(f"{url}/projects/{project['id']}/traces/{trace_id}", wait_until="networkidle")
        chats = page.get_by_text(f"chat {model}", exact=True)
        chats.first.wait_for(timeout=30_000)
        chats.nth(min(1, chats.count() - 1)).click()  # the second call: it restored the first's prompt
        page.get_by_role("tab", name="Attributes").click()
        search = page.get_by_placeholder("Search attributes")
        page.locator(".search-button").filter(has=search).click()
        search.fill("agentspec")
        page.wait_for_timeout(1_500)
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path))
        browser.close()
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1, choices=range(1, len(agent_demo.TASKS) + 1))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--url", help="a running Phoenix (default: start one on free loopback ports)")
    parser.add_argument("--keep", action="store_true", help="keep Phoenix running until Enter")
    parser.add_argument("--screenshot", type=Path, metavar="PNG", help="save Phoenix's trace view here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    pair = agentspec.load_pair()
    ChatSpecDecode(pair=pair, max_tokens=4, prefix_cache=False).invoke("Warm up.")  # untraced
    calibrate(pair)  # fit the latency-saved estimate up front (tracing alone starts from a prior)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_phoenix())
        print(f"Phoenix at {url}")
        provider, memory = agent_demo.tracing(url)
        llm = ChatSpecDecode(pair=pair, max_tokens=args.max_tokens, tracer_provider=provider)
        agent_demo.run(llm, "spec", agent_demo.TASKS[: args.tasks])
        provider.force_flush()
        sent = memory.get_finished_spans()
        df = wait_for_spans(url, len(sent))
        print(f"\n{len(sent)} spans sent, {len(df)} read back from Phoenix")
        trace_ids = print_trees(df)
        if args.screenshot and trace_ids:
            screenshot(url, trace_ids[0], args.screenshot, pair.name)
        if args.keep:
            input(f"\nPhoenix is at {url}; press Enter to stop it ")
        provider.shutdown()


if __name__ == "__main__":
    main()
