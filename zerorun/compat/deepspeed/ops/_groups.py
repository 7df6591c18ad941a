"""Parameter groups for the optimizer stand-ins: DeepSpeed's optimizers take ``param_groups``
of another optimizer (accelerate passes the Trainer optimizer's); their dicts are copied so the
two optimizers never share (and rewrite) one group dict."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["copy_groups"]


def copy_groups(model_params: Iterable[Any], **per_group: Any) -> list[Any]:
    items = list(model_params)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"]), **per_group) for g in items]
    return [dict(params=items, **per_group)] if per_group else items
