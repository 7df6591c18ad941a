"""`import deepspeed` under the layer: finders, metadata, the edge of the surface, a real
DeepSpeed beside it. Each check runs in a fresh interpreter (activation changes sys.meta_path)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ._run import run

PROBE = textwrap.dedent(
    """
    import importlib.metadata, importlib.util, json, sys
    out = {"before": importlib.util.find_spec("deepspeed") is not None}
    import zerorun.compat
    zerorun.compat.activate()
    out["spec"] = importlib.util.find_spec("deepspeed") is not None
    out["version"] = importlib.metadata.version("deepspeed")
    out["metadata_name"] = importlib.metadata.metadata("deepspeed")["Name"]
    import deepspeed
    out["torch_loaded_by_import"] = "torch" in sys.modules
    from deepspeed import comm, zero
    import deepspeed.ops.adam, deepspeed.runtime.lr_schedules, deepspeed.zero
    from deepspeed.runtime.zero.partition_parameters import Init
    out["same_objects"] = (
        deepspeed.zero is deepspeed.runtime.zero
        and zero.Init is Init
        and sys.modules["deepspeed.ops.adam"] is sys.modules["zerorun.compat.deepspeed.ops.adam"]
        and deepspeed.DeepSpeedEngine.__module__ == "zerorun.compat.deepspeed.runtime.engine"
    )
    out["own_spec_kept"] = deepspeed.__spec__.name == "zerorun.compat.deepspeed"
    try:
        import deepspeed.moe.layer
    except ModuleNotFoundError as exc:
        out["missing_module"] = str(exc)
    try:
        deepspeed.pipe
    except AttributeError as exc:
        out["missing_attr"] = str(exc)
        out["missing_attr_is_zerorun_error"] = type(exc).__mro__[1].__name__
    out["hasattr"] = hasattr(deepspeed.comm, "all_to_all_unsupported_name")
    from zerorun.compat.deepspeed._surface import MISSES
    out["misses"] = sorted(set(MISSES))
    from transformers.integrations.deepspeed import is_deepspeed_available as hf
    from accelerate.utils import is_deepspeed_available as acc
    out["hf"], out["acc"] = bool(hf()), bool(acc())
    from accelerate.utils.versions import compare_versions
    out["gates"] = [compare_versions("deepspeed", ">=", v) for v in ("0.9.3", "0.14.4", "0.16.4", "0.18.2")]
    print(json.dumps(out))
    """
)


def test_import_deepspeed_resolves_to_the_layer() -> None:
    out = json.loads(run(["-c", PROBE], timeout=120).stdout.strip().splitlines()[-1])
    assert out["before"] is False  # no distribution named deepspeed is installed here
    assert out["spec"] and out["version"] == "0.16.4+zerorun" and out["metadata_name"] == "deepspeed"
    assert out["torch_loaded_by_import"] is False  # accelerate imports it on every unwrap_model
    assert out["same_objects"] and out["own_spec_kept"]
    assert "deepspeed.moe is not part of zerorun's DeepSpeed compatibility layer" in out["missing_module"]
    assert "deepspeed.pipe is not provided by zerorun's DeepSpeed compatibility layer" in out["missing_attr"]
    assert out["missing_attr_is_zerorun_error"] == "RuntimeConfigError"
    assert out["hasattr"] is False
    assert out["misses"] == ["deepspeed.comm.all_to_all_unsupported_name", "deepspeed.pipe"]
    assert out["hf"] and out["acc"]
    assert out["gates"] == [True, True, True, False]  # see activation.COMPAT_VERSION


def test_a_real_deepspeed_installed_is_named(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "deepspeed-0.15.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.15.0\n")
    (site / "deepspeed").mkdir()
    (site / "deepspeed" / "__init__.py").write_text("raise RuntimeError('the real deepspeed was imported')\n")
    code = (
        "import importlib.metadata, zerorun.compat; zerorun.compat.activate(); import deepspeed; "
        "print(deepspeed.__version__, importlib.metadata.version('deepspeed'))"
    )
    proc = run(["-c", code], timeout=60, PYTHONPATH=f"{site}:{Path(__file__).resolve().parents[2]}")
    assert proc.stdout.split() == ["0.16.4+zerorun", "0.16.4+zerorun"]
    assert "not the DeepSpeed 0.15.0 installed at" in proc.stderr
    assert "launch with `deepspeed` instead of `zerorun --deepspeed-compat`" in proc.stderr
