"""A scripted multi-turn agent conversation over a long system prompt, shared by the benchmarks.

The system prompt carries an inventory agent's policies and tool schemas (about 1,100 tokens with
SmolLM2's tokenizer); the turns alternate user requests and tool results, as an agent loop sends
them. The model's own answers are appended between calls, so each call's prompt extends the last.
"""

from __future__ import annotations

import json


def tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    """One tool's schema as the system prompts list it: name, description, JSON-schema parameters."""
    parameters: dict = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"name": name, "description": description, "parameters": parameters}


TOOLS = [
    tool(
        "lookup_item",
        "Find an item in the warehouse inventory by SKU or by name.",
        {
            "sku": {"type": "string", "description": "Stock keeping unit, e.g. KB-87"},
            "name": {"type": "string", "description": "Free-text item name"},
            "warehouse": {"type": "string", "enum": ["north", "south", "east"]},
        },
    ),
    tool(
        "reserve_stock",
        "Reserve a quantity of an item for an order; fails if stock is short.",
        {
            "sku": {"type": "string"},
            "quantity": {"type": "integer", "minimum": 1},
            "order_id": {"type": "string"},
        },
        ["sku", "quantity", "order_id"],
    ),
    tool(
        "list_orders",
        "List the open orders of a customer, newest first.",
        {
            "customer_id": {"type": "string"},
            "status": {"type": "string", "enum": ["open", "shipped", "cancelled"]},
            "limit": {"type": "integer", "default": 10},
        },
        ["customer_id"],
    ),
    tool(
        "create_shipment",
        "Create a shipment for reserved stock with a carrier and service level.",
        {
            "order_id": {"type": "string"},
            "carrier": {"type": "string", "enum": ["DHL", "UPS", "FedEx"]},
            "service": {"type": "string", "enum": ["standard", "express", "overnight"]},
            "address": {"type": "string"},
        },
        ["order_id", "carrier"],
    ),
]

POLICIES = """\
You are StockBot, the operations assistant of a mid-sized electronics retailer. You help staff
check stock, reserve items for orders, follow up on customer orders and arrange shipments.

Rules you always follow:
1. Never invent stock levels, prices, order numbers or tracking numbers. Use the tools, and quote
   the tool results exactly, including SKUs and identifiers.
2. Before reserving stock, confirm the SKU and the quantity with a lookup. If the stock is short,
   say how many units are available and in which warehouse, and propose a partial reservation.
3. Orders above 20 units of a single SKU need a manager's approval: say so and stop.
4. Shipments to addresses outside the EU use FedEx; inside the EU, DHL standard unless the order is
   marked urgent, then DHL express. Overnight service is only for orders placed before 14:00.
5. When a customer has several open orders, list them newest first with their order id, date,
   status and total, one per line.
6. Keep answers short and factual. Use bullet points for lists of items. Do not apologise.
7. If a tool returns an error, report the error message verbatim and suggest the next step.
8. Warehouses: north (Hamburg), south (Munich), east (Leipzig). Transfers between warehouses take
   two working days and must be requested from the logistics team, not through the tools.
9. Prices are in euros and include VAT. Discounts are never granted by the assistant.
10. Customer data is confidential: never show a customer's address to another customer.
"""

TOOLS_IN_TEXT = """
Tool call format: answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call> when you
need a tool, then wait for the result, which arrives as a message with the role "tool".

Available tools (JSON schema):
"""

EXAMPLES = """

Examples of good answers:
- "KB-87 (mechanical keyboard): 42 in north, 3 in south. Reserved 2 for order A-10293."
- "Order A-10293 shipped with DHL express, tracking JD014600003451."
- "Stock is short: 3 units of MS-12 in south, none elsewhere. Reserve 3 now and back-order 2?"
Glossary: SKU = stock keeping unit; ETA = estimated time of arrival; RMA = return authorisation;
back-order = an order line waiting for stock; pick list = the list a warehouse uses to collect
items; cut-off = the latest time for same-day dispatch (16:00 in every warehouse).
"""

