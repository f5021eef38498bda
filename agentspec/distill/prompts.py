"""Prompts the target answers to make its own distillation data: templates x slot values, seeded.

No dataset or hub is reachable, so the prompts are built here: open chat, instructions (rewrite,
summarise, list, extract), tool calling (a system prompt with JSON tool schemas and a request,
sometimes with the start of the call forced as ``tool_choice`` does), agent turns where a tool
result follows the assistant's call, code (write, explain, fix), and short multi-turn exchanges.
Prompt ``i`` depends only on ``(seed, i)``, so a larger ``n`` extends a smaller one.

Rendering is the chat model's own (``agentspec.chat``): a template that renders ``tools=`` itself
gets the schemas and calls natively; any other (SmolLM2's plain ChatML) gets the Hermes / Qwen2.5
block in the system message, past calls written as ``<tool_call>`` JSON in the assistant turn and
results as role "tool" in ``<tool_response>`` tags, so the draft learns on exactly the text the
chat model puts in front of the target.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from agentspec import chat

KINDS = ("chat", "instruction", "tool_call", "tool_result", "code", "agent")
KIND_WEIGHTS = (0.18, 0.2, 0.2, 0.17, 0.15, 0.1)


@dataclass
class PromptSpec:
    kind: str  # one of KINDS ("custom" for prompts given as token ids)
    messages: list[dict[str, Any]]  # HF chat-template messages; assistant calls in "tool_calls"
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-format function schemas
    tool_choice: str | None = None  # None, "any" or a tool's name: the reply's start is forced

    def key(self) -> str:
        """A stable hash of the content: decides the held-out split, whatever the seed or order."""
        blob = json.dumps([self.messages, self.tools, self.tool_choice], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages in the OpenAI format: an assistant turn's call (one per turn here) gets an id,
        which the tool result right after it answers, and its arguments as a JSON string.

        ``messages`` keeps its own form: ``key`` hashes it, and the held-out split of the shipped
        draft's data must not move.
        """
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
                    }
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            elif m["role"] == "tool":
                m = {**m, "tool_call_id": f"call_{i - 1}"}
            out.append(m)
        return out


def is_heldout(key: str, fraction: float) -> bool:
    return int(key[:8], 16) / 0x100000000 < fraction


# ---------------------------------------------------------------------------------------- slots
NAMES = [
    "Alice",
    "Bob",
    "Chen",
    "Dmitri",
    "Elena",
    "Farah",
    "Gustavo",
    "Hana",
    "Ivan",
    "Jamal",
    "Keiko",
    "Lena",
]
CITIES = [
    "Paris",
    "Tokyo",
    "Lagos",
    "Lima",
    "Oslo",
    "Cairo",
    "Denver",
    "Mumbai",
    "Berlin",
    "Sydney",
    "Toronto",
]
TOPICS = [
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "machine learning",
    "compound interest",
    "the water cycle",
    "vaccines",
    "climate change",
    "the stock market",
    "DNA",
    "volcanoes",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "inflation",
    "the internet",
    "honey bees",
    "gravity",
]
HOWTOS = [
    "learn a new language",
    "save money each month",
    "fall asleep faster",
    "write a cover letter",
    "make bread at home",
    "start running",
    "prepare for a job interview",
    "keep houseplants alive",
    "organise my week",
    "give a good presentation",
    "reduce stress at work",
    "cook rice properly",
]
SENTENCES = [
    "the meeting got moved to thursday because half the team is out sick",
    "we shipped the new feature but users say it's confusing and slow",
    "I can't make it to dinner tonight, something came up at work",
    "the report is late since the data from sales never arrived",
    "our server crashed twice last night and nobody knows why",
    "the new office has more space but the commute is much longer",
    "please send me the invoice by friday so I can pay it on time",
]
PARAGRAPHS = [
    "The city council voted on Tuesday to extend the bike lane network by 40 kilometres over the next "
    "three years. Supporters say it will cut traffic and pollution; shop owners on Main Street worry "
    "about losing parking spaces. Construction starts in the spring.",
    "Our quarterly revenue grew 12% to 4.2 million dollars, driven by the new subscription plan. Costs "
    "rose 8%, mostly from hiring two engineers. Churn fell from 5% to 3.5%. Next quarter we plan to "
    "expand to Germany and Spain.",
    "The patient, a 54-year-old man, reported chest pain after exercise for two weeks. His blood "
    "pressure was 150/95. An ECG showed no acute changes. He was referred to cardiology and advised "
    "to avoid strenuous activity until the appointment.",
    "Honey bees communicate the location of flowers through a 'waggle dance'. The angle of the dance "
    "shows the direction relative to the sun, and its duration shows the distance. Other bees follow "
    "the dancer and then fly out to find the food.",
]
THINGS = [
    "fruits that are high in vitamin C",
    "programming languages for beginners",
    "ways to reuse glass jars",
    "famous bridges",
    "board games for families",
    "tips for remote work",
    "European capitals",
    "healthy breakfast ideas",
    "reasons to learn statistics",
    "common interview questions",
]
CODE_TASKS = [
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "counts the words in a text",
    "merges two sorted lists",
    "removes duplicates from a list keeping order",
    "converts Celsius to Fahrenheit",
    "finds the largest number in a list",
    "reverses the words in a sentence",
    "checks whether a number is prime",
    "flattens a nested list",
    "parses a date string like 2024-03-01",
    "computes the average of a list of numbers",
    "returns the most common element of a list",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "SQL", "Bash"]
