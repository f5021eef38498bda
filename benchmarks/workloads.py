"""The workloads the suites replay, written once.

- **Agent traces** (``TRACES``): recorded multi-turn tool-calling conversations in four domains,
  written for this project: an inventory assistant (two conversations, so that the second can draw on
  the first's outputs), SQL analytics, code editing and document Q&A. Each trace is a system prompt with
  the domain's tools (JSON schemas, Hermes ``<tool_call>`` format) and the messages of a finished
  conversation: user turns, the assistant's tool calls and answers, and realistic tool results. A suite
  replays a trace: at every assistant message the model generates its own reply to the history so far,
  and the recorded message (not the model's reply) continues the history, as when a recorded agent run
  is replayed. ``openai_messages`` gives a history as the chat API takes it; ``sessions`` gives K
  concurrent sessions over the traces.
- **Grammar tasks** (``TOOLS``, ``PROMPTS``, ``STRUCTURED``): three LangChain tools with the prompts
  that need them and two pydantic schemas with texts to fill them from (the grammar suite; the tests
  check that every call and output validates).
- **Open questions** (``QUESTIONS``): short chat prompts where lookup-style drafters find nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from langchain_core.tools import tool as lc_tool
from pydantic import BaseModel, Field

from agentspec.bench.conversation import tool


@dataclass(frozen=True)
class Trace:
    name: str
    domain: str
    system: str
    messages: tuple[dict[str, str], ...]  # user / assistant / tool, in order


def _system(role: str, rules: str, tools: list[dict]) -> str:
    schemas = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        f"{role}\n\nRules:\n{rules}\n\nTo use a tool, answer with exactly one block\n"
        '<tool_call>{"name": <tool name>, "arguments": {<arguments>}}</tool_call>\n'
        'and wait: the result arrives as a message with the role "tool". Quote identifiers, numbers '
        f"and names from tool results exactly.\n\nTools:\n{schemas}"
    )


def _call(name: str, **arguments) -> dict[str, str]:
    return {
        "role": "assistant",
        "content": f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>",
    }


def _tool(result) -> dict[str, str]:
    return {"role": "tool", "content": result if isinstance(result, str) else json.dumps(result, indent=1)}


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# --- inventory -------------------------------------------------------------------------------------

INVENTORY_TOOLS = [
    tool(
        "lookup_item",
        "Find an item in the warehouse inventory by SKU.",
        {"sku": {"type": "string", "description": "Stock keeping unit, e.g. UD-300"}},
        ["sku"],
    ),
    tool(
        "reserve_stock",
        "Reserve a quantity of an item for an order, from one warehouse.",
        {
            "sku": {"type": "string"},
            "quantity": {"type": "integer", "minimum": 1},
            "order_id": {"type": "string"},
            "warehouse": {"type": "string", "enum": ["north", "south", "east"]},
        },
        ["sku", "quantity", "order_id", "warehouse"],
    ),
]
INVENTORY_SYSTEM = _system(
    "You are StockBot, the operations assistant of an electronics retailer.",
    "1. Never invent stock levels, prices or order numbers: use the tools.\n"
    "2. Before reserving stock, look the item up and reserve from the warehouse with the most units.\n"
    "3. Answer in one or two short sentences that repeat the SKU, the quantities and the warehouse.",
    INVENTORY_TOOLS,
)


def _item(sku: str, name: str, price: float, stock: dict[str, int], incoming: str) -> dict:
    return {
        "sku": sku,
        "name": name,
        "price_eur": price,
        "stock": stock,
        "reserved": {w: 0 for w in stock},
        "next_delivery": incoming,
        "status": "active",
    }


INVENTORY_1 = Trace(
    "inventory_dock",
    "inventory",
    INVENTORY_SYSTEM,
    (
        _user("Do we have the UD-300 USB-C dock in stock?"),
        _call("lookup_item", sku="UD-300"),
        _tool(
            _item(
                "UD-300", "USB-C docking station", 129.0, {"north": 18, "south": 4, "east": 0}, "2026-12-04"
            )
        ),
        _answer("Yes: UD-300 (USB-C docking station) has 18 units in north and 4 in south, none in east."),
        _user("Reserve 5 of them for order B-20417."),
        _call("reserve_stock", sku="UD-300", quantity=5, order_id="B-20417", warehouse="north"),
        _tool(
            {
                "ok": True,
                "reservation": "R-88120",
                "sku": "UD-300",
                "quantity": 5,
                "order_id": "B-20417",
                "warehouse": "north",
                "remaining": {"north": 13, "south": 4, "east": 0},
            }
        ),
        _answer("Reserved 5 units of UD-300 from north for order B-20417 (reservation R-88120)."),
    ),
)

INVENTORY_2 = Trace(
    "inventory_headset",
    "inventory",
    INVENTORY_SYSTEM,
    (
        _user("How many HS-512 wireless headsets are left?"),
        _call("lookup_item", sku="HS-512"),
        _tool(_item("HS-512", "wireless headset", 79.0, {"north": 2, "south": 31, "east": 9}, "2026-12-11")),
        _answer("HS-512 (wireless headset): 2 units in north, 31 in south and 9 in east."),
        _user("Put 3 aside for order B-20433."),
        _call("reserve_stock", sku="HS-512", quantity=3, order_id="B-20433", warehouse="south"),
        _tool(
            {
                "ok": True,
                "reservation": "R-88131",
                "sku": "HS-512",
                "quantity": 3,
                "order_id": "B-20433",
                "warehouse": "south",
                "remaining": {"north": 2, "south": 28, "east": 9},
            }
        ),
        _answer("Reserved 3 units of HS-512 from south for order B-20433 (reservation R-88131)."),
    ),
)

# --- SQL analytics ---------------------------------------------------------------------------------

SQL_TOOLS = [
    tool(
        "describe_table",
        "Columns and types of a table in the analytics warehouse.",
        {"table": {"type": "string"}},
        ["table"],
    ),
    tool(
        "run_sql",
        "Run a read-only SQL query (PostgreSQL dialect) and return at most 50 rows.",
        {"query": {"type": "string"}},
        ["query"],
    ),
]
SQL_SYSTEM = _system(
    "You are a data analyst with read access to the company's PostgreSQL analytics warehouse.",
    "1. Check a table's columns with describe_table before querying it for the first time.\n"
    "2. Write one query per tool call; always alias aggregates and order the results.\n"
    "3. Report results as a short markdown table with the exact figures from the tool.",
    SQL_TOOLS,
)
_ORDERS_SCHEMA = {
    "table": "orders",
    "columns": [
        {"name": "order_id", "type": "text"},
        {"name": "customer_id", "type": "text"},
        {"name": "product_id", "type": "text"},
        {"name": "region", "type": "text"},
        {"name": "quantity", "type": "integer"},
        {"name": "unit_price", "type": "numeric(10,2)"},
        {"name": "ordered_at", "type": "timestamp"},
    ],
    "rows": 184220,
}
_TOP_QUERY = (
    "SELECT product_id, SUM(quantity * unit_price) AS revenue FROM orders "
    "WHERE ordered_at >= '2026-10-01' AND ordered_at < '2026-11-01' "
    "GROUP BY product_id ORDER BY revenue DESC LIMIT 5"
)
_REGION_QUERY = (
    "SELECT region, SUM(quantity * unit_price) AS revenue FROM orders "
    "WHERE product_id = 'P-1042' AND ordered_at >= '2026-10-01' AND ordered_at < '2026-11-01' "
    "GROUP BY region ORDER BY revenue DESC"
)
SQL = Trace(
    "sql_revenue",
    "sql",
    SQL_SYSTEM,
    (
        _user("Which five products made the most revenue in October 2026?"),
        _call("describe_table", table="orders"),
        _tool(_ORDERS_SCHEMA),
        _call("run_sql", query=_TOP_QUERY),
        _tool(
            {
                "columns": ["product_id", "revenue"],
                "rows": [
                    ["P-1042", 48210.50],
                    ["P-0977", 39102.00],
                    ["P-1210", 31877.25],
                    ["P-0031", 29940.00],
                    ["P-1188", 21005.75],
                ],
            }
        ),
        _answer(
            "| product_id | revenue |\n|---|---|\n| P-1042 | 48210.50 |\n| P-0977 | 39102.00 |\n"
            "| P-1210 | 31877.25 |\n| P-0031 | 29940.00 |\n| P-1188 | 21005.75 |"
        ),
        _user("Break the top product down by region."),
        _call("run_sql", query=_REGION_QUERY),
        _tool(
            {
                "columns": ["region", "revenue"],
                "rows": [
                    ["EU-West", 20112.00],
                    ["EU-Central", 15880.50],
                    ["Nordics", 8004.00],
                    ["UK", 4214.00],
                ],
            }
        ),
        _answer(
            "| region | revenue |\n|---|---|\n| EU-West | 20112.00 |\n| EU-Central | 15880.50 |\n"
            "| Nordics | 8004.00 |\n| UK | 4214.00 |"
        ),
    ),
)

# --- code editing ----------------------------------------------------------------------------------

CODE_TOOLS = [
    tool("read_file", "Read a file of the repository.", {"path": {"type": "string"}}, ["path"]),
    tool(
        "write_file",
        "Replace the whole content of a file of the repository.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
        ["path", "content"],
    ),
]
CODE_SYSTEM = _system(
    "You are a coding agent working in a Python repository.",
    "1. Read a file before changing it.\n"
    "2. Write back the whole file with write_file, changing only what the task asks.\n"
    "3. After a change, say in one sentence what changed.",
    CODE_TOOLS,
)
_CONFIG_PY = '''"""Loading the service configuration."""

import json
from pathlib import Path

DEFAULTS = {"port": 8080, "workers": 4, "log_level": "info"}


def parse_cfg(path):
    """Read a JSON config file and fill in the defaults."""
    data = json.loads(Path(path).read_text())
    return {**DEFAULTS, **data}


def port_of(path):
    return parse_cfg(path)["port"]
'''
CODE = Trace(
    "code_rename",
    "code",
    CODE_SYSTEM,
    (
        _user("In src/config.py, rename parse_cfg to parse_config, callers included."),
        _call("read_file", path="src/config.py"),
        _tool(_CONFIG_PY),
        _call("write_file", path="src/config.py", content=_CONFIG_PY.replace("parse_cfg", "parse_config")),
        _tool({"ok": True, "path": "src/config.py", "bytes": len(_CONFIG_PY) + 6}),
        _answer("Renamed parse_cfg to parse_config in src/config.py, including the call in port_of."),
        _user("Also make workers default to 8."),
        _call(
            "write_file",
            path="src/config.py",
            content=_CONFIG_PY.replace("parse_cfg", "parse_config").replace('"workers": 4', '"workers": 8'),
        ),
        _tool({"ok": True, "path": "src/config.py", "bytes": len(_CONFIG_PY) + 6}),
        _answer("DEFAULTS in src/config.py now sets workers to 8."),
    ),
)

# --- document Q&A ----------------------------------------------------------------------------------

DOC_TOOLS = [
    tool(
        "search_docs",
        "Search the help-centre articles; returns ids, titles and snippets.",
        {"query": {"type": "string"}},
        ["query"],
    ),
    tool("read_doc", "Read one help-centre article by id.", {"doc_id": {"type": "string"}}, ["doc_id"]),
]
DOC_SYSTEM = _system(
    "You answer customer questions from the help-centre articles of a SaaS company.",
    "1. Search first, then read the most relevant article.\n"
    "2. Answer only from the article, quoting the sentence that answers the question.\n"
    "3. Name the article's id and title at the end.",
    DOC_TOOLS,
)
_REFUNDS = (
    "Refunds and cancellations (KB-2231)\n\n"
    "Monthly plans can be cancelled at any time; the plan stays active until the end of the paid month "
    "and is not refunded. Annual plans can be refunded in full within 30 days of the purchase date. "
    "After 30 days, annual plans are refunded pro rata for the unused full months, minus a processing "
    "fee of 5%. Refunds are paid to the original payment method within 10 business days. To request a "
    "refund, the account owner opens Billing > Plan > Cancel plan and selects a reason. Add-ons bought "
    "during the year follow the same rules as the plan they belong to."
)
DOCS = Trace(
    "docs_refund",
    "docs",
    DOC_SYSTEM,
    (
        _user("Can I still get my money back for an annual plan I bought 3 weeks ago?"),
        _call("search_docs", query="refund annual plan"),
        _tool(
            {
                "results": [
                    {
                        "doc_id": "KB-2231",
                        "title": "Refunds and cancellations",
                        "snippet": "Annual plans can be refunded in full within 30 days of the purchase "
                        "date.",
                    },
                    {
                        "doc_id": "KB-1904",
                        "title": "Changing your billing cycle",
                        "snippet": "Switching from monthly to annual billing takes effect at the next "
                        "renewal.",
                    },
                ]
            }
        ),
        _call("read_doc", doc_id="KB-2231"),
        _tool(_REFUNDS),
        _answer(
            'Yes. "Annual plans can be refunded in full within 30 days of the purchase date." Three weeks '
            "is within that window. Source: KB-2231, Refunds and cancellations."
        ),
        _user("How long until the money arrives?"),
        _answer(
            '"Refunds are paid to the original payment method within 10 business days." Source: KB-2231, '
            "Refunds and cancellations."
        ),
    ),
)

TRACES: tuple[Trace, ...] = (INVENTORY_1, SQL, CODE, DOCS, INVENTORY_2)


def calls(trace: Trace) -> list[tuple[list[dict[str, str]], dict[str, str]]]:
    """(history, recorded reply) for every assistant message of the trace."""
    out = []
    history = [{"role": "system", "content": trace.system}]
    for m in trace.messages:
        if m["role"] == "assistant":
            out.append((list(history), m))
        history.append(m)
    return out


def traces_named(names: str | None) -> list[Trace]:
    """The traces of a comma-separated list of names, in ``TRACES``' order; all for None."""
    return [t for t in TRACES if names is None or t.name in names.split(",")]


