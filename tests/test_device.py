"""Device selection: backend, visibility variable and Ray resource per device; the Ascend
import order for Megatron; `weight_sync.backend: auto`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl import device as dev


def test_specs_per_device():
    cuda, npu, cpu = (dev.device_spec(k) for k in ("cuda", "npu", "cpu"))
    assert (cuda.backend, cuda.visibility_env, cuda.ray_resource) == (
        "nccl",
        "CUDA_VISIBLE_DEVICES",
        "GPU",
    )
    assert (npu.backend, npu.visibility_env, npu.ray_resource) == (
        "hccl",
        "ASCEND_RT_VISIBLE_DEVICES",
        "NPU",
    )
    assert (cpu.backend, cpu.visibility_env, cpu.ray_resource) == ("gloo", None, None)
    assert cuda.visibility([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert npu.visibility([0]) == {"ASCEND_RT_VISIBLE_DEVICES": "0"}
    assert cpu.visibility([0, 1]) == {}
    assert cuda.ray_options(2) == {"num_gpus": 2}
    assert npu.ray_options(1) == {"resources": {"NPU": 1}}
    assert cpu.ray_options(4) == {}
    assert str(cpu.torch_device()) == "cpu" and str(cuda.torch_device(1)) == "cuda:1"
    with pytest.raises(dev.DeviceError, match="non-negative"):
        cuda.visibility([-1])
    with pytest.raises(dev.DeviceError, match="unknown device 'tpu'"):
        dev.device_spec("tpu")


def test_detect_on_this_box(monkeypatch):
    import torch

    monkeypatch.delenv(dev.ENV_OVERRIDE, raising=False)
    spec = dev.detect_device()
    expected = "cuda" if torch.cuda.is_available() else "npu" if dev._npu_available() else "cpu"
    assert spec.kind == expected
    monkeypatch.setenv(dev.ENV_OVERRIDE, "cpu")
    assert dev.detect_device() is dev.SPECS["cpu"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_requested_accelerator_that_is_absent_is_an_error(monkeypatch):
    monkeypatch.setenv(dev.ENV_OVERRIDE, "cuda")
    with pytest.raises(dev.DeviceError, match="cuda requested but none is available"):
        dev.detect_device()
    with pytest.raises(dev.DeviceError, match="torch_npu"):
        dev.detect_device("npu")


def test_resolve_backend():
    cuda, cpu = dev.SPECS["cuda"], dev.SPECS["cpu"]
    assert dev.resolve_backend("auto", cuda) == "nccl"
    assert dev.resolve_backend("auto", dev.SPECS["npu"]) == "hccl"
    assert dev.resolve_backend("auto", cpu) == "gloo"
    assert dev.resolve_backend("gloo", cuda) == "gloo"
    with pytest.raises(dev.DeviceError, match="nccl does not run on the cpu"):
        dev.resolve_backend("nccl", cpu)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_prepare_megatron_imports_order_on_npu():
    # A fake megatron already imported: the adaptor would come too late -> one clear error.
    code = (
        "import sys, types\n"
        "sys.modules['megatron.core'] = types.ModuleType('megatron.core')\n"
        "from asyncrl.device import SPECS, prepare_megatron_imports, DeviceError\n"
        "prepare_megatron_imports(SPECS['cuda'])  # nothing to do off Ascend\n"
        "try:\n"
        "    prepare_megatron_imports(SPECS['npu'])\n"
        "except DeviceError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run(code)
    assert "ERR megatron.core was imported before mindspeed.megatron_adaptor" in out.stdout, out


def test_prepare_megatron_imports_names_missing_packages():
    code = (
        "from asyncrl.device import SPECS, prepare_megatron_imports, DeviceError\n"
        "try:\n"
        "    prepare_megatron_imports(SPECS['npu'])\n"
        "except DeviceError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run(code)
    assert "ERR the Ascend Megatron path needs torch_npu (package torch-npu)" in out.stdout, out


def test_device_module_does_not_import_torch():
    out = _run("import sys, asyncrl.device; print('torch' in sys.modules)")
    assert out.stdout.strip() == "False", out


def test_a_one_process_learner_trains_on_its_first_device_where_there_is_one():
    from asyncrl.device import worker_device

    assert worker_device([3, 4], "cuda") == "cuda:3"
    assert worker_device([0], "npu") == "npu:0"
    assert worker_device([], "cuda") == "cpu"  # no devices named: the CPU
    assert worker_device([0, 1], "cpu") == "cpu"  # a CPU box: device ids are ranks only


def test_fsdp2_ranks_pin_their_device_mapping_entries():
    """Rank 0 (the driver, which sees every device) computes on mapping[0]; rank r sees only
    mapping[r] (Ray told not to override it), as its device 0. The training group carries
    device tensors on NCCL/HCCL and CPU ones (counts, object gathers) on gloo."""
    from asyncrl.learner.torch.distributed import rank_devices

    cuda, npu, cpu = (dev.device_spec(k) for k in ("cuda", "npu", "cpu"))
    assert rank_devices([2, 5, 7], cuda, 3) == [
        ("cuda:2", {}),
        ("cuda:0", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "5"}),
        ("cuda:0", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "7"}),
    ]  # fmt: skip
    assert rank_devices([0, 1], npu, 2)[1] == ("npu:0", {
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1", "ASCEND_RT_VISIBLE_DEVICES": "1"})  # fmt: skip
    assert rank_devices([0], cpu, 2) == [("cpu", {}), ("cpu", {})]  # CPU: ids are ranks only
    with pytest.raises(ValueError, match="2 cuda ranks need 2 device ids"):
        rank_devices([0], cuda, 2)
    assert cpu.group_backend() == "gloo"
    assert cuda.group_backend() == "cpu:gloo,cuda:nccl"
    assert npu.group_backend() == "cpu:gloo,npu:hccl"
    assert cpu.pinned_env(0) == {}


def test_fsdp2_over_several_accelerators_runs_on_one_node_or_across_nodes():
    from asyncrl.config import load_config
    from asyncrl.preflight import missing_pieces

    cfg = load_config(None, ["actor_train.device_mapping=[0,1]"])
    assert missing_pieces(cfg, "cpu") == []  # gloo ranks on the CPU
    assert missing_pieces(cfg, "cuda") == []  # a rank per GPU of this node
    cfg.cluster.address = "10.0.0.1:6379"
    # multi-node: ranks placed on the nodes' GPUs by the node plan (learner/placed_ranks.py)
    assert missing_pieces(cfg, "cuda") == []
    assert missing_pieces(cfg, "cpu") == []  # multi-node CPU ranks: placement groups


def test_megatron_train_needs_an_accelerator_whether_or_not_megatron_is_installed(monkeypatch):
    """On the CPU a run's Megatron learner is refused before anything starts (its DDP and
    optimizers call CUDA APIs: only the tests' emulation runs it there); on a GPU it needs just
    megatron-core."""
    from asyncrl import preflight
    from asyncrl.config import load_config

    cfg = load_config(None, ["actor_train.strategy_args.strategy_name=megatron_train"])
    for installed in (True, False):
        monkeypatch.setattr(preflight, "_installed", lambda module, ok=installed: ok)
        (line,) = [m for m in preflight.missing_pieces(cfg, "cpu") if "megatron" in m]
        assert "megatron_train needs a GPU or NPU" in line and "fsdp2_train" in line
    monkeypatch.setattr(preflight, "_installed", lambda module: True)
    assert not [m for m in preflight.missing_pieces(cfg, "cuda") if "megatron" in m]
    monkeypatch.setattr(preflight, "_installed", lambda module: module != "megatron.core")
    (line,) = [m for m in preflight.missing_pieces(cfg, "cuda") if "megatron" in m]
    assert "pip install 'asyncrl[megatron]'" in line