SNIPPETS = [
    """def f(xs):
    out = []
    for x in xs:
        if x % 2 == 0:
            out.append(x * x)
    return out""",
    """def g(s):
    return {c: s.count(c) for c in set(s)}""",
    """def total(items):
    t = 0
    for item in items:
        t += item['price'] * item['qty']
    return t""",
    """def find(xs, target):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1""",
    """SELECT customer_id, SUM(amount) AS total
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
ORDER BY total DESC
LIMIT 10;""",
    """def average(xs):
    return sum(xs) / len(xs)  # fails on []""",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly customer support agent for an online shop.",
    "You are an expert software engineer. Answer with code when useful.",
    "You are a travel assistant.",
    "You are a data analyst who explains results clearly.",
]


def _fn(name: str, description: str, props: dict[str, tuple[str, str]], required: list[str]) -> dict:
    properties = {k: {"type": t, "description": d} for k, (t, d) in props.items()}
    params = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [
    _fn(
        "get_weather",
        "Get the current weather for a city.",
        {"city": ("string", "City name"), "unit": ("string", "celsius or fahrenheit")},
        ["city"],
    ),
    _fn(
        "search_web",
        "Search the web and return the top results.",
        {"query": ("string", "Search query"), "max_results": ("integer", "How many results")},
        ["query"],
    ),
    _fn(
        "get_order",
        "Look up an order by its id.",
        {"order_id": ("string", "Order id, e.g. A-10293")},
        ["order_id"],
    ),
    _fn(
        "send_email",
        "Send an email.",
        {
            "to": ("string", "Recipient address"),
            "subject": ("string", "Subject line"),
            "body": ("string", "Message text"),
        },
        ["to", "subject", "body"],
    ),
    _fn(
        "create_event",
        "Create a calendar event.",
        {
            "title": ("string", "Event title"),
            "date": ("string", "ISO date"),
            "time": ("string", "HH:MM"),
            "attendees": ("array", "Email addresses"),
        },
        ["title", "date"],
    ),
    _fn(
        "run_sql",
        "Run a read-only SQL query on the analytics database.",
        {"query": ("string", "SQL query")},
        ["query"],
    ),
    _fn("read_file", "Read a text file from the workspace.", {"path": ("string", "File path")}, ["path"]),
    _fn(
        "convert_currency",
        "Convert an amount between currencies.",
        {
            "amount": ("number", "Amount"),
            "from_currency": ("string", "ISO code"),
            "to_currency": ("string", "ISO code"),
        },
        ["amount", "from_currency", "to_currency"],
    ),
    _fn(
        "get_stock_price",
        "Get the latest price of a stock.",
        {"symbol": ("string", "Ticker symbol")},
        ["symbol"],
    ),
    _fn(
        "multiply", "Multiply two numbers.", {"a": ("number", "First"), "b": ("number", "Second")}, ["a", "b"]
    ),
    _fn(
        "search_products",
        "Search the shop's catalogue.",
        {"query": ("string", "What to look for"), "max_price": ("number", "Price limit")},
        ["query"],
    ),
    _fn(
        "translate",
        "Translate text.",
        {"text": ("string", "Text"), "target_language": ("string", "Language name")},
        ["text", "target_language"],
    ),
]
TOOL_BY_NAME = {t["function"]["name"]: t for t in TOOLS}


