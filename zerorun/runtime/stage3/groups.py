"""Forming stage-3 parameter groups from modules.

A **group** is the set of parameters gathered together (one all-gather per flat buffer, normally
one flat buffer per group) before a module's forward and released after it. Which modules
form groups (first rule that applies):

1. ``zerorun.stage3_group_modules``: modules whose class name is listed (outermost match wins);
2. ``zerorun.stage3_group_min_numel > 0``: bottom-up, every module whose parameters not yet in
   a group reach that many elements (FSDP's size policy);
3. default: every element of a ``ModuleList``/``Sequential`` whose class repeats in it
   (transformer blocks and the like).

A module flagged ``_z3_leaf`` (DeepSpeed's leaf modules: ``deepspeed.utils.set_z3_leaf_modules``)
is one group with all its children whatever the rule chose inside it -- a mixture-of-experts
block whose step may not run every expert. The root module's group holds everything else. A parameter used by modules of two groups (tied
weights across groups) belongs to the root group, which stays gathered from the start of the
forward to the end of the backward, so every user of it sees it. Parameters with at most
``stage3_param_persistence_threshold`` elements are *persistent*: replicated on every rank,
never gathered (they form one group of their own that is always gathered).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from zerorun.runtime.flat_params import TrainableParam

__all__ = ["GroupPlan", "plan_groups", "group_modules", "numel_of"]


@dataclass
class GroupPlan:
    name: str  # module path ("" for the root), or "<persistent>"
    module: nn.Module | None
    params: list[TrainableParam] = field(default_factory=list)
    persistent: bool = False


def numel_of(p: nn.Parameter) -> int:
    """Elements of the whole parameter, also when ``zero.Init`` left a placeholder."""
    return int(getattr(p, "ds_numel", p.numel()))


def _by_class(root: nn.Module, class_names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    wanted = set(class_names)
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()

    def visit(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in inside:
                continue
            if type(child).__name__ in wanted:
                chosen.append((path, child))
                inside.update(id(x) for x in child.modules())
            else:
                visit(path, child)

    visit("", root)
    return chosen


def _by_size(root: nn.Module, min_numel: int) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    counted: set[int] = set()  # parameters already inside a chosen module

    def visit(path: str, m: nn.Module, is_root: bool) -> int:
        total = 0
        for name, child in m.named_children():
            total += visit(f"{path}.{name}" if path else name, child, False)
        for p in m.parameters(recurse=False):
            if id(p) not in counted:
                total += numel_of(p)
        if not is_root and total >= min_numel:
            chosen.append((path, m))
            counted.update(id(p) for p in m.parameters())
            return 0
        return total

    visit("", root, True)
    return chosen


def _repeated_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        children = list(m.named_children())
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(children) >= 2:
            counts = Counter(type(c) for _n, c in children)
            for name, child in children:
                path = f"{prefix}.{name}" if prefix else name
                if counts[type(child)] >= 2 and any(True for _ in child.parameters()):
                    chosen.append((path, child))
                else:
                    visit(path, child)
            return
        for name, child in children:
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", root)
    return chosen


def _with_leaves(root: nn.Module, found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Groups chosen inside a leaf module give way to the leaf (outermost leaf wins); a leaf
    already inside a chosen group stays part of it."""
    leaves = [(path, m) for path, m in root.named_modules() if path and getattr(m, "_z3_leaf", False)]
    if not leaves:
        return found
    below_leaf = {id(x) for _p, leaf in leaves for x in leaf.modules() if x is not leaf}
    kept = [(path, m) for path, m in found if id(m) not in below_leaf]
    covered = {id(x) for _p, m in kept for x in m.modules()}
    kept += [(path, m) for path, m in leaves if id(m) not in below_leaf and id(m) not in covered]
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(kept, key=lambda pm: order[id(pm[1])])


def group_modules(
    root: nn.Module, *, class_names: Sequence[str] | None, min_numel: int
) -> list[tuple[str, nn.Module]]:
    """The modules (path, module) that become groups, in registration order; never the root."""
    if class_names:
        found = _by_class(root, class_names)
    elif min_numel > 0:
        found = _by_size(root, min_numel)
        order = {id(m): i for i, m in enumerate(root.modules())}
        found.sort(key=lambda pm: order[id(pm[1])])
    else:
        found = _repeated_blocks(root)
    found = _with_leaves(root, found)
    seen: set[int] = set()
    out = []
    for path, m in found:  # a module registered twice is one group
        if id(m) not in seen:
            seen.add(id(m))
            out.append((path, m))
    return out


def plan_groups(
    root: nn.Module,
    trainable: Sequence[TrainableParam],
    *,
    persistence_threshold: int,
    class_names: Sequence[str] | None,
    min_numel: int,
) -> list[GroupPlan]:
    """Root group first, then the module groups in registration order, then the persistent
    group; empty groups are dropped. Parameters keep registration order inside a group."""
    modules = group_modules(root, class_names=class_names, min_numel=min_numel)
    owner_of_module: dict[int, int] = {}
    for gi, (_path, m) in enumerate(modules):
        for sub in m.modules():
            owner_of_module.setdefault(id(sub), gi + 1)  # outermost group wins; 0 = root
    owners: dict[int, set[int]] = {}
    for m in root.modules():
        gi = owner_of_module.get(id(m), 0)
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(gi)
    plans = [GroupPlan("", root)] + [GroupPlan(path, m) for path, m in modules]
    persistent = GroupPlan("<persistent>", None, persistent=True)
    for t in reversed(list(trainable)):  # trainable is in gradient (reverse registration) order
        if numel_of(t.param) <= persistence_threshold:
            persistent.params.append(t)
            continue
        # register_external_parameter: used outside its module's forward -> the root group
        gis = {0} if getattr(t.param, "_zerorun_external", False) else owners.get(id(t.param), {0})
        plans[next(iter(gis)) if len(gis) == 1 else 0].params.append(t)
    out = [p for p in plans if p.params]
    if persistent.params:
        out.append(persistent)
    return out
