"""A device held below its part's board power: tensor work slows with the power, memory-bound
work does not, MFU stays stated against the data sheet, and a mesh file keeps the cap."""

import dataclasses

import pytest

from autopar.cost.compute import Efficiencies, compute_time
from autopar.cost.mesh import DEVICES, Mesh
from autopar.errors import MeshError

H100 = DEVICES["h100-80g"]
EFF = Efficiencies.for_device("h100-80g")


def test_a_power_capped_device_computes_slower_and_streams_memory_as_fast():
    capped = dataclasses.replace(H100, power_share=0.5)
    flops, moved = 2 * 8192 ** 3, 3 * 8192 ** 2 * 2
    full = compute_time(flops, moved, H100, "matmul", efficiencies=EFF) - EFF.kernel_latency_s
    held = compute_time(flops, moved, capped, "matmul", efficiencies=EFF) - EFF.kernel_latency_s
    assert held == pytest.approx(2 * full)
    copy = (0.0, 2 ** 30)
    assert compute_time(*copy, capped, "elementwise", efficiencies=EFF) == \
        compute_time(*copy, H100, "elementwise", efficiencies=EFF)
    assert capped.flops("bfloat16") == H100.flops("bfloat16") == 989e12
    assert capped.sustained_flops("bfloat16") == pytest.approx(494.5e12)


def test_the_grand_teton_h100_is_held_to_500_of_700_watts_with_hbm2e():
    device = Mesh.parse("8:h100-96g").device
    assert device.power_share == pytest.approx(500 / 700)
    assert device.hbm_bandwidth == 2400e9
    assert Mesh.parse("8:h100-80g").device.power_share == 1.0


def test_a_mesh_file_keeps_the_cap_and_an_uncapped_one_writes_nothing_new():
    capped = Mesh.parse("2x8:h100-96g")
    assert capped.to_dict()["device"]["power_share"] == pytest.approx(500 / 700)
    assert Mesh.from_dict(capped.to_dict()) == capped
    assert "power_share" not in Mesh.parse("2x8:h100-80g").to_dict()["device"]
    for bad in (0, 1.5, "half"):
        data = capped.to_dict()
        data["device"]["power_share"] = bad
        with pytest.raises(MeshError, match="device.power_share"):
            Mesh.from_dict(data)


def test_a_mesh_spec_holds_its_devices_to_a_board_power():
    assert Mesh.parse("64x8:h100-80g,power=500w").device.power_share == pytest.approx(500 / 700)
    assert Mesh.parse("8:h100-96g,power=700").device.power_share == 1.0     # the cap lifted
    both = Mesh.parse("2x1:rtx4090-24g,host=96g,power=300w").device
    assert both.power_share == pytest.approx(300 / 450) and both.host_figures.memory_bytes == 96e9
    for spec, problem in (("8:h100-80g,power=800w", "at most its rated 700 W"),
                          ("8:h100-80g,power=0", "more than 0"),
                          ("4:cpu,power=100", "no rated board power"),
                          ("8:h100-80g,pwr=5", "unknown option 'pwr'")):
        with pytest.raises(MeshError, match=problem):
            Mesh.parse(spec)


def test_a_plan_for_capped_devices_keeps_the_cap_and_says_so():
    import autopar
    from autopar.commands.explain import headline
    from autopar.models import build_model
    from autopar.plans import Plan

    model, inputs = build_model("gpt-tiny")
    plan = autopar.plan(model, "2:h100-80g,power=350w", example_inputs=inputs, global_batch=8)
    assert "each held to 50% of its rated board power" in headline(plan).plain
    assert Plan.from_dict(plan.to_dict()).mesh["device"]["power_share"] == 0.5