def _get_weather(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    unit = rng.choice(["celsius", "fahrenheit"])
    result = {
        "city": city,
        "temp": rng.randint(-5, 35),
        "unit": unit,
        "sky": rng.choice(["sunny", "rain"]),
    }
    return (
        rng.choice([f"What's the weather in {city}?", f"Is it cold in {city} today? Use {unit}."]),
        {"city": city, "unit": unit},
        result,
    )


def _search_web(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    topic = rng.choice(TOPICS)
    results = [{"title": f"{topic.title()} explained", "url": f"https://example.org/{i}"} for i in range(2)]
    return (
        f"Search the web for recent news about {topic}.",
        {"query": f"{topic} news", "max_results": 2},
        results,
    )


def _get_order(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    oid = f"{rng.choice('ABCDK')}-{rng.randint(10000, 99999)}"
    status = rng.choice(["shipped", "processing", "delivered", "cancelled"])
    return (
        f"Where is my order {oid}?",
        {"order_id": oid},
        {"order_id": oid, "status": status, "carrier": "DHL"},
    )


def _send_email(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    to = f"{person.lower()}@example.com"
    return (
        f"Email {person} at {to} that the report is ready.",
        {"to": to, "subject": "Report ready", "body": f"Hi {person}, the report is ready."},
        {"sent": True},
    )


def _create_event(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return (
        f"Book a meeting with {person} on {date} at 10:00.",
        {"title": f"Meeting with {person}", "date": date, "time": "10:00"},
        {"event_id": rng.randint(100, 999)},
    )


def _run_sql(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    table = rng.choice(["orders", "users", "payments"])
    query = f"SELECT COUNT(*) FROM {table} WHERE created_at >= '2024-01-01'"
    return (
        f"How many {table} were created since January 2024?",
        {"query": query},
        [{"count": rng.randint(5, 9000)}],
    )


def _read_file(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    path = rng.choice(["README.md", "src/main.py", "config.yaml", "notes/todo.txt"])
    return (
        f"Show me what's in {path}.",
        {"path": path},
        {"content": "TODO: fix login bug\nTODO: add tests"},
    )


def _convert_currency(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    amount, (a, b) = rng.randint(5, 5000), rng.sample(["USD", "EUR", "JPY", "GBP", "INR"], 2)
    return (
        f"Convert {amount} {a} to {b}.",
        {"amount": amount, "from_currency": a, "to_currency": b},
        {"result": round(amount * rng.uniform(0.5, 1.5), 2), "currency": b},
    )


def _get_stock_price(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    sym = rng.choice(["AAPL", "MSFT", "NVDA", "TSLA", "AMZN"])
    return (
        f"What is {sym} trading at?",
        {"symbol": sym},
        {"symbol": sym, "price": round(rng.uniform(50, 900), 2)},
    )


def _multiply(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return f"What is {a} times {b}?", {"a": a, "b": b}, a * b


def _search_products(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    item, price = (
        rng.choice(["headphones", "desk lamp", "running shoes", "backpack"]),
        rng.randint(20, 300),
    )
    return (
        f"Find me {item} under {price} dollars.",
        {"query": item, "max_price": price},
        [{"name": f"Basic {item}", "price": price - 5}, {"name": f"Pro {item}", "price": price - 1}],
    )


def _translate(rng: random.Random, city: str, person: str) -> tuple[str, dict, Any]:
    text = rng.choice(SENTENCES)
    lang = rng.choice(["French", "Spanish", "German", "Japanese"])
    return f"Translate into {lang}: {text}", {"text": text, "target_language": lang}, {"translation": "..."}


# one tool's (user request, call arguments, tool result), given a random city and person
_REQUESTS = {
    "get_weather": _get_weather,
    "search_web": _search_web,
    "get_order": _get_order,
    "send_email": _send_email,
    "create_event": _create_event,
    "run_sql": _run_sql,
    "read_file": _read_file,
    "convert_currency": _convert_currency,
    "get_stock_price": _get_stock_price,
    "multiply": _multiply,
    "search_products": _search_products,
    "translate": _translate,
}


def _tool_request(rng: random.Random, name: str) -> tuple[str, dict, Any]:
    """(user request, call arguments, tool result) for one tool, with random slot values."""
    city, person = rng.choice(CITIES), rng.choice(NAMES)
    return _REQUESTS[name](rng, city, person)


def _tool_set(rng: random.Random, must: str) -> list[dict]:
    others = rng.sample([n for n in TOOL_BY_NAME if n != must], rng.randint(0, 3))
    names = [must, *others]
    rng.shuffle(names)
    return [TOOL_BY_NAME[n] for n in names]


def _call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _system(rng: random.Random, p: float = 0.6) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < p else []


def _chat_text(rng: random.Random) -> str:
    return rng.choice(
        [
            f"What is {rng.choice(TOPICS)}?",
            f"Explain {rng.choice(TOPICS)} to a ten-year-old.",
            f"How do I {rng.choice(HOWTOS)}?",
            f"Tell me an interesting fact about {rng.choice(CITIES)}.",
            f"Hi! I'm {rng.choice(NAMES)}. Can you help me {rng.choice(HOWTOS)}?",
            f"What are the pros and cons of {rng.choice(TOPICS)}?",
            "Hello, how are you today?",
            f"What is the difference between {rng.choice(TOPICS)} and {rng.choice(TOPICS)}?",
            f"I'm visiting {rng.choice(CITIES)} next week. What should I see?",
            f"My friend {rng.choice(NAMES)} wrote: '{rng.choice(SENTENCES)}'. How should I reply?",
            f"Why is {rng.choice(TOPICS)} important? Answer in {rng.randint(2, 4)} sentences.",
        ]
    )


def _instruction_text(rng: random.Random) -> str:
    return rng.choice(
        [
            f"Rewrite this more formally: {rng.choice(SENTENCES)}",
            f"Fix the grammar and punctuation: {rng.choice(SENTENCES)}",
            f"Summarise in one sentence:\n{rng.choice(PARAGRAPHS)}",
            f"List {rng.randint(3, 7)} {rng.choice(THINGS)}.",
            f"Give me {rng.randint(2, 5)} bullet points about {rng.choice(TOPICS)}.",
            f"Extract every number from this text as a JSON list:\n{rng.choice(PARAGRAPHS)}",
            f"Translate into {rng.choice(['French', 'Spanish', 'German'])}: {rng.choice(SENTENCES)}",
            f"Write a short email to {rng.choice(NAMES)} saying that {rng.choice(SENTENCES)}.",
        ]
    )


def _code_text(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    return rng.choice(
        [
            f"Write a {lang} function that {rng.choice(CODE_TASKS)}.",
            f"Explain what this code does:\n```\n{rng.choice(SNIPPETS)}\n```",
            f"Add type hints and a docstring:\n```python\n{rng.choice(SNIPPETS[:4])}\n```",
            f"Find the bug and fix it:\n```python\n{rng.choice(SNIPPETS[4:] + SNIPPETS[:1])}\n```",
            f"Write a unit test for a function that {rng.choice(CODE_TASKS)}.",
        ]
    )


# the kinds that are one user request: its text, and how often a system message comes before it
_TEXT_KINDS = {"chat": (_chat_text, 0.3), "instruction": (_instruction_text, 0.3), "code": (_code_text, 0.4)}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _tool_prompt(rng: random.Random, kind: str) -> PromptSpec:
    """A "tool_call", "tool_result" or "agent" prompt."""
    name = rng.choice(list(TOOL_BY_NAME))
    tools = _tool_set(rng, name)
    request, args, result = _tool_request(rng, name)
    if kind == "tool_call":
        # like bind_tools(..., tool_choice=...) in the chat model: the call's start is often forced
        choice = rng.choice([None, None, "any", name])
        return PromptSpec(kind, [*_system(rng, 0.5), _user(request)], tools, choice)
    msgs = [*_system(rng, 0.5 if kind == "tool_result" else 0.8), _user(request)]
    msgs += [{"role": "assistant", "content": "", "tool_calls": [_call(name, args)]}]
    msgs += [{"role": "tool", "name": name, "content": json.dumps(result)}]
    if kind == "tool_result":
        return PromptSpec(kind, msgs, tools)
    # agent: a short multi-turn history, then a follow-up that may need another call
    msgs += [{"role": "assistant", "content": f"Here is what I found: {json.dumps(result)[:80]}"}]
    follow_name = rng.choice([t["function"]["name"] for t in tools])
    follow, _, _ = _tool_request(rng, follow_name)
    follow = rng.choice([follow, "Thanks! Can you summarise that in one line?", f"And also: {follow}"])
    msgs += [_user(follow)]
    return PromptSpec(kind, msgs, tools, rng.choice([None, None, "any"]))


def make_prompt(seed: int, index: int) -> PromptSpec:
    """Prompt ``index`` of the generator seeded with ``seed`` (a pure function of the two)."""
    rng = random.Random(f"agentspec-distill:{seed}:{index}")
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    if kind in _TEXT_KINDS:
        text_of, p_system = _TEXT_KINDS[kind]
        text = text_of(rng)
        return PromptSpec(kind, [*_system(rng, p_system), _user(text)])
    return _tool_prompt(rng, kind)


def make_prompts(n: int, seed: int = 0) -> list[PromptSpec]:
    """``n`` distinct prompts (duplicates of earlier ones are skipped, and replaced by later indices)."""
    out: list[PromptSpec] = []
    seen: set[str] = set()
    index = 0
    while len(out) < n and index < 20 * n:
        spec = make_prompt(seed, index)
        index += 1
        if (key := spec.key()) not in seen:
            seen.add(key)
            out.append(spec)
    return out


# ------------------------------------------------------------------------------------- rendering
def render(tokenizer: Any, spec: PromptSpec) -> list[int]:
    """Token ids of ``spec`` with the assistant's generation prompt (and any forced start)."""
    return chat.render(tokenizer, spec.chat_messages(), spec.tools, spec.tool_choice).ids
