"""The load-time chat template check (models/template_check.py) on real GGUF copies."""

from __future__ import annotations

from pathlib import Path

import pytest
from bundled_models import bundled_spec
from crafted_gguf import CRAFTED_TEMPLATES, with_chat_template

from elbowroom.models.gguf_meta import read_chat_templates
from elbowroom.models.template_check import TemplateChecker, TemplateUnsafe

SAFE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return bundled_spec("smollm2-135m").path


def test_the_bundled_template_passes_once_per_file_version(smollm2: Path, tmp_path: Path) -> None:
    checker = TemplateChecker(3.0, 256 << 20)
    checker.check(smollm2, "smollm2-135m")
    checker.check(smollm2, "smollm2-135m")
    assert checker.runs == 1  # remembered
    copy = with_chat_template(smollm2, tmp_path / "copy.gguf", SAFE)
    assert read_chat_templates(copy) == {"tokenizer.chat_template": SAFE}
    checker.check(copy, "copy")
    assert checker.runs == 2
    # A template error of its own (raise_exception) is the engine's answer, not a verdict.
    with_chat_template(smollm2, copy, "{{ raise_exception('no system role') }}")
    checker.check(copy, "copy")
    assert checker.runs == 3  # a new mtime/size: checked again


@pytest.mark.parametrize("name", sorted(CRAFTED_TEMPLATES))
def test_a_crafted_template_is_refused_and_remembered(
    smollm2: Path, tmp_path: Path, name: str
) -> None:
    template, why = CRAFTED_TEMPLATES[name]
    path = with_chat_template(smollm2, tmp_path / f"{name}.gguf", template)
    checker = TemplateChecker(2.0, 256 << 20)
    for _ in range(2):
        with pytest.raises(TemplateUnsafe) as err:
            checker.check(path, name)
        assert err.value.code == "chat_template_unsafe"
        assert err.value.status == 422
        assert why in str(err.value) and "chat_template_check" in str(err.value)
    assert checker.runs == 1
