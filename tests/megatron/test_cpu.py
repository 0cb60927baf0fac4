"""CPU mode (mnb.megatron.cpu): each redirection, checked inside a real rank process."""

import pytest
from conftest import ok

from mnb.megatron.cpu import version_supported

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checks(world1):
    return ok(world1["cpu"])


def test_install_is_idempotent(checks):
    assert checks["installed"] and checks["idempotent"]


def test_megatron_sees_a_torch_proxy_with_cpu_factories(checks):
    assert checks["proxy_is_not_torch"]
    assert checks["factory_device"] == "cpu"  # literal device="cuda" (schedules, optimizer)
    assert checks["factory_int_device"] == "cpu"  # device=torch.cuda.current_device()
    assert checks["pin_memory_dropped"] is False


def test_cuda_namespace_is_cpu_safe(checks):
    assert checks["current_device"] == "cpu"
    assert checks["synchronize"]  # p2p batch sync, timers, dist_checkpointing
    assert checks["stream_event_inert"]
    assert checks["autocast_cpu"]


def test_real_torch_untouched_for_user_code(checks):
    assert checks["real_torch_cuda_raises"]
    assert checks["user_cuda_raises"]
    assert checks["user_type"] == "torch.FloatTensor"


def test_tensor_methods_redirected_for_megatron_callers(checks):
    assert checks["megatron_cuda_is_self"]
    assert checks["megatron_type"] == "torch.cuda.FloatTensor"


def test_rng_state_roundtrip_on_cpu_generator(checks):
    assert checks["rng_replay"]


def test_clip_grad_by_total_norm_runs_on_cpu(checks):
    assert checks["clip_grad_scaled"] == pytest.approx(3.0 / 6.0, rel=1e-5)


def test_moe_split_sizes_become_numpy(checks):
    assert checks["moe_splits_numpy"]


def test_modules_imported_after_install_are_patched(checks):
    name, patched = checks["late_import"]
    assert patched, name


def test_dist_checkpointing_save_load_on_cpu(world1):
    result = ok(world1["checkpoint"])
    assert result["equal"] and result["tensors"] > 0


@pytest.mark.parametrize(
    "version, supported",
    [("0.16.1", True), ("0.19.2", True), ("0.20.0", False), ("0.15.3", False), ("1.0.0", False),
     ("garbage", False)],
)
def test_version_range(version, supported):
    assert version_supported(version) is supported
