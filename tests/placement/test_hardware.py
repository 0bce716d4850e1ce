"""Hardware profiles: every reference number carries a cited source; bad profiles fail naming the field."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from hybridmoe.placement.hardware import (REFERENCE_PROFILES, ProfileError, load_profile, machine, parse_profile,
                                          profile_to_json, reference_profile)


def raw(name: str) -> dict:
    return json.loads(resources.files("hybridmoe.placement").joinpath(f"data/hardware/{name}.json").read_text())


def numeric_leaves(node, path=""):
    if isinstance(node, dict) and "value" in node:
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from numeric_leaves(v, f"{path}.{k}")


@pytest.mark.parametrize("name", REFERENCE_PROFILES)
def test_reference_profiles_cite_every_number(name):
    data = raw(name)
    profile = reference_profile(name)
    assert profile.kind in ("cpu", "gpu") and profile.description
    part = data.get("cpu") or data.get("gpu")
    leaves = list(numeric_leaves(part))
    assert len(leaves) >= 8
    for path, leaf in leaves:
        ref = leaf["source"].split(":")[0].split()[0]
        assert ref in data["references"], f"{name}{path}: source {leaf['source']!r} cites no reference"
        assert len(data["references"][ref]) > 40  # a real citation, not a tag


def test_the_issue_hardware_is_all_there():
    kinds = {name: reference_profile(name).kind for name in REFERENCE_PROFILES}
    assert [n for n, k in kinds.items() if k == "gpu"] == ["rtx4090", "rtx5090", "h200"]
    assert {"xeon-spr-2s", "xeon-gnr-2s", "epyc-genoa-2s", "epyc-turin-2s", "desktop-2ch"} <= set(kinds)


def test_reference_numbers_are_the_datasheet_ones():
    r5090, r4090, h200 = (reference_profile(n).gpu for n in ("rtx5090", "rtx4090", "h200"))
    assert (r5090.memory_gb, r5090.memory_gbs) == (32, 1792)
    assert (r4090.memory_gb, r4090.memory_gbs) == (24, 1008)
    assert (h200.memory_gb, h200.memory_gbs) == (141, 4800)
    assert r5090.h2d_gbs == pytest.approx(2 * r4090.h2d_gbs)  # PCIe 5.0 vs 4.0
    genoa = reference_profile("epyc-genoa-2s").cpu
    assert genoa.memory_read_gbs == pytest.approx(2 * 378) and genoa.cores == 192


def test_machine_composition():
    m = machine("rtx5090,epyc-genoa-2s", gpus=2)
    assert m.gpu.name == "rtx5090" and m.cpu.name == "epyc-genoa-2s" and m.num_gpus == 2
    assert machine("epyc-genoa-2s").gpu is None
    with pytest.raises(ProfileError, match="exactly one CPU"):
        machine("rtx5090")
    with pytest.raises(ProfileError, match="exactly one CPU"):
        machine("epyc-genoa-2s,xeon-spr-2s")
    with pytest.raises(ProfileError, match="more than one GPU"):
        machine("rtx5090,rtx4090,epyc-genoa-2s")
    with pytest.raises(ProfileError, match="no GPU profile"):
        machine("epyc-genoa-2s", gpus=2)
    with pytest.raises(ProfileError, match="unknown hardware 'rtx9090'.*rtx4090"):
        machine("rtx9090,epyc-genoa-2s")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("schema"), "'schema'"),
    (lambda d: d.update(version=99), "'version' 99 is not supported"),
    (lambda d: d.update(kind="toaster"), "'kind'"),
    (lambda d: d["gpu"].pop("memory_gbs"), "'memory_gbs' is missing"),
    (lambda d: d["gpu"].update(memory_gbs=1792), "'memory_gbs' must be"),
    (lambda d: d["gpu"].update(memory_gbs={"value": -1, "source": "nv-5090"}), "positive number"),
    (lambda d: d["gpu"].update(memory_gbs={"value": 1792, "source": ""}), "'memory_gbs' must be"),
    (lambda d: d["gpu"].update(memory_gbs={"value": 1792, "source": "my guess"}), "must start with a reference"),
    (lambda d: d["gpu"].update(matmul_table={"bf16": [[1, "fast"]]}), "'bf16' must be a list of"),
])
def test_bad_profiles_name_the_field(edit, message):
    data = copy.deepcopy(raw("rtx5090"))
    edit(data)
    with pytest.raises(ProfileError, match=message):
        parse_profile(data, "test.json")


def test_write_and_read_back(tmp_path):
    data = raw("epyc-genoa-2s")
    profile_to_json(data, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == reference_profile("epyc-genoa-2s")
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ProfileError, match="invalid JSON"):
        load_profile(tmp_path / "broken.json")
