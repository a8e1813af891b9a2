"""What the engine would answer with a 500, refused by the gateway with a 400 first.

The default engine answers many client mistakes with a server error (a number JSON cannot hold, a
lone UTF-16 surrogate, a role that is not a string, image parts, a nameless tool, an `input`
nested too deep): wrong for the client, whose mistake reads as ours, and counted against the
replica's revision, which a canary update is judged by. So every /v1/ body is checked here,
after the JSON is parsed and before anything is sent, by the rules its endpoint names
(gateway.endpoints), against what OpenAI documents and what the engine can take.
docs/security.md#bodies-the-engine-would-fail-on says what it refuses and what it costs.
"""

from __future__ import annotations

import binascii
import dataclasses
import math
import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from . import errors
from .errors import Refusal

# The roles OpenAI documents ("function" is its deprecated one, still taken); the default engine
# passes any string to the chat template, and templates differ in what they do with others.
ROLES = ("system", "user", "assistant", "tool", "developer", "function")
_ROLES = frozenset(ROLES)
# What the default engine takes as content parts of a text model. It also knows image_url,
# input_audio, input_video and video_url, but answers them with a 500 unless it was started with
# a multimodal projector (--mmproj): images are taken for a model that names one (its catalog
# entry's `vision`), the rest never.
PART_TYPES = ("text",)
MEDIA_PART_TYPES = ("image_url", "input_audio", "input_video", "video_url", "file")
# An image a client sends: inline, as a data URL (or Anthropic's base64 source) of one of these
# types, counted against the body's limit like the rest of the body; or a remote URL, which the
# gateway fetches itself from a host on LLMGW_GATEWAY_IMAGE_HOSTS (gateway.images) and sends on
# inline, so that no engine fetches anything. At most MAX_IMAGES a request.
IMAGE_TYPES = ("png", "jpeg", "jpg", "gif", "webp", "bmp")
MAX_IMAGES = 16
_DATA_URL = re.compile(r"data:image/([a-z]+);base64,", re.IGNORECASE)
MAX_STOP = 4
# The default engine's own values (common_reasoning_format_from_name); any other is a 500.
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
INT32_MAX = 2**31 - 1
INT64 = 2**63
# How much of a client's own text a refusal repeats.
SHOWN_CHARS = 40

_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


