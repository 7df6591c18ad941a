"""How stage 3 forms parameter groups from modules (pure: no process group)."""

from __future__ import annotations

from torch import nn

from zerorun.runtime.flat_params import collect_trainable
from zerorun.runtime.stage3.groups import plan_groups
from zerorun.runtime.stage3.schedule import Schedule


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.extra = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # not repeated: stays in the root
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight


def _plan(model: nn.Module, **kw: object) -> dict[str, list[str]]:
    trainable, _ = collect_trainable(model, None)
    opts = {"persistence_threshold": 8, "class_names": None, "min_numel": 0}
    opts.update(kw)
    return {g.name: sorted(t.name for t in g.params) for g in plan_groups(model, trainable, **opts)}


def test_default_groups_are_repeated_blocks_plus_root() -> None:
    plan = _plan(Net())
    assert list(plan) == ["", "layers.0", "layers.1", "layers.2", "<persistent>"]
    assert plan[""] == ["emb.weight", "extra.0.weight"]  # tied head counted once, under its first name
    assert plan["layers.1"] == ["layers.1.fc.weight"]
    # biases and LayerNorms (8 elements) stay replicated
    assert "layers.0.ln.weight" in plan["<persistent>"] and "extra.0.bias" in plan["<persistent>"]


def test_class_names_and_size_threshold() -> None:
    by_class = _plan(Net(), class_names=["Linear"])
    assert set(by_class) == {"", "layers.0.fc", "layers.1.fc", "layers.2.fc", "extra.0", "<persistent>"}
    # bottom-up: each Linear (72 elements) reaches 64 before its Block does; the embedding would,
    # but its weight is also the head's (root), so it stays in the root group
    by_size = _plan(Net(), min_numel=64, persistence_threshold=0)
    assert list(by_size) == ["", "layers.0.fc", "layers.1.fc", "layers.2.fc", "extra.0"]
    assert by_size[""] == ["emb.weight", "layers.0.ln.bias", "layers.0.ln.weight", "layers.1.ln.bias",
                           "layers.1.ln.weight", "layers.2.ln.bias", "layers.2.ln.weight"]


def test_weight_tied_across_two_groups_goes_to_the_root() -> None:
    net = Net()
    net.layers[2].fc.weight = net.layers[0].fc.weight
    plan = _plan(net)
    assert "layers.0.fc.weight" in plan[""]
    # their only partitioned parameter moved to the root: no group left for these blocks
    assert "layers.0" not in plan and "layers.2" not in plan and plan["layers.1"] == ["layers.1.fc.weight"]


def test_external_parameter_goes_to_the_root() -> None:
    import zerorun.zero

    net = Net()
    zerorun.zero.register_external_parameter(net, net.layers[1].fc.weight)
    assert "layers.1.fc.weight" in _plan(net)[""]


def test_schedule_predicts_from_the_previous_pass() -> None:
    class G:
        def __init__(self, i: int) -> None:
            self.index, self.numel, self.resident, self.state = i, 10, False, 0
            self.prefetch_pays = True

        @property
        def live(self) -> bool:
            return self.state != 0

        def gather_async(self) -> bool:
            self.state = 1
            return True

    groups = [G(i) for i in range(4)]
    s = Schedule(groups, prefetch_numel=15, max_live_numel=25, max_reuse_distance=0)  # type: ignore[arg-type]
    s.begin_forward()
    for g in groups:
        assert s.on_forward(g) == []  # first pass: nothing known
    s.begin_forward()
    upcoming = s.on_forward(groups[0])
    assert upcoming == [1, 2, 3]
    groups[0].state = 2
    s.prefetch(groups[0], upcoming)  # bucket 15: one group ahead (the first is always allowed), then stop
    assert [g.state for g in groups] == [2, 1, 0, 0] and s.prefetches == 1
    # order changed: position 1 is now group 3 -> no prediction
    assert s.on_forward(groups[3]) == []
    # live limit: 2 live (20) + 10 > 25 -> no prefetch
    s.prefetch(groups[3], [2])
    assert groups[2].state == 0
