"""The documentation names every knob: a setting added without docs fails here."""

from dataclasses import fields
from pathlib import Path

from elbowroom.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_setting_is_documented() -> None:
    text = DOC.read_text()
    missing = [f.name for f in fields(Settings) if f"`{f.name}`" not in text]
    assert missing == []
