"""`zerorun:` -- runtime options DeepSpeed has no key for.

Runtime engineers add their options here (one field each, with a default and a description:
the configuration reference is generated from these).
"""

from __future__ import annotations

from zerorun.config.types import Real, field
from zerorun.config.zero_section import Section

__all__ = ["ZerorunSection"]


class ZerorunSection(Section):
    """zerorun's own runtime options."""

    memory_report_interval: Real = field(
        5.0, "Seconds between memory reports a rank sends to the launcher (0 disables the periodic report).", ge=0
    )