class _Bad(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


Rules = Callable[[dict[str, Any]], None]


@dataclasses.dataclass
class Images:
    """What a body's check found of images: how many, and the remote URLs to fetch."""

    count: int = 0
    remote: list[str] = dataclasses.field(default_factory=list)


# Set by refusal() for the body it checks: None while the model takes no images.
_images: ContextVar[Images | None] = ContextVar("images", default=None)


def refusal(
    rules: Rules | None,
    body: dict[str, Any],
    images: Images | None = None,
    *,
    walk: bool = True,
) -> Refusal | None:
    """None when the engine can take this body under `rules`, an endpoint's (gateway.endpoints);
    otherwise the 400 that says what is wrong, with `param`
    naming the field. Without rules, only every value is checked.

    It runs on every request, so it is one plain pass: a walk over every value (finite
    numbers, valid strings), then the endpoint's fields by a table; only when the walk finds
    something is the body walked again to name where. The walk is bounded by the body itself:
    the gateway takes at most LLMGW_GATEWAY_MAX_BODY bytes and 64 levels of nesting
    (gateway.relay.parse_body), and every value costs at least one byte of it. Fields the table
    does not name pass unchecked (the engine checks its many own); only their numbers and
    strings are walked. tests/gateway/test_validate.py lists bodies the engine answered with a
    500.

    `images`: the model takes images (a vision model); what the body holds of them is noted
    there. Without it an image is refused: the engine would fail on it. `walk`: False where
    the values were walked already (refusal(None, body) alone), before the model was known."""
    token = _images.set(images)
    try:
        if walk and not _sound(body):
            _locate_unsound(body)
        if rules is not None:
            rules(body)
    except _Bad as bad:
        return errors.bad_request(bad.message, param=bad.param)
    finally:
        _images.reset(token)
    return None


def _image(url: Any, where: str, kind: str) -> None:
    """An image part's URL, for a model that takes images: a data URL of an image, or an
    http(s) URL the gateway may fetch (noted for gateway.images); else a 400."""
    images = _images.get()
    if images is None:
        raise _Bad(
            f"{where} is a part of type {kind}, and this model takes text only (its engine has no "
            "image or audio encoder). Send the content as text parts or a string, or ask "
            "for a model that takes images.",
            f"{where}.type",
        )
    images.count += 1
    if images.count > MAX_IMAGES:
        raise _Bad(f"{where}: a request may carry at most {MAX_IMAGES} images; send fewer.", where)
    if not isinstance(url, str) or not url:
        raise _Bad(
            f"{where} needs the image's URL: a data URL like 'data:image/png;base64,...' or an "
            f"https URL; got {_what(url)}.",
            where,
        )
    if url[:5].lower() == "data:":
        _data_url(url, where)
    elif url[:8].lower() == "https://" or url[:7].lower() == "http://":
        images.remote.append(url)
    else:
        raise _Bad(
            f"{where} must be an image as a data URL like 'data:image/png;base64,...' or an "
            f"http(s) URL; got {_shown(url)}.",
            where,
        )


def _data_url(url: str, where: str) -> None:
    found = _DATA_URL.match(url)
    if found is None or found.group(1).lower() not in IMAGE_TYPES:
        raise _Bad(
            f"{where} is a data URL, but not of an image in base64: write it "
            f"'data:image/TYPE;base64,DATA' with TYPE one of {', '.join(IMAGE_TYPES)}.",
            where,
        )
    _base64(url[found.end() :], where)


def _base64(data: str, where: str) -> None:
    try:
        binascii.a2b_base64(data.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise _Bad(f"{where}: the image's data is not valid base64.", where) from None


# -- every value: finite numbers, valid strings ------------------------------------------------

# What, in a body's JSON text, could be read as an unsound value: an escape (a lone surrogate is
# written \udXXX), a number with an exponent, or a mantissa long enough to overflow a float. A
# run of digits is tried from its first digit only: tried from each, a body of 299-digit runs
# took the search 0.45 s a megabyte, against 0.08.
_MAY_BE_UNSOUND = re.compile(rb"\\u|[0-9][eE]|(?<![0-9])[0-9]{300}")


def plain(raw: bytes) -> bool:
    """Whether the JSON text `raw` cannot hold a value _sound() objects to, so the walk over
    its values can be left out: ASCII (so no encoded surrogate) with no escape, no exponent
    and no 300-digit number (so every float is finite: JSON has no NaN or Infinity, and
    core.jsontext refuses them). One pass in C over the bytes, against a walk in Python over
    every value; a body that is not plain is walked."""
    return raw.isascii() and _MAY_BE_UNSOUND.search(raw) is None


def _sound(body: dict[str, Any]) -> bool:
    """Whether every number in the body is finite and every string (keys too) valid Unicode.
    The fast pass: no paths kept, and a container's strings and numbers are looked at where
    they stand rather than pushed on the stack (most of a body is strings in objects)."""
    isfinite = math.isfinite
    surrogate = _SURROGATE.search
    pending: list[Any] = [body]
    pop, push = pending.pop, pending.append
    while pending:
        container = pop()
        if type(container) is dict:
            for key in container:
                # isascii() reads a flag CPython keeps: most strings cost nothing more.
                if not key.isascii() and surrogate(key):
                    return False
            values = container.values()
        else:
            values = container
        for item in values:
            kind = type(item)
            if kind is str:
                if not item.isascii() and surrogate(item):
                    return False
            elif kind is dict or kind is list:
                push(item)
            elif kind is float and not isfinite(item):
                return False
    return True


def _locate_unsound(body: dict[str, Any]) -> None:
    """Raise _Bad for the first value _sound() objects to, naming where it is."""
    # Depth first, in the body's own order, so the first problem in it is the one named.
    pending: list[tuple[Any, str]] = [(body, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise _Bad(_surrogate_message(path or "the body"), path)
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    where = f"a key in {path}" if path else "a key of the body"
                    raise _Bad(_surrogate_message(where), path or _shown(key))
            pending.extend((value, _join(path, key)) for key, value in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend(
                (item[index], f"{path}[{index}]") for index in range(len(item) - 1, -1, -1)
            )
        elif isinstance(item, float) and not math.isfinite(item):
            raise _Bad(
                f"{path} is a number beyond what the engine can read (it parses as "
                f"{'infinity' if item > 0 else '-infinity'}); send an ordinary finite number.",
                path,
            )


def _surrogate_message(where: str) -> str:
    return (
        f"{where} has a lone UTF-16 surrogate (an escape from \\ud800 to \\udfff without its "
        "pair), which is no character; send valid Unicode text (an escaped character beyond "
        "U+FFFF is a pair: high \\ud800-\\udbff, then low \\udc00-\\udfff)."
    )


def _join(path: str, key: str) -> str:
    part = key if _IDENTIFIER.match(key) else _shown(key)
    if not path:
        return part
    return f"{path}.{part}" if _IDENTIFIER.match(key) else f"{path}[{part}]"


def _shown(value: Any) -> str:
    text = ascii(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


# -- fields by type and range ----------------------------------------------------------------


def _what(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {_shown(value)}"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    # JSON does not tell 4 from 4.0; a whole number written either way is one.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _number(low: float, high: float, meaning: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not _is_number(value) or not low <= value <= high:
            raise _Bad(
                f"{name} must be a number from {low:g} to {high:g} ({meaning}); got "
                f"{_what(value)}. Omit it for the default.",
                name,
            )

    return check


def _integer(low: int, high: int, meaning: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not _is_integer(value) or not low <= value <= high:
            raise _Bad(
                f"{name} must be a whole number from {low:,} to {high:,} ({meaning}); got "
                f"{_what(value)}. Omit it for the default.",
                name,
            )

    return check


def _boolean(meaning: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise _Bad(f"{name} must be true or false ({meaning}); got {_what(value)}.", name)

    return check


def _string(meaning: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise _Bad(f"{name} must be a string ({meaning}); got {_what(value)}.", name)

    return check


def _choice(choices: tuple[str, ...], meaning: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str) or value not in choices:
            raise _Bad(
                f"{name} must be one of {', '.join(repr(c) for c in choices)} ({meaning}); got "
                f"{_what(value)}.",
                name,
            )

    return check


def _stop(name: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if (
        isinstance(value, list)
        and len(value) <= MAX_STOP
        and all(isinstance(s, str) for s in value)
    ):
        return
    raise _Bad(
        f"{name} must be a string or a list of at most {MAX_STOP} strings (where the answer "
        f"stops); got {_what(value) if not isinstance(value, list) else _list_what(value)}.",
        name,
    )


def _list_what(value: list[Any]) -> str:
    if len(value) > MAX_STOP:
        return f"a list of {len(value)}"
    wrong = next(s for s in value if not isinstance(s, str))
    return f"a list holding {_what(wrong)}"


def _logit_bias(name: str, value: Any) -> None:
    """OpenAI's object of token ids to biases, or the default engine's own list of [token, bias]
    pairs (a token id or a piece of text; false for never), which its clients send."""
    if isinstance(value, list):
        for number, pair in enumerate(value):
            where = f"{name}[{number}]"
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or not (
                    (_is_integer(pair[0]) and pair[0] >= 0)
                    or (isinstance(pair[0], str) and pair[0])
                )
            ):
                raise _Bad(
                    f"{where} must be a pair [token, bias]: a token id (or a piece of text) and "
                    f"a bias from -100 to 100, or false for never; got {_what(pair)}.",
                    where,
                )
            _bias(where, pair[1])
        return
    if not isinstance(value, dict):
        raise _Bad(
            f"{name} must be an object mapping token ids to a bias from -100 to 100, like "
            f'{{"50256": -100}}; got {_what(value)}.',
            name,
        )
    for token, bias in value.items():
        if not token.isdigit():
            raise _Bad(
                f"{name} maps token ids to biases: {_shown(token)} is not a token id (a whole "
                "number written as a string).",
                f"{name}[{_shown(token)}]",
            )
        _bias(f"{name}[{_shown(token)}]", bias)


def _bias(where: str, bias: Any) -> None:
    if bias is False:
        return  # the default engine's "never"
    if not _is_number(bias) or not -100 <= bias <= 100:
        raise _Bad(
            f"{where} must be a number from -100 to 100 (or false for never); got {_what(bias)}.",
            where,
        )


def _stream_options(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _Bad(
            f'{name} must be an object, like {{"include_usage": true}}; got {_what(value)}.', name
        )
    if "include_usage" in value and not isinstance(value["include_usage"], bool):
        raise _Bad(
            f"{name}.include_usage must be true or false; got {_what(value['include_usage'])}.",
            f"{name}.include_usage",
        )


_SAMPLING: dict[str, Callable[[str, Any], None]] = {
    "temperature": _number(0, 2, "higher is more random"),
    "top_p": _number(0, 1, "the share of probability mass sampled from"),
    "n": _integer(1, 128, "how many answers to generate"),
    "max_tokens": _integer(1, INT32_MAX, "the most tokens the answer may have"),
    "presence_penalty": _number(-2, 2, "positive values favour new topics"),
    "frequency_penalty": _number(-2, 2, "positive values discourage repeats"),
    "seed": _integer(-INT64, INT64 - 1, "for repeatable sampling"),
    "stop": _stop,
    "stream": _boolean("whether to send the answer as it is generated"),
    "stream_options": _stream_options,
    "logit_bias": _logit_bias,
    "user": _string("an id of your end user"),
}

_CHAT_FIELDS: dict[str, Callable[[str, Any], None]] = {
    **_SAMPLING,
    "max_completion_tokens": _integer(1, INT32_MAX, "the most tokens the answer may have"),
    "logprobs": _boolean("whether to return the answer's token log probabilities"),
    "top_logprobs": _integer(0, 20, "how many likely tokens to list at each position"),
    "parallel_tool_calls": _boolean("whether the model may call several tools at once"),
    "reasoning_format": _choice(REASONING_FORMATS, "how the engine returns reasoning"),
}

_COMPLETION_FIELDS: dict[str, Callable[[str, Any], None]] = {
    **_SAMPLING,
    "logprobs": _integer(0, 5, "how many likely tokens to list at each position"),
    "echo": _boolean("whether to repeat the prompt in the answer"),
    "best_of": _integer(1, 20, "how many answers to generate server-side"),
    "suffix": _string("the text that comes after the completion"),
}

_EMBEDDING_FIELDS: dict[str, Callable[[str, Any], None]] = {
    "encoding_format": _choice(("float", "base64"), "how the vectors are written"),
    "dimensions": _integer(1, INT32_MAX, "the length of the vectors"),
    "user": _string("an id of your end user"),
}


def _fields(body: dict[str, Any], table: dict[str, Callable[[str, Any], None]]) -> None:
    # Walk the shorter of the two: a body of a thousand unknown keys costs nothing here, and
    # the usual body of four keys is not looked up by the table's forty.
    if len(body) < len(table):
        for name, value in body.items():
            check = table.get(name)
            if check is not None and value is not None:  # null means "the default"
                check(name, value)
        return
    for name, check in table.items():
        value = body.get(name)
        if value is not None:
            check(name, value)


# -- /v1/chat/completions --------------------------------------------------------------------


def chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "nothing" if messages is None else _what(messages)
        raise _Bad(
            "messages must be a non-empty list of messages, like "
            f'[{{"role": "user", "content": "Hello"}}]; got {got}.',
            "messages",
        )
    roles = _ROLES
    for index, message in enumerate(messages):
        # The usual message, {"role": "user", "content": "..."} or with text parts, passes at
        # a glance; the rest is looked at field by field.
        if type(message) is dict and len(message) == 2:
            role = message.get("role")
            content = message.get("content")
            if (
                type(role) is str
                and role in roles
                and (type(content) is str or (type(content) is list and _plain_parts(content)))
            ):
                continue
        _message(message, f"messages[{index}]")
    _fields(body, _CHAT_FIELDS)
    if body.get("tools") is not None:
        _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"])
    if body.get("response_format") is not None:
        _response_format(body["response_format"])
    if body.get("json_schema") is not None and body.get("grammar"):
        raise _Bad(
            "Send either json_schema or grammar, not both: each constrains the whole answer.",
            "grammar",
        )


def _plain_parts(parts: list[Any]) -> bool:
    for part in parts:
        if (
            type(part) is not dict
            or part.get("type") != "text"
            or type(part.get("text")) is not str
        ):
            return False
    return True


def _message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise _Bad(
            f'{where} must be an object with a role and content, like {{"role": "user", '
            f'"content": "Hello"}}; got {_what(message)}.',
            where,
        )
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        got = "no role" if "role" not in message else _what(role)
        raise _Bad(
            f"{where}.role must be one of {', '.join(ROLES)}; got {got}.",
            f"{where}.role",
        )
    tool_calls = message.get("tool_calls")
    if "content" not in message or message["content"] is None:
        # Only an assistant's turn may be all tool calls.
        if role != "assistant" or not tool_calls:
            raise _Bad(
                f"{where} ({role}) needs content: a string, or a list of text parts like "
                '[{"type": "text", "text": "Hello"}]'
                + (
                    " (an assistant message may instead have tool_calls)."
                    if role == "assistant"
                    else "."
                ),
                f"{where}.content",
            )
    else:
        _content(message["content"], f"{where}.content")
    for field in ("name", "tool_call_id", "reasoning_content"):
        if field in message and not isinstance(message[field], str):
            raise _Bad(
                f"{where}.{field} must be a string; got {_what(message[field])}. Omit it if "
                "there is none.",
                f"{where}.{field}",
            )
    if tool_calls is not None:
        if role != "assistant":
            raise _Bad(
                f"{where}.tool_calls belongs to assistant messages only (this one is {role}).",
                f"{where}.tool_calls",
            )
        _tool_calls(tool_calls, f"{where}.tool_calls")


def _content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _Bad(
            f'{where} must be a string or a list of text parts like [{{"type": "text", "text": '
            f'"Hello"}}]; got {_what(content)}.',
            where,
        )
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in PART_TYPES:
            if not isinstance(part.get("text"), str):
                got = "no text" if "text" not in part else _what(part["text"])
                raise _Bad(f"{at}.text must be a string; got {got}.", f"{at}.text")
        elif kind == "image_url":
            image = part.get("image_url")
            _image(image.get("url") if isinstance(image, dict) else image, at, kind)
        elif kind in MEDIA_PART_TYPES:
            raise _Bad(
                f"{at} is a part of type {kind}, and this model takes text only (its engine has no "
                "image or audio encoder). Send the content as text parts or a string, or ask "
                "for a model that takes images.",
                f"{at}.type",
            )
        else:
            got = _what(part) if not isinstance(part, dict) else f"type {_what(kind)}"
            raise _Bad(
                f'{at} must be a text part like {{"type": "text", "text": "Hello"}}; got {got}.',
                f"{at}.type" if isinstance(part, dict) else at,
            )


def _tool_calls(tool_calls: Any, where: str) -> None:
    example = '[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'
    if not isinstance(tool_calls, list):
        raise _Bad(f"{where} must be a list like {example}; got {_what(tool_calls)}.", where)
    for index, call in enumerate(tool_calls):
        at = f"{where}[{index}]"
        if not isinstance(call, dict) or call.get("type") != "function":
            raise _Bad(f"{at} must be a function call, as in {example}.", f"{at}.type")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Bad(
                f"{at}.function must be an object with a string name and the arguments, as in "
                f"{example}.",
                f"{at}.function",
            )
        arguments = function.get("arguments")
        if not isinstance(arguments, str | dict):
            raise _Bad(
                f"{at}.function.arguments must be the call's arguments as a JSON string, like "
                f'"{{}}"; got {"nothing" if "arguments" not in function else _what(arguments)}.',
                f"{at}.function.arguments",
            )
        if "id" in call and not isinstance(call["id"], str):
            raise _Bad(f"{at}.id must be a string; got {_what(call['id'])}.", f"{at}.id")


def _tools(tools: Any) -> None:
    example = '[{"type": "function", "function": {"name": "f", "parameters": {...}}}]'
    if not isinstance(tools, list):
        raise _Bad(f"tools must be a list like {example}; got {_what(tools)}.", "tools")
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _Bad(
                f'{at} must be a function tool (type "function"), as in {example}.',
                f"{at}.type",
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Bad(
                f"{at}.function must be an object with a string name, as in {example}.",
                f"{at}.function",
            )
        for field, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON Schema object"),
        ):
            value = function.get(field)
            if value is not None and not isinstance(value, kind):
                raise _Bad(
                    f"{at}.function.{field} must be {what}; got {_what(value)}.",
                    f"{at}.function.{field}",
                )


def _tool_choice(choice: Any) -> None:
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        return
    raise _Bad(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        f'{{"name": "f"}}}}; got {_what(choice)}.',
        "tool_choice",
    )


def _response_format(value: Any) -> None:
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise _Bad(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}; got '
            f"{_what(value) if not isinstance(value, dict) else 'type ' + _what(value.get('type'))}.",
            "response_format" if not isinstance(value, dict) else "response_format.type",
        )
    if value["type"] == "json_schema":
        wrapper = value.get("json_schema")
        if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema", {}), dict):
            raise _Bad(
                'response_format.json_schema must be an object like {"name": "...", "schema": '
                "{...}} whose schema is a JSON Schema object.",
                "response_format.json_schema",
            )


# -- /v1/completions and /v1/embeddings ----------------------------------------------------


def completions(body: dict[str, Any]) -> None:
    _text_or_tokens(body, "prompt")
    _fields(body, _COMPLETION_FIELDS)


def embeddings(body: dict[str, Any]) -> None:
    _text_or_tokens(body, "input")
    _fields(body, _EMBEDDING_FIELDS)


def _text_or_tokens(body: dict[str, Any], name: str) -> None:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids: the
    four shapes OpenAI documents for `prompt` and `input` (the engine answers others, a list
    nested deeper among them, with a 500)."""
    value = body.get(name)
    shapes = (
        "a string, a list of strings, a list of token ids or a list of lists of token ids, like "
        '"Hello" or [[1, 2, 3]]'
    )
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        got = "nothing" if name not in body else _what(value)
        raise _Bad(f"{name} must be {shapes}; got {got}.", name)
    first = value[0]
    if isinstance(first, str):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise _Bad(
                    f"{name} is a list of strings, so {name}[{index}] must be one too; got "
                    f"{_what(item)}.",
                    f"{name}[{index}]",
                )
    elif isinstance(first, list):
        for index, item in enumerate(value):
            if not isinstance(item, list) or not item:
                raise _Bad(
                    f"{name} is a list of token lists, so {name}[{index}] must be a non-empty "
                    f"list of token ids; got {_what(item)}.",
                    f"{name}[{index}]",
                )
            _tokens(item, f"{name}[{index}]")
    elif type(first) is int:
        _tokens(value, name)
    else:
        raise _Bad(f"{name} must be {shapes}; got a list holding {_what(first)}.", f"{name}[0]")


def _tokens(tokens: list[Any], where: str) -> None:
    for index, token in enumerate(tokens):
        if type(token) is not int or token < 0:
            why = (
                f" {where} is read as token ids because its first item is one; send text as a "
                "string or a list of strings."
                if index
                else ""
            )
            raise _Bad(
                f"{where}[{index}] must be a token id (a whole number from 0); got "
                f"{_what(token)}.{why}",
                f"{where}[{index}]",
            )


# -- /v1/responses (OpenAI's Responses API, stateless) ----------------------------------------

_RESPONSE_ROLES = ("user", "system", "developer", "assistant")
_RESPONSE_PARTS = ("input_text", "output_text", "refusal", "input_image", "input_file")
_RESPONSE_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
_RESPONSES_FIELDS: dict[str, Callable[[str, Any], None]] = {
    "instructions": _string("the system prompt"),
    "max_output_tokens": _integer(1, INT32_MAX, "the most tokens the answer may have"),
    "temperature": _number(0, 2, "higher is more random"),
    "top_p": _number(0, 1, "the share of probability mass sampled from"),
    "stream": _boolean("whether to send the answer as it is generated"),
    "parallel_tool_calls": _boolean("whether the model may call several tools at once"),
    "user": _string("an id of your end user"),
}


def responses(body: dict[str, Any]) -> None:
    """The Responses API as the gateway serves it: stateless, the whole conversation in `input`
    (the gateway keeps no responses to continue from)."""
    if body.get("previous_response_id") is not None:
        raise _Bad(
            "previous_response_id is not taken: this gateway keeps no responses to continue "
            "from. Send the whole conversation as input (earlier turns as items) with "
            '"store": false.',
            "previous_response_id",
        )
    if body.get("store") is True:
        raise _Bad(
            'store: true is not taken: this gateway keeps no responses. Send "store": false '
            "(or leave it out) and the whole conversation as input.",
            "store",
        )
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise _Bad(f"store must be false or left out; got {_what(body['store'])}.", "store")
    value = body.get("input")
    example = '"Hello" or [{"role": "user", "content": "Hello"}]'
    if isinstance(value, str):
        pass
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            _response_item(item, f"input[{index}]")
    else:
        got = "nothing" if "input" not in body else _what(value)
        raise _Bad(
            f"input must be a string or a non-empty list of items, like {example}; got {got}.",
            "input",
        )
    _fields(body, _RESPONSES_FIELDS)
    tools = body.get("tools")
    if tools is not None:
        # Function tools need a name; a hosted tool (web_search, file_search...) has none, and the
        # engine leaves it aside (Codex lists its web search among its tools).
        _named_list(
            tools,
            "tools",
            '[{"type": "function", "name": "f", "parameters": {...}}]',
            named=lambda tool: tool.get("type", "function") == "function",
        )


def _response_item(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _Bad(
            f'{where} must be an object, like {{"role": "user", "content": "Hello"}}; got '
            f"{_what(item)}.",
            where,
        )
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in _RESPONSE_ITEMS:
        raise _Bad(
            f"{where}.type must be one of {', '.join(_RESPONSE_ITEMS)} (or leave it out for a "
            f"message with a role); got {_what(kind)}.",
            f"{where}.type",
        )
    if kind == "message":
        role = item.get("role")
        if role not in _RESPONSE_ROLES:
            raise _Bad(
                f"{where}.role must be one of {', '.join(_RESPONSE_ROLES)}; got {_what(role)}.",
                f"{where}.role",
            )
        content = item.get("content")
        if isinstance(content, str):
            return
        if not isinstance(content, list):
            raise _Bad(
                f"{where}.content must be a string or a list of parts like "
                f'[{{"type": "input_text", "text": "Hello"}}]; got {_what(content)}.',
                f"{where}.content",
            )
        for index, part in enumerate(content):
            _response_part(part, f"{where}.content[{index}]")
    elif kind == "function_call":
        _strings(item, where, ("call_id", "name", "arguments"))
    elif kind == "function_call_output":
        _strings(item, where, ("call_id",))
        if not isinstance(item.get("output"), str | list):
            raise _Bad(
                f"{where}.output must be the tool's output as a string; got "
                f"{_what(item.get('output'))}.",
                f"{where}.output",
            )
    else:  # reasoning
        content = item.get("content")
        if not (
            isinstance(content, list)
            and content
            and isinstance(content[0], dict)
            and isinstance(content[0].get("text"), str)
        ):
            raise _Bad(
                f'{where}.content must be a list of text parts, like [{{"type": '
                '"reasoning_text", "text": "..."}]; a reasoning item without it cannot be sent.',
                f"{where}.content",
            )


def _response_part(part: Any, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        if not isinstance(part.get("text"), str):
            raise _Bad(
                f"{where}.text must be a string; got {_what(part.get('text'))}.", f"{where}.text"
            )
    elif kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise _Bad(f"{where}.refusal must be a string.", f"{where}.refusal")
    elif kind == "input_image":
        _image(part.get("image_url"), where, kind)
    elif kind == "input_file":
        raise _Bad(
            f"{where} is a part of type {kind}, and this model takes text only (its engine has no "
            "image encoder). Send the content as input_text parts or a string, or ask for a "
            "model that takes images.",
            f"{where}.type",
        )
    else:
        got = _what(part) if not isinstance(part, dict) else f"type {_what(kind)}"
        raise _Bad(
            f"{where} must be a part of type {', '.join(_RESPONSE_PARTS[:3])}, like "
            f'{{"type": "input_text", "text": "Hello"}}; got {got}.',
            f"{where}.type" if isinstance(part, dict) else where,
        )


def _strings(item: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            got = "nothing" if name not in item else _what(item[name])
            raise _Bad(f"{where}.{name} must be a string; got {got}.", f"{where}.{name}")


def _named_list(
    value: Any,
    where: str,
    example: str,
    named: Callable[[dict[str, Any]], bool] = lambda tool: True,
) -> None:
    """A list of objects, each with a string name where `named` says it needs one (tools, in
    the Responses and Messages APIs)."""
    if not isinstance(value, list):
        raise _Bad(f"{where} must be a list like {example}; got {_what(value)}.", where)
    for index, tool in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(tool, dict) or (named(tool) and not isinstance(tool.get("name"), str)):
            raise _Bad(f"{at} must be an object with a string name, as in {example}.", at)
        for field in ("parameters", "input_schema"):
            schema = tool.get(field)
            if schema is not None and not isinstance(schema, dict):
                raise _Bad(
                    f"{at}.{field} must be a JSON Schema object; got {_what(schema)}.",
                    f"{at}.{field}",
                )


# -- /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) --------------------

# Anthropic documents user and assistant; Claude Code also sends notes of its environment as a
# "system" message among them, which the engine takes as a system turn.
_ANTHROPIC_ROLES = ("user", "assistant", "system")
_ANTHROPIC_BLOCKS = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "document",
)
_MESSAGES_FIELDS: dict[str, Callable[[str, Any], None]] = {
    "max_tokens": _integer(1, INT32_MAX, "the most tokens the answer may have"),
    "temperature": _number(0, 1, "higher is more random"),
    "top_p": _number(0, 1, "the share of probability mass sampled from"),
    "top_k": _integer(0, INT32_MAX, "sample from the k likeliest tokens"),
    "stream": _boolean("whether to send the answer as it is generated"),
}


def messages(body: dict[str, Any]) -> None:
    if "max_tokens" not in body:
        raise _Bad(
            "max_tokens is required: the most tokens the answer may have, like 1024.",
            "max_tokens",
        )
    count_tokens(body)


def count_tokens(body: dict[str, Any]) -> None:
    """A Messages API body; for counting its tokens, max_tokens may be left out."""
    value = body.get("messages")
    example = '[{"role": "user", "content": "Hello"}]'
    if not isinstance(value, list) or not value:
        got = "nothing" if "messages" not in body else _what(value)
        raise _Bad(
            f"messages must be a non-empty list of messages, like {example}; got {got}.", "messages"
        )
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _Bad(
                f"{where} must be an object with a role and content, like {example[1:-1]}; got {_what(message)}.",
                where,
            )
        if message.get("role") not in _ANTHROPIC_ROLES:
            raise _Bad(
                f"{where}.role must be user or assistant (the system prompt goes in 'system'); "
                f"got {_what(message.get('role'))}.",
                f"{where}.role",
            )
        _blocks(message.get("content"), f"{where}.content", required=True)
    system = body.get("system")
    if system is not None:
        _blocks(system, "system", required=True, only_text=True)
    _fields(body, _MESSAGES_FIELDS)
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) for s in stops)
    ):
        raise _Bad(
            f"stop_sequences must be a list of strings; got {_what(stops)}.", "stop_sequences"
        )
    tools = body.get("tools")
    if tools is not None:
        _named_list(tools, "tools", '[{"name": "f", "input_schema": {"type": "object"}}]')
    choice = body.get("tool_choice")
    if choice is not None and not (
        isinstance(choice, dict) and isinstance(choice.get("type"), str)
    ):
        raise _Bad(
            'tool_choice must be an object like {"type": "auto"}, {"type": "any"} or '
            f'{{"type": "tool", "name": "f"}}; got {_what(choice)}.',
            "tool_choice",
        )


def _blocks(content: Any, where: str, *, required: bool, only_text: bool = False) -> None:
    if isinstance(content, str):
        return
    example = '[{"type": "text", "text": "Hello"}]'
    if not isinstance(content, list) or (required and not content and not only_text):
        raise _Bad(
            f"{where} must be a string or a list of content blocks like {example}; got {_what(content)}.",
            where,
        )
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" or (only_text and isinstance(block, dict)):
            if kind != "text" or not isinstance(block.get("text"), str):
                raise _Bad(f'{at} must be a text block like {{"type": "text", "text": "..."}}.', at)
        elif kind == "image":
            _anthropic_image(block.get("source"), at)
        elif kind == "document":
            raise _Bad(
                f"{at} is a block of type {kind}, and this model takes text only (its engine has "
                "no image encoder). Send text blocks or a string, or ask for a model that takes "
                "images.",
                f"{at}.type",
            )
        elif kind == "tool_use":
            _strings(block, at, ("id", "name"))
            if not isinstance(block.get("input", {}), dict):
                raise _Bad(f"{at}.input must be an object (the tool's arguments).", f"{at}.input")
        elif kind == "tool_result":
            _strings(block, at, ("tool_use_id",))
            result = block.get("content")
            if result is not None:
                _blocks(result, f"{at}.content", required=False)
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            got = _what(block) if not isinstance(block, dict) else f"type {_what(kind)}"
            raise _Bad(
                f"{at} must be a content block of type {', '.join(_ANTHROPIC_BLOCKS[:4])}, like "
                f'{{"type": "text", "text": "Hello"}}; got {got}.',
                f"{at}.type" if isinstance(block, dict) else at,
            )


def _anthropic_image(source: Any, where: str) -> None:
    if _images.get() is None:
        _image(None, where, "image")  # refused: the model takes text only
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        _image(source.get("url"), f"{where}.source.url", "image")
        return
    if kind != "base64":
        raise _Bad(
            f'{where}.source must be {{"type": "base64", "media_type": "image/png", "data": '
            f'"..."}} or {{"type": "url", "url": "https://..."}}; got {_what(source)}.',
            f"{where}.source",
        )
    media = source.get("media_type")
    if not isinstance(media, str) or media.lower().removeprefix("image/") not in IMAGE_TYPES:
        raise _Bad(
            f"{where}.source.media_type must be an image type, one of "
            f"{', '.join('image/' + t for t in IMAGE_TYPES)}; got {_what(media)}.",
            f"{where}.source.media_type",
        )
    data = source.get("data")
    _image(
        f"data:{media};base64,{data}" if isinstance(data, str) else None,
        f"{where}.source.data",
        "image",
    )


# -- /v1/rerank (the Cohere/Jina shape) -------------------------------------------------------


def rerank(body: dict[str, Any]) -> None:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        got = "nothing" if "query" not in body else _what(query)
        raise _Bad(
            f"query must be a non-empty string (what the documents are ranked for); got {got}.",
            "query",
        )
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        got = "nothing" if "documents" not in body else _what(documents)
        raise _Bad(
            f'documents must be a non-empty list of strings, like ["a", "b"]; got {got}.',
            "documents",
        )
    for index, document in enumerate(documents):
        if not isinstance(document, str):
            raise _Bad(
                f"documents[{index}] must be a string; got {_what(document)}.",
                f"documents[{index}]",
            )
    top_n = body.get("top_n")
    if top_n is not None:
        _integer(1, INT32_MAX, "how many of the best documents to return")("top_n", top_n)