def openai_messages(history: list[dict[str, str]]) -> list[dict[str, Any]]:
    """A trace's messages as the chat API takes them: tool calls as ``tool_calls`` with ids, and each
    tool result naming the call it answers (the recorded turns keep their calls as Hermes text)."""
    from agentspec.chat import parse_reply

    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not answered yet, in order
    for m in history:
        if m["role"] == "assistant":
            reply = parse_reply(m["content"])
            m = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:  # ids fixed by position: every turn renders its history alike
                m["tool_calls"] = [
                    {**c, "id": f"call_{len(out)}_{i}"} for i, c in enumerate(reply.tool_calls)
                ]
                pending = [c["id"] for c in m["tool_calls"]]
        elif m["role"] == "tool":
            m = {**m, "tool_call_id": pending.pop(0)}
        out.append(m)
    return out


def sessions(k: int, traces: tuple[Trace, ...] = TRACES) -> list[tuple[str | None, Trace]]:
    """(tag, trace) of each of k concurrent sessions: session i replays trace i mod len(traces), and a
    repeated trace gets a tag for ``tagged``, so no two sessions send the same history."""
    return [(None if i < len(traces) else f"session {i}", traces[i % len(traces)]) for i in range(k)]


def tagged(messages: list[dict], tag: str | None) -> list[dict]:
    """``messages`` with ``[tag]`` before the first user message's text (unchanged for no tag)."""
    if tag is None:
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [*messages[:first], {**messages[first], "content": f"[{tag}] {messages[first]['content']}"},
            *messages[first + 1 :]]  # fmt: skip


