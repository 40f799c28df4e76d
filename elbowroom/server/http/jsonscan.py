"""Inspect a JSON request body within limits, before anything big is built from it. Pure.

``json.loads`` builds every value of a document before anyone can count them: 10⁶ tiny
chat messages (35 MB) become ~300 MB of Python objects and hold the interpreter for a
third of a second per parse. ``scan`` first counts the values and the nesting of the raw
bytes, stopping as soon as a limit is passed; only a body within the limits is parsed.

The scan is a loop over one compiled regex's matches (strings and structural characters),
so its cost is bounded by ``max_values`` matches, not by the body's size; between matches
the interpreter may switch threads, so a scan in a worker thread does not stall the event
loop. Escapes are blanked first (``\\\\`` and ``\\"`` become two harmless bytes, with two
``bytes.replace`` calls at memory speed) so that a string is simply ``"[^"]*"``; a regex
that understood escapes itself takes ~0.3 µs per escape, seconds for a crafted body.

The same pass refuses an integer literal of more than ``max_int_digits`` digits
(``IntegerWatch``), piece by piece, before the body is decoded or parsed: 32 MB of
4,299-digit integers is refused in its first piece instead of after two full passes over
it and a decode.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elbowroom.errors import BadRequest, PayloadTooLarge
from elbowroom.server.http.schema_limits import check_schemas

_TOKEN = re.compile(rb'("[^"]*")|([\[{])|([\]}])|(,)')
# Every byte the scan does not look at: deleted first (bytes.translate, at memory speed), so
# the regex never walks a long run of digits or text position by position (32 MB of
# 4,299-digit integers took the regex 5 s; their structure alone takes milliseconds). A
# string's inner brackets and commas stay between its quotes: the matches are the same.
_UNSEEN = bytes(sorted(set(range(256)) - set(b'"[]{},')))
_STRING, _OPEN, _CLOSE, _COMMA = 1, 2, 3, 4
# Bytes one C call (translate, replace, decode) works on at a time. A call holds the
# interpreter lock for its whole length: 32 MB in one translate held it ~40 ms and the
# decode inside json.loads as long again, so four such bodies in worker threads stalled
# /health by ~290 ms. Between pieces other threads (and the event loop) run.
PIECE = 256 * 1024


# Where a request's prompt text is: OpenAI's and Ollama's chat and completion routes.
CHAT_PATHS = frozenset({"/v1/chat/completions", "/api/chat"})
COMPLETION_PATHS = frozenset({"/v1/completions", "/api/generate"})


@dataclass(frozen=True, slots=True)
class Limits:
    max_values: int
    max_depth: int
    max_chars: int
    max_messages: int
    max_stop: int
    max_stop_chars: int
    # JSON schemas a grammar is compiled from (schema_limits.py); integers' digits.
    max_schema_bytes: int = 32 * 1024
    max_schema_members: int = 256
    max_schema_repeat: int = 1024
    max_int_digits: int = 64


@dataclass(frozen=True, slots=True)
class Inspected:
    value: Any  # the parsed document
    chars: int  # characters in all its string values
    prompt_chars: int  # characters of the text a model would be prompted with


def scan(
    body: bytes | bytearray, max_values: int, max_depth: int, max_int_digits: int | None = None
) -> int:
    """The number of values in ``body`` (about: strings, containers, commas), raising
    PayloadTooLarge past ``max_values``, BadRequest past ``max_depth`` nesting levels and,
    given ``max_int_digits``, BadRequest at the first integer literal longer than that
    (``IntegerWatch``). Malformed JSON is not judged here: the parser reports it."""
    watch = IntegerWatch(max_int_digits) if max_int_digits is not None else None
    text = structure(body, watch)
    values = depth = 0
    for match in _TOKEN.finditer(text):
        kind = match.lastindex
        if kind == _CLOSE:
            depth -= 1
            continue
        values += 1
        if kind == _OPEN:
            depth += 1
            if depth > max_depth:
                raise BadRequest(
                    f"The JSON body nests deeper than {max_depth} levels (max_json_depth)",
                    code="json_too_deep",
                )
        if values > max_values:
            raise PayloadTooLarge(
                f"The JSON body has more than {max_values} values (max_json_values): "
                "send fewer messages or inputs per request",
                code="json_too_large",
            )
    return values


def structure(body: bytes | bytearray, watch: IntegerWatch | None = None) -> bytes:
    """What the scan looks at: ``body`` with escapes blanked and every byte but
    ``"[]{},`` deleted, worked through in pieces of ``PIECE`` bytes. A run of backslashes
    cut by a piece's end carries over: its pairs are blanked (then deleted) and an odd one
    left joins the next piece, where it escapes what follows as it would have whole.
    ``watch`` sees each piece with its escapes blanked, before it is translated."""
    out: list[bytes | bytearray] = []
    carry = b""
    escapes = b"\\" in body
    for start in range(0, len(body), PIECE):
        piece = body[start : start + PIECE]
        if escapes:
            piece = carry + piece
            kept = piece.rstrip(b"\\")
            carry = b"\\" * ((len(piece) - len(kept)) % 2)
            piece = kept.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        if watch is not None:
            watch.piece(piece)
        out.append(piece.translate(None, _UNSEEN))
    return b"".join(out)


_DIGITS = re.compile(rb"[0-9]*")


def _run_end(piece: bytes | bytearray, at: int) -> int:
    """Where the run of digits at ``at`` ends."""
    match = _DIGITS.match(piece, at)
    return match.end() if match else at


_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NOT_INTEGER_AFTER = b".eE"  # a run of digits after these is a fraction or an exponent


class IntegerWatch:
    """Refuses an integer literal of more than ``max_digits`` digits (400
    ``integer_too_long``), looking at the body's pieces one by one with their escapes
    blanked (``structure``), before anything decodes or parses the body.

    Each piece is mapped digit -> ``0`` (one ``translate``) and searched for
    ``max_digits + 1`` zeros (``bytes.find``): both at memory speed, so a body without a
    long run costs two passes per piece and nothing else. A run found is an integer
    literal when it is outside a string (escapes blanked, every ``"`` opens or closes one:
    the parity of the quotes before it tells) and not a fraction or an exponent (no ``.``,
    ``e``, ``e+`` or ``e-`` right before it). A float's integer part counts as an integer
    literal's. A literal cut by a piece's end carries its digits into the next piece."""

    def __init__(self, max_digits: int) -> None:
        self.max_digits = max_digits
        self.long = b"0" * (max_digits + 1)
        self.in_string = False  # at the start of the next piece
        self.run = 0  # digits of an integer literal the last piece ended in
        self.before = b"  "  # the last piece's last two bytes

    def piece(self, piece: bytes | bytearray) -> None:
        at = 0
        if self.run:
            lead = _run_end(piece, 0)
            if self.run + lead > self.max_digits:
                self._refuse(self.run + lead, lead == len(piece))
            if lead == len(piece):
                self.run += lead
                self.before = (self.before + piece[-2:])[-2:]
                return
            at, self.run = lead, 0
        elif self.before[-1] in b"0123456789":
            at = _run_end(piece, 0)  # the rest of a run that is no integer
        inside = self.in_string
        counted = 0
        zeros = piece.translate(_AS_ZERO)
        while (hit := zeros.find(self.long, at)) >= 0:
            inside ^= bool(piece.count(b'"', counted, hit) & 1)
            counted = hit
            end = _run_end(piece, hit)
            if not inside and self._integer_at(piece, hit):
                self._refuse(end - hit, end == len(piece))
            at = end
        inside ^= bool(piece.count(b'"', counted) & 1)
        tail = len(piece) - len(piece.rstrip(b"0123456789"))
        start = len(piece) - tail
        if tail and not inside and start >= at and self._integer_at(piece, start):
            self.run = tail
        self.in_string = inside
        self.before = (self.before + piece[-2:])[-2:]

    def _integer_at(self, piece: bytes | bytearray, start: int) -> bool:
        """Whether the run of digits at ``start`` begins an integer (part)."""
        two = (self.before + piece[max(0, start - 2) : start])[-2:]
        if two[1] in _NOT_INTEGER_AFTER:
            return False
        return not (two[1] in b"+-" and two[0] in b"eE")

    def _refuse(self, digits: int, at_least: bool) -> None:
        raise integer_too_long(f"{digits}{' or more' if at_least else ''}", self.max_digits)


def integer_too_long(digits: str, max_digits: int) -> BadRequest:
    """The 400 for an integer literal over ``max_int_digits`` (the scan's and the parse's)."""
    return BadRequest(
        f"The JSON body has an integer of {digits} digits; at most {max_digits} are allowed "
        "(max_int_digits)",
        code="integer_too_long",
    )


def decode(body: bytes | bytearray) -> str:
    """``body`` as text, as ``json.loads`` would decode it (UTF-8, -16 or -32 by its first
    bytes, surrogates passed), in pieces of ``PIECE`` bytes."""
    encoding = json.detect_encoding(bytes(body[:4]))
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    parts = [decoder.decode(body[i : i + PIECE]) for i in range(0, len(body), PIECE)]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def inspect(body: bytes | bytearray, path: str, limits: Limits) -> Inspected:
    """Scan, parse and check ``body`` sent to ``path``; raise the error a client should see."""
    scan(body, limits.max_values, limits.max_depth, limits.max_int_digits)
    try:
        value = json.loads(decode(body), parse_int=_int_parser(limits.max_int_digits))
    except BadRequest:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise BadRequest(f"The request body is not valid JSON: {reason}") from None
    messages = value.get("messages") if isinstance(value, dict) else None
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise PayloadTooLarge(
            f"The request has {len(messages)} messages; at most {limits.max_messages} are "
            "allowed (max_messages)",
            param="messages",
            code="too_many_messages",
        )
    chars = count_chars(value)
    if chars > limits.max_chars:
        raise PayloadTooLarge(
            f"The request has {chars} characters of text; at most {limits.max_chars} are "
            "allowed (max_chars)",
            code="too_many_characters",
        )
    if not isinstance(value, dict):
        return Inspected(value, chars, 0)
    check_stop(value.get("stop"), limits)
    options = value.get("options")  # Ollama's
    if isinstance(options, dict):
        check_stop(options.get("stop"), limits)
    check_schemas(
        value,
        max_bytes=limits.max_schema_bytes,
        max_members=limits.max_schema_members,
        max_repeat=limits.max_schema_repeat,
    )
    return Inspected(value, chars, prompt_chars(path, value))


def _int_parser(max_digits: int) -> Callable[[str], int]:
    """``json.loads``'s ``parse_int``: an integer literal of more than ``max_digits``
    digits is a 400 before ``int()`` sees it (converting a 4,299-digit literal costs
    quadratic time: 32 MB of them held the interpreter for seconds)."""

    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > max_digits:
            raise integer_too_long(str(digits), max_digits)
        return int(text)

    return parse


def count_chars(value: Any) -> int:
    """Characters in every string value of a parsed document (keys are not text; they
    count as values in the scan). A loop, not recursion: no stack to overflow."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def check_stop(stop: Any, limits: Limits) -> None:
    items = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(items) > limits.max_stop:
        raise BadRequest(
            f"stop has {len(items)} strings; at most {limits.max_stop} are allowed (max_stop)",
            param="stop",
            code="too_many_stop_strings",
        )
    for item in items:
        if isinstance(item, str) and len(item) > limits.max_stop_chars:
            raise BadRequest(
                f"a stop string has {len(item)} characters; at most {limits.max_stop_chars} "
                "are allowed (max_stop_chars)",
                param="stop",
                code="stop_too_long",
            )


def prompt_chars(path: str, body: dict[str, Any]) -> int:
    """Characters of the text a chat or completion request puts into the model's prompt (0
    for other routes): every message's content (and its tool calls' names and arguments),
    the tools' names, descriptions and schemas (the chat template writes them out), Ollama's
    ``system``, the completion's ``prompt`` and ``suffix``. Keys and the template's own
    text are not counted: a lower bound."""
    if path in CHAT_PATHS:
        total = 0
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(
                    len(p["text"])
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            total += count_chars(message.get("tool_calls"))
        return total + count_chars(body.get("tools"))
    if path in COMPLETION_PATHS:
        total = sum(len(v) for v in (body.get("system"), body.get("suffix")) if isinstance(v, str))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return total + len(prompt)
        if isinstance(prompt, list):
            return total + sum(len(p) for p in prompt if isinstance(p, str))
        return total
    return 0


def min_tokens(chars: int, chars_per_token: int) -> int:
    """A lower bound on the tokens ``chars`` characters become: no token of the vocabulary
    spells more than ``chars_per_token`` characters (docs/security.md)."""
    return math.ceil(chars / max(1, chars_per_token))
