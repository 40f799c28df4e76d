"""StopScanner: the pure stop-string logic behind the LLM engine's streaming."""

from __future__ import annotations

from elbowroom.engines.stops import StopScanner


def feed_all(scanner: StopScanner, pieces: list[str]) -> list[str]:
    out = []
    for piece in pieces:
        text, stopped = scanner.feed(piece)
        if text:
            out.append(text)
        if stopped:
            break
    return out


def test_without_stops_everything_passes_through() -> None:
    scanner = StopScanner([])
    assert feed_all(scanner, ["a", "b"]) == ["a", "b"]
    assert scanner.flush() == ""
    assert scanner.text == "ab"


def test_stop_inside_one_piece_cuts_it() -> None:
    scanner = StopScanner(["END"])
    assert feed_all(scanner, ["hello END there"]) == ["hello "]
    assert scanner.stopped and scanner.text == "hello "
    assert scanner.flush() == ""


def test_stop_split_across_pieces_is_never_emitted() -> None:
    scanner = StopScanner(["</s>"])
    out = feed_all(scanner, ["one <", "/", "s", "> two"])
    assert out == ["one "]
    assert scanner.text == "one "


def test_a_false_start_is_released_when_it_cannot_match() -> None:
    scanner = StopScanner(["\nUser:"])
    assert scanner.feed("line\n") == ("line", False)  # "\n" could start the stop: held
    assert scanner.feed("Us") == ("", False)
    assert scanner.feed("ually") == ("\nUsually", False)
    assert scanner.text == "line\nUsually"


def test_flush_releases_a_held_tail_at_the_end() -> None:
    scanner = StopScanner(["STOP"])
    assert scanner.feed("go ST") == ("go ", False)
    assert scanner.flush() == "ST"
    assert scanner.text == "go ST"


def test_earliest_of_several_stops_wins() -> None:
    scanner = StopScanner(["b", "a"])
    assert feed_all(scanner, ["xxab"]) == ["xx"]


def test_empty_stop_strings_are_ignored() -> None:
    scanner = StopScanner(["", "z"])
    assert feed_all(scanner, ["abc"]) == ["abc"]