# --- grammar tasks --------------------------------------------------------------------------------


@lc_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


@lc_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


@lc_tool
def word_length(word: str) -> int:
    """Count the letters of a word."""
    return len(word)


TOOLS = [multiply, get_weather, word_length]

# 20 held-in prompts (written for the grammar test, not tuned against it) and the tool each one needs
PROMPTS = [
    ("What is 7 times 8?", "multiply"),
    ("What is the weather in Paris?", "get_weather"),
    ("Multiply 12 by 3.", "multiply"),
    ("How many letters are in the word banana?", "word_length"),
    ("Is it raining in Tokyo?", "get_weather"),
    ("What is 6 multiplied by 9?", "multiply"),
    ("Weather in Berlin today?", "get_weather"),
    ("How long is the word 'elephant'?", "word_length"),
    ("Compute 15 * 4.", "multiply"),
    ("Tell me the weather forecast for London.", "get_weather"),
    ("Count the letters in 'giraffe'.", "word_length"),
    ("What do you get if you multiply 21 and 2?", "multiply"),
    ("Should I take an umbrella in Seattle?", "get_weather"),
    ("How many characters does the word 'python' have?", "word_length"),
    ("What's 9 times 9?", "multiply"),
    ("Is it sunny in Madrid right now?", "get_weather"),
    ("Length of the word 'strawberry'?", "word_length"),
    ("Product of 13 and 7?", "multiply"),
    ("How cold is it in Oslo?", "get_weather"),
    ("How many letters has 'cat'?", "word_length"),
]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's name")
    age: int = Field(description="age in years")


class City(BaseModel):
    """A city and its country."""

    city: str
    country: str


STRUCTURED = [
    (Person, "Alice is 31 years old and lives in Lyon."),
    (City, "Paris is the capital of France."),
    (Person, "Bob, aged 45, is a baker."),
    (City, "I flew to Tokyo, in Japan, last spring."),
    (Person, "My grandmother Rose turned 88 yesterday."),
]


# --- open questions -------------------------------------------------------------------------------

QUESTIONS = [
    "Explain how a hash map handles collisions.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system with one fact each.",
    "Describe how to make bread at home.",
    "What are the rules of chess for the knight and the bishop?",
    "Summarise the causes of the French Revolution.",
    "How does a bicycle stay upright?",
    "Give advice for a first marathon.",
]
