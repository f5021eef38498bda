"""Constrained tool calls and structured output to ask for: the tasks of ``bench_grammar.py``, shared
with ``tests/test_chat_grammar.py`` (which checks that every call and output validates).

Three LangChain tools with the prompts that need them, and two pydantic schemas with texts to fill
them from.
"""

from __future__ import annotations

from langchain_core.tools import tool
from pydantic import BaseModel, Field


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


@tool
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
