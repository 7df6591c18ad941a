"""docs/config-reference.md is generated from the schema; this fails while it is stale."""

from __future__ import annotations

from zerorun.config.reference import DEFAULT_PATH, render_reference
from zerorun.config.schema import ZerorunConfig


def test_committed_reference_is_current():
    assert DEFAULT_PATH.read_text(encoding="utf-8") == render_reference(), (
        "docs/config-reference.md is stale: run `.venv/bin/python -m zerorun.config.reference`"
    )


def test_reference_lists_every_key_with_a_description():
    text = render_reference()

    def keys(model, prefix=""):
        for name, info in model.model_fields.items():
            yield f"{prefix}{name}", info
            sub = getattr(info.annotation, "model_fields", None)
            if sub is not None:
                yield from keys(info.annotation, f"{prefix}{name}.")

    for key, info in keys(ZerorunConfig):
        assert f"| `{key}` |" in text, key
        assert info.description, f"{key} has no description"
    assert "| `zero_optimization.stage3_prefetch_bucket_size` | a whole number ≥ 0 or \"auto\" | `5e7` | 3 | yes |" in text
