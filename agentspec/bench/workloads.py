"""The benchmark's work: single-call prompts (open chat, agent turns) and a multi-turn agent loop.

``PROMPTS`` are (name, kind, messages): "chat" prompts ask for open answers; "agent" prompts are
turns whose answer copies from its context (a tool result to repeat, summarise or list; code to
edit), as an agent's turns often do. ``agent_loop`` is a tool-calling conversation over the
~1,200-token system prompt of ``conversation.py``: four user requests, each answered by a tool call,
its result, then an answer, so 8 model calls whose prompts share a growing prefix. Messages are
OpenAI-format dicts (role, content, tool_calls, tool_call_id): the LangChain agent-loop rows
(the loop suite, ``benchmarks/loop.py``) convert them to LangChain messages.
"""

from __future__ import annotations

import json

from agentspec.bench.conversation import SYSTEM_PROMPT, TURNS

WEATHER = json.dumps(
    {
        "location": {"city": "Lisbon", "country": "Portugal", "lat": 38.72, "lon": -9.14},
        "current": {"temperature_c": 21.4, "humidity": 0.63, "wind_kph": 14.0, "condition": "partly cloudy"},
        "forecast": [
            {"day": "Tuesday", "high_c": 23, "low_c": 15, "condition": "sunny"},
            {"day": "Wednesday", "high_c": 20, "low_c": 14, "condition": "light rain"},
        ],
    },
    indent=2,
)
SEARCH = json.dumps(
    {
        "query": "python dataclass default factory",
        "results": [
            {
                "title": "dataclasses - Data Classes - Python 3 documentation",
                "url": "https://docs.python.org/3/library/dataclasses.html",
            },
            {
                "title": "Using default_factory in Python dataclasses",
                "url": "https://realpython.com/python-data-classes/",
            },
            {
                "title": "Mutable default values in dataclasses",
                "url": "https://stackoverflow.com/questions/52063759",
            },
        ],
    },
    indent=2,
)
CODE = """def calc(items, tax):
    total = 0
    for item in items:
        total += item["price"] * item["qty"]
    return total * (1 + tax)


def report(items):
    print("Total:", calc(items, 0.2))
"""
BUGGY = """def average(numbers):
    if not numbers:
        return 0
    total = 0
    for n in numbers:
        total += n
    return total / len(number)
"""


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (name, kind, messages). "chat": open answers; "agent": the answer copies its context.
PROMPTS: list[tuple[str, str, list[dict[str, str]]]] = [
    ("chat_tips", "chat", _user("Give me three tips for staying focused while working from home.")),
    ("chat_hash_table", "chat", _user("Explain what a hash table is and why lookups are fast.")),
    ("chat_poem", "chat", _user("Write a short poem about the sea at night.")),
    (
        "agent_repeat_json",
        "agent",
        _user(f"The weather tool returned this JSON:\n{WEATHER}\nRepeat the tool result exactly, as JSON."),
    ),
    (
        "agent_summarise_json",
        "agent",
        _user(
            f"The weather tool returned this JSON:\n{WEATHER}\n"
            "Summarise the current weather and the forecast for the user."
        ),
    ),
    (
        "agent_list_titles",
        "agent",
        _user(f"A web search returned:\n{SEARCH}\nList every result as a bullet with its title and URL."),
    ),
    (
        "agent_code_rename",
        "agent",
        _user(
            "Rename the function `calc` to `compute_total` everywhere in this code and return the full "
            f"updated code:\n```python\n{CODE}```"
        ),
    ),
    (
        "agent_code_fix",
        "agent",
        _user(f"This function has a bug. Return the corrected function in full:\n```python\n{BUGGY}```"),
    ),
]
QUICK_PROMPTS = ("chat_tips", "agent_repeat_json", "agent_summarise_json", "agent_code_rename")


# The tool call that serves each user request of conversation.TURNS, and the answer written after
# its result arrives (the recorded conversation: it continues the history whatever a model wrote).
LOOP_STEPS = [
    (
        ("lookup_item", {"sku": "KB-87"}),
        "KB-87 (mechanical keyboard, 89.00 EUR): 42 in north, 3 in south, none in east.",
    ),
    (
        ("reserve_stock", {"sku": "KB-87", "quantity": 2, "order_id": "A-10293"}),
        "Reserved 2 units of KB-87 from north for order A-10293 (reservation R-55120).",
    ),
    (
        ("list_orders", {"customer_id": "C-884", "status": "open"}),
        "- A-10293, 2026-11-28, open, 178.00 EUR\n- A-10177, 2026-11-20, open, 45.50 EUR\n"
        "- A-09981, 2026-11-02, open, 312.90 EUR",
    ),
    (
        (
            "create_shipment",
            {"order_id": "A-10293", "carrier": "DHL", "service": "express", "address": "Berlin"},
        ),
        "A-10293 ships with DHL express, tracking JD014600003451, ETA 2026-12-01.",
    ),
]


def agent_loop() -> list[list[dict]]:
    """The messages of each of the loop's 8 calls: a user request (the model should call a tool),
    then the call and its result (the model should answer), for each of the 4 requests."""
    users = [text for role, text in TURNS if role == "user"]
    results = [text for role, text in TURNS if role == "tool"]
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    calls = []
    for i, ((name, args), answer) in enumerate(LOOP_STEPS):
        history.append({"role": "user", "content": users[i]})
        calls.append(list(history))
        call_id = f"call_{i}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        history.append({"role": "assistant", "content": "", "tool_calls": [call]})
        history.append({"role": "tool", "content": results[i], "tool_call_id": call_id})
        calls.append(list(history))
        history.append({"role": "assistant", "content": answer})
    return calls
