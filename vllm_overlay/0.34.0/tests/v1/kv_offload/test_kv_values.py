# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fingerprint of what a model's K/V values depend on (kv_values.py):
real safetensors files, a real Hugging Face cache layout, real configs."""

import dataclasses
import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.config.quantization import QuantizationConfigArgs
from vllm.v1.kv_offload import kv_values
from vllm.v1.kv_offload.kv_values import (
    KVValuesSource,
    describe_kv_values,
    weights_fingerprint,
)


def _write_model(model_dir, seed: int, num_tensors: int = 16) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"model.layers.{i}.proj.weight": torch.randn(16, 64, generator=g).to(
            torch.bfloat16
        )
        for i in range(num_tensors)
    }
    model_dir.mkdir(exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"), {"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model_dir / "tokenizer.json").write_text("{}")


def _digest(model) -> str:
    fingerprint = weights_fingerprint(str(model))
    assert fingerprint["source"] == "local", fingerprint
    return fingerprint["digest"]


def test_same_files_same_fingerprint_touch_and_copy_included(tmp_path):
    """Content, not mtimes: computing twice, touching every file, or a
    fresh copy of the same files (a replica's download) keeps it."""
    _write_model(tmp_path / "m", seed=0)
    first = _digest(tmp_path / "m")
    assert _digest(tmp_path / "m") == first
    for name in os.listdir(tmp_path / "m"):
        os.utime(tmp_path / "m" / name, (1, 1))
    assert _digest(tmp_path / "m") == first
    shutil.copytree(tmp_path / "m", tmp_path / "copy")
    assert _digest(tmp_path / "copy") == first


def test_new_weights_of_the_same_size_change_it(tmp_path):
    """A fine-tune written over the directory: same names, shapes and file
    size, other values."""
    _write_model(tmp_path / "m", seed=0)
    before = _digest(tmp_path / "m")
    size = (tmp_path / "m" / "model.safetensors").stat().st_size
    _write_model(tmp_path / "m", seed=1)
    assert (tmp_path / "m" / "model.safetensors").stat().st_size == size
    assert _digest(tmp_path / "m") != before


def test_new_weights_change_the_record(tmp_path):
    """The fingerprint is a field of the record FileMapper hashes."""
    _write_model(tmp_path / "m", seed=0)
    before = describe_kv_values(_source(model=str(tmp_path / "m")))
    _write_model(tmp_path / "m", seed=1)
    assert describe_kv_values(_source(model=str(tmp_path / "m"))) != before


@pytest.mark.parametrize("changed", [0, 777, 1999])
def test_any_one_changed_tensor_changes_it(tmp_path, changed):
    """A merged adapter that changes one tensor of 2,000 (a MoE has ~10^5)
    is seen, wherever it is: every tensor is sampled."""
    _write_model(tmp_path / "m", seed=0, num_tensors=2000)
    before = _digest(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    name = f"model.layers.{changed}.proj.weight"
    tensors[name] = (tensors[name].float() * 1.01).to(torch.bfloat16)
    save_file(tensors, str(path), {"format": "pt"})
    assert _digest(tmp_path / "m") != before


def test_only_the_checkpoints_files_count(tmp_path):
    """Tokenizer, docs, generation config and a full download's extra
    folders do not change it; a quantization config and remote code do.
    Entries that are not regular files are skipped, never opened."""
    _write_model(tmp_path / "m", seed=0)
    before = _digest(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text('{"changed": true}')
    (tmp_path / "m" / "README.md").write_text("new docs")
    (tmp_path / "m" / "generation_config.json").write_text("{}")
    (tmp_path / "m" / "original").mkdir()
    (tmp_path / "m" / "original" / "consolidated.pth").write_bytes(b"x" * 100)
    os.mkfifo(tmp_path / "m" / "pipe.bin")
    os.symlink(tmp_path / "nowhere", tmp_path / "m" / "broken.safetensors")
    (tmp_path / "m" / "dir.safetensors").mkdir()
    assert _digest(tmp_path / "m") == before
    (tmp_path / "m" / "quantize_config.json").write_text('{"bits": 4}')
    quantized = _digest(tmp_path / "m")
    assert quantized != before
    (tmp_path / "m" / "modeling_x.py").write_text("# remote code")
    remote_code = _digest(tmp_path / "m")
    assert remote_code != quantized
    # beside safetensors the loader reads no other format: training state and
    # a second copy do not count (nor their mtimes)
    (tmp_path / "m" / "training_args.bin").write_bytes(b"args")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"copy")
    assert _digest(tmp_path / "m") == remote_code


def test_other_files_are_sampled_with_their_mtime(tmp_path):
    """A pickle or a gguf file (given as the model) is sampled over its
    bytes, and its mtime counts: a sample cannot see all its tensors."""
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(1 << 20))
    os.utime(model, (1, 1))
    before = _digest(model)
    assert _digest(model) == before
    model.write_bytes(os.urandom(1 << 20))
    os.utime(model, (1, 1))
    assert _digest(model) != before
    rewritten = _digest(model)
    os.utime(model, (2, 2))
    assert _digest(model) != rewritten


def _hub_cache(cache, repo: str, commit: str, files: dict) -> None:
    """The Hugging Face cache's layout: refs/main names the snapshot, whose
    files link to blobs named by their content hashes."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))


def test_hub_model_by_its_blob_hashes(tmp_path, monkeypatch):
    """A hub name: the blobs' content hashes (nothing read). A revision that
    changes only the README keeps it; one with new weights changes it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    files = {"config.json": b"{}", "model.safetensors": b"old weights"}
    _hub_cache(cache, "org/model", "a" * 40, files)
    old = weights_fingerprint("org/model")
    assert old["source"] == "hub" and old["digest"]
    _hub_cache(cache, "org/model", "b" * 40, {**files, "README.md": b"new docs"})
    assert weights_fingerprint("org/model") == old
    _hub_cache(cache, "org/model", "c" * 40, {**files, "model.safetensors": b"new"})
    assert weights_fingerprint("org/model")["digest"] != old["digest"]
    assert weights_fingerprint("org/model", revision="a" * 40) == old
    # vLLM downloads only what its loader reads: a snapshot whose tree lists
    # more files than were downloaded is fingerprinted all the same
    (cache / "models--org--model" / "trees").mkdir()
    tree = [{"path": p} for p in ("config.json", "model.safetensors", "model.bin")]
    (cache / "models--org--model" / "trees" / ("c" * 40 + ".json")).write_text(
        json.dumps(tree)
    )
    assert weights_fingerprint("org/model", revision="c" * 40)["source"] == "hub"
    # --download-dir: another cache
    other = tmp_path / "download_dir"
    _hub_cache(other, "org/model", "a" * 40, files)
    assert weights_fingerprint("org/model", download_dir=str(other)) == old


@pytest.mark.parametrize("case", ["nowhere", "no weight file", "dummy"])
def test_weights_that_cannot_be_fingerprinted_are_said(tmp_path, caplog_vllm, case):
    """A model neither local nor cached, or a directory without weight
    files (weights streamed from elsewhere): "unknown" and a warning. Dummy
    weights: a namespace of their own, never the real weights'."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "config.json").write_text("{}")
    model, load_format = {
        "nowhere": (str(tmp_path / "nowhere"), "auto"),
        "no weight file": (str(tmp_path / "configs"), "runai_streamer"),
        "dummy": (str(tmp_path / "configs"), "dummy"),
    }[case]
    fingerprint = weights_fingerprint(model, load_format=load_format)
    if case == "dummy":
        assert fingerprint == {"source": "dummy", "digest": None}
        return
    assert fingerprint == {"source": "unknown", "digest": None}
    assert "Cannot fingerprint the weights" in caplog_vllm.text


def _source(**changes) -> KVValuesSource:
    source = KVValuesSource(
        model="/nowhere",
        revision=None,
        download_dir=None,
        load_format="auto",
        model_weights="",
        loader_extra_config="0" * 32,
        hf_config="0" * 32,
        dtype="bfloat16",
        quantization=None,
        quantization_config="0" * 32,
        override_attention_dtype=None,
        kv_cache_dtype="auto",
        kv_cache_dtype_skip_layers=(),
        calculate_kv_scales=False,
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        max_model_len=4096,
    )
    return dataclasses.replace(source, **changes)


@pytest.mark.parametrize(
    "change",
    [
        {"hf_config": "1" * 32},
        {"dtype": "float16"},
        {"quantization": "fp8"},
        {"quantization_config": "1" * 32},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype_skip_layers": ("layers.0",)},
        {"mamba_ssm_cache_dtype": "float32"},
        {"max_model_len": 131072},
        {"load_format": "dummy"},
        {"model_weights": "s3://bucket/other"},
        {"loader_extra_config": "1" * 32},
    ],
)
def test_every_field_of_the_record_counts(change):
    assert describe_kv_values(_source(**change)) != describe_kv_values(_source())


def test_config_digest_covers_rope_not_bookkeeping():
    base = {"model_type": "llama", "rope_theta": 10000.0, "_name_or_path": "/a"}
    digest = kv_values._config_digest(base)
    assert kv_values._config_digest({**base, "_name_or_path": "/b"}) == digest
    assert kv_values._config_digest({**base, "transformers_version": "9"}) == digest
    assert kv_values._config_digest({**base, "rope_theta": 80000.0}) != digest
    scaled = {**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert kv_values._config_digest(scaled) != digest
    ignore = QuantizationConfigArgs(ignore=["lm_head"])
    assert kv_values._config_digest(ignore) == kv_values._config_digest(
        QuantizationConfigArgs(ignore=["lm_head"])
    )
    assert kv_values._config_digest(ignore) != kv_values._config_digest({})
    # one digest in every process: sets sorted, keys of any type
    assert kv_values._config_digest({"a": {"x", "y", "z"}, 1: 2}) == (
        kv_values._config_digest({1: 2, "a": {"z", "y", "x"}})
    )


@pytest.mark.parametrize(
    "theirs, expected",
    [
        (None, "no readable config.json"),
        ({"model_name": "m"}, "written before the model's values were recorded"),
        ({"model_name": "m", "kv_values": None}, "unreadable kv_values"),
        (
            {"model_name": "m", "kv_values": {"weights": 2, "hf_config": 1}},
            "weights changed",
        ),
        (
            {"model_name": "m", "kv_values": {"weights": 1, "hf_config": 2}},
            "model config changed",
        ),
        (
            {
                "model_name": "m",
                "kv_values": {"weights": 1, "hf_config": 1, "kv_cache_dtype": "fp8"},
            },
            "dtype or quantization changed",
        ),
        (
            {
                "model_name": "m",
                "tp_size": 2,
                "kv_values": {"weights": 1, "hf_config": 1},
            },
            "other settings: tp_size",
        ),
        (
            {
                "model_name": "m",
                "kv_values": {"weights": 1, "hf_config": 1, "loader_extra_config": 2},
            },
            "weights' source changed",
        ),
        (
            {"model_name": "m", "kv_values": {"weights": 1, "hf_config": 1, "new": 1}},
            "other values: new",
        ),
    ],
)
def test_layout_change_says_what_differs(theirs, expected):
    ours = {"model_name": "m", "kv_values": {"weights": 1, "hf_config": 1}}
    assert kv_values.layout_change(ours, theirs) == expected


def test_every_field_of_the_record_has_a_layout_change():
    """A field added to KVValuesSource gets its reason in the other-layouts line
    (kv_values._VALUE_CHANGES), not a generic one."""
    fields = {f.name for f in dataclasses.fields(KVValuesSource)} - {
        "model",
        "revision",
        "download_dir",
    }
    unnamed = fields - set(kv_values._VALUE_CHANGES)
    assert not unnamed, unnamed
