"""A held set of function tools for tool-calling checks: nested objects, enums, arrays,
optional fields, nullable fields and numbers with bounds; each with a user request that
calls for it. Written for these tests; no schema here was used to build the grammar."""

from __future__ import annotations

from typing import Any


def _tool(name: str, description: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        out["required"] = required
    return out


STR = {"type": "string"}

HELD: list[tuple[dict[str, Any], str]] = [
    (
        _tool(
            "get_weather",
            "Current weather in a city",
            _obj(
                {"city": STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                ["city", "unit"],
            ),
        ),
        "What is the weather in Lisbon, in celsius?",
    ),
    (
        _tool(
            "book_flight",
            "Book a flight",
            _obj(
                {
                    "origin": STR,
                    "destination": STR,
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                ["origin", "destination", "passengers"],
            ),
        ),
        "Book a flight from Oslo to Rome for two people.",
    ),
    (
        _tool(
            "set_thermostat",
            "Set the heating's target temperature",
            _obj({"temperature": {"type": "number", "minimum": 5, "maximum": 30}}, ["temperature"]),
        ),
        "Set the heating to 21 degrees.",
    ),
    (
        _tool(
            "create_event",
            "Put an event in the calendar",
            _obj(
                {
                    "title": STR,
                    "attendees": {"type": "array", "items": STR, "maxItems": 4},
                },
                ["title", "attendees"],
            ),
        ),
        "Add a team lunch with Ana and Ben to my calendar.",
    ),
    (
        _tool(
            "search_products",
            "Search the shop",
            _obj(
                {
                    "query": STR,
                    "filters": _obj(
                        {
                            "category": {"type": "string", "enum": ["books", "games", "tools"]},
                            "max_price": {"type": "number", "minimum": 0},
                        }
                    ),
                },
                ["query"],
            ),
        ),
        "Find me a board game under 30 euros.",
    ),
    (
        _tool(
            "send_email",
            "Send an email",
            _obj(
                {
                    "to": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3},
                    "subject": STR,
                    "body": STR,
                    "cc": {"type": "array", "items": STR},
                },
                ["to", "subject", "body"],
            ),
        ),
        "Email sam@example.com that the meeting moved to Friday.",
    ),
    (
        _tool(
            "add_todo",
            "Add an item to the to-do list",
            _obj(
                {
                    "task": STR,
                    "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                    "due": STR,
                },
                ["task", "priority"],
            ),
        ),
        "Remind me to renew my passport, it is urgent.",
    ),
    (
        _tool(
            "convert_currency",
            "Convert an amount between currencies",
            _obj(
                {
                    "amount": {"type": "number", "exclusiveMinimum": 0},
                    "source": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
                    "target": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
                },
                ["amount", "source", "target"],
            ),
        ),
        "How much is 50 dollars in euros?",
    ),
    (
        _tool(
            "get_stock_price",
            "Latest price of a stock",
            _obj({"ticker": {"type": "string", "maxLength": 5}}, ["ticker"]),
        ),
        "What is Apple's share price?",
    ),
    (
        _tool(
            "order_pizza",
            "Order pizzas",
            _obj(
                {
                    "size": {"type": "string", "enum": ["small", "medium", "large"]},
                    "toppings": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["cheese", "ham", "olives", "basil"]},
                    },
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                ["size", "toppings", "quantity"],
            ),
        ),
        "Two large pizzas with ham and olives, please.",
    ),
    (
        _tool(
            "translate",
            "Translate a text",
            _obj(
                {"text": STR, "language": {"type": "string", "enum": ["fr", "de", "es", "it"]}},
                ["text", "language"],
            ),
        ),
        "Translate 'good morning' into German.",
    ),
    (
        _tool(
            "create_user",
            "Create a user account",
            _obj(
                {
                    "user": _obj(
                        {
                            "name": STR,
                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                            "email": STR,
                        },
                        ["name", "age"],
                    ),
                    "roles": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                    },
                },
                ["user", "roles"],
            ),
        ),
        "Make an editor account for Maria, who is 34.",
    ),
    (
        _tool(
            "schedule_meeting",
            "Schedule a meeting",
            _obj(
                {
                    "participants": {
                        "type": "array",
                        "items": _obj({"name": STR, "optional": {"type": "boolean"}}, ["name"]),
                        "maxItems": 5,
                    },
                    "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 240},
                },
                ["participants", "duration_minutes"],
            ),
        ),
        "Set up a one-hour meeting with Lee; Kim may join if free.",
    ),
    (
        _tool(
            "rate_movie",
            "Rate a film",
            _obj(
                {
                    "title": STR,
                    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                    "review": STR,
                },
                ["title", "rating"],
            ),
        ),
        "Give Casablanca five stars.",
    ),
    (
        _tool(
            "calculate_route",
            "Route through waypoints",
            _obj(
                {
                    "waypoints": {
                        "type": "array",
                        "items": _obj(
                            {
                                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                            },
                            ["lat", "lon"],
                        ),
                        "minItems": 2,
                        "maxItems": 4,
                    }
                },
                ["waypoints"],
            ),
        ),
        "Route me from Paris (48.85, 2.35) to Lyon (45.76, 4.84).",
    ),
    (
        _tool(
            "set_alarm",
            "Set an alarm",
            _obj(
                {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                    "repeat": {"type": "boolean"},
                },
                ["hour", "minute", "repeat"],
            ),
        ),
        "Wake me at 6:45 every day.",
    ),
    (
        _tool(
            "lookup_word",
            "Look a word up in the dictionary",
            _obj({"word": STR, "include_examples": {"type": "boolean"}}, ["word"]),
        ),
        "What does 'ephemeral' mean?",
    ),
    (
        _tool(
            "update_inventory",
            "Change stock counts",
            _obj(
                {
                    "items": {
                        "type": "array",
                        "items": _obj(
                            {
                                "sku": STR,
                                "delta": {"type": "integer", "minimum": -100, "maximum": 100},
                            },
                            ["sku", "delta"],
                        ),
                        "minItems": 1,
                        "maxItems": 3,
                    }
                },
                ["items"],
            ),
        ),
        "We sold 3 of item A-12 and received 10 of B-7.",
    ),
    (
        _tool(
            "file_ticket",
            "File a bug report",
            _obj(
                {
                    "severity": {"type": "string", "enum": ["minor", "major", "critical"]},
                    "component": STR,
                    "tags": {"type": "array", "items": STR, "maxItems": 3},
                    "details": _obj(
                        {
                            "steps": {"type": "array", "items": STR, "maxItems": 3},
                            "expected": STR,
                        },
                        ["steps", "expected"],
                    ),
                },
                ["severity", "component", "details"],
            ),
        ),
        "The login page crashes when I press enter; it should log me in.",
    ),
    (
        _tool(
            "play_music",
            "Play music",
            _obj(
                {
                    "artist": STR,
                    "genre": {"type": "string", "enum": ["jazz", "rock", "classical"]},
                    "shuffle": {"type": "boolean"},
                    "volume": {"type": "number", "minimum": 0, "maximum": 1},
                },
                ["artist", "shuffle", "volume"],
            ),
        ),
        "Play some Miles Davis quietly, shuffled.",
    ),
    (
        _tool(
            "reserve_table",
            "Reserve a restaurant table",
            _obj(
                {
                    "restaurant": STR,
                    "party_size": {"type": "integer", "minimum": 1, "maximum": 12},
                    "time": STR,
                    "notes": {"type": ["string", "null"]},
                },
                ["restaurant", "party_size", "time", "notes"],
            ),
        ),
        "A table for four at Luigi's at 8 pm.",
    ),
    (
        _tool("get_time", "The current time", _obj({})),
        "What time is it?",
    ),
    (
        _tool("flip_coin", "Flip a coin", None),
        "Flip a coin for me.",
    ),
]
"""``(tool, user message)`` pairs."""