# the tools written into the system prompt, as an agent without tool binding sends them
SYSTEM_PROMPT = POLICIES + TOOLS_IN_TEXT + "\n".join(json.dumps(t, indent=1) for t in TOOLS) + EXAMPLES
# the system prompt of a request that binds the tools (``OPENAI_TOOLS``): the chat layer renders them
BOUND_SYSTEM_PROMPT = POLICIES + EXAMPLES
OPENAI_TOOLS = [{"type": "function", "function": t} for t in TOOLS]

TURNS = [
    ("user", "How many KB-87 keyboards do we have, and where?"),
    (
        "tool",
        json.dumps(
            {
                "sku": "KB-87",
                "name": "mechanical keyboard",
                "price": 89.0,
                "stock": {"north": 42, "south": 3, "east": 0},
            }
        ),
    ),
    ("user", "Reserve 2 of them for order A-10293."),
    (
        "tool",
        json.dumps(
            {
                "ok": True,
                "reservation": "R-55120",
                "sku": "KB-87",
                "quantity": 2,
                "order_id": "A-10293",
                "warehouse": "north",
            }
        ),
    ),
    ("user", "What other open orders does customer C-884 have?"),
    (
        "tool",
        json.dumps(
            {
                "orders": [
                    {"order_id": "A-10293", "date": "2026-11-28", "status": "open", "total": 178.0},
                    {"order_id": "A-10177", "date": "2026-11-20", "status": "open", "total": 45.5},
                    {"order_id": "A-09981", "date": "2026-11-02", "status": "open", "total": 312.9},
                ]
            }
        ),
    ),
    ("user", "Ship A-10293 to Berlin, it is urgent."),
    (
        "tool",
        json.dumps(
            {
                "ok": True,
                "shipment": "S-7781",
                "carrier": "DHL",
                "service": "express",
                "tracking": "JD014600003451",
                "eta": "2026-12-01",
            }
        ),
    ),
]

# Four more turns after TURNS, for a 12-call conversation (``LONG_TURNS``, the vllm suite): apart,
# so that the benchmarks and tests that replay all of TURNS keep measuring the same 8 calls.
EXTRA_TURNS = [
    ("user", "Customer C-884 also wants 5 MS-12 mice on order A-10177. Do we have them?"),
    (
        "tool",
        json.dumps(
            {
                "sku": "MS-12",
                "name": "wireless mouse",
                "price": 24.9,
                "stock": {"north": 0, "south": 3, "east": 0},
            }
        ),
    ),
    ("user", "Reserve the 3 we have for A-10177 and back-order the other 2."),
    (
        "tool",
        json.dumps(
            {
                "ok": True,
                "reservation": "R-55131",
                "sku": "MS-12",
                "quantity": 3,
                "order_id": "A-10177",
                "warehouse": "south",
                "back_order": {"quantity": 2, "eta": "2026-12-09"},
            }
        ),
    ),
]
LONG_TURNS = TURNS + EXTRA_TURNS


def messages_for_call(n: int, answers: list[str], turns: list[tuple[str, str]] = TURNS) -> list[dict]:
    """The message list an agent sends on call n (0-based) of ``turns``, given the model's earlier
    answers."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(n + 1):
        role, content = turns[i]
        msgs.append({"role": role, "content": content})
        if i < n:
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def tool_choice_for_call(n: int) -> str:
    """What call n's request asks of the reply: a tool call when a tool result follows it in TURNS."""
    return "required" if n + 1 < len(TURNS) and TURNS[n + 1][0] == "tool" else "auto"


def bound_messages_for_call(n: int, replies: list[dict]) -> list[dict]:
    """The OpenAI-format messages of call n in a conversation that binds ``OPENAI_TOOLS``, given the
    assistant messages the model's earlier replies became (each tool result answers the call in the
    reply before it, which ``tool_choice_for_call`` made a tool call)."""
    msgs = [{"role": "system", "content": BOUND_SYSTEM_PROMPT}]
    for i in range(n + 1):
        role, content = TURNS[i]
        msg = {"role": role, "content": content}
        if role == "tool":
            reply = replies[i - 1]  # a call cut short by the token limit is an invalid one
            msg["tool_call_id"] = [*reply["tool_calls"], *reply.get("invalid_tool_calls", ())][0]["id"]
        msgs.append(msg)
        if i < n:
            msgs.append(replies[i])
    return msgs
