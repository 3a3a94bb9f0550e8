# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a model's K/V values depend on: the namespace of persistent KV caches.

A block's key hashes its tokens (and cache_salt, LoRA name, media); its bytes
also depend on the model that computed them. A tier that outlives the engine
must not serve blocks of other weights or another config at the same model
path: they are intact, so no checksum catches it (#49261, #56311).
"""

import contextlib
import hashlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import regex as re

from vllm.logger import init_logger

logger = init_logger(__name__)

# Bump when a field of the record changes meaning.
KV_VALUES_VERSION = 1

# The record's fields, and why each is in (over-inclusion costs misses only):
#   weights: the checkpoint's content (weights_fingerprint()).
#   load_format, model_weights, loader_extra_config: dummy weights, weights
#     streamed from a remote store (runai, tensorizer) are other values than
#     the local files'.
#   hf_config: the config vLLM resolved (hf_overrides applied): rope
#     parameters and scaling, head counts, windows, the checkpoint's
#     quantization_config. All of it but HF's bookkeeping, so a model's own
#     field is never missed; a transformers upgrade that changes its defaults
#     moves it (a miss).
#   dtype, quantization, quantization_config (online quantization's specs and
#     ignore patterns), override_attention_dtype: how K/V are computed.
#   kv_cache_dtype(_skip_layers), calculate_kv_scales, mamba_(ssm_)cache_dtype:
#     how they are stored.
#   max_model_len: LongRoPE models pick their rope factors by it (for other
#     models a change of it is a miss: when in doubt, in).
# Out: tokenizer, chat template, generation config, sampling, seed (a prefix's
# K/V do not depend on them); cache_salt, LoRA and media (in the block hash; a
# LoRA adapter rewritten in place under the same name and path is not
# covered); the hub revision (a commit that leaves the weight files alone
# keeps the cache: their blob hashes are in `weights`); attention backend,
# batch shape, vLLM version (the same values up to floating-point order).
# ModelConfig.compute_hash() is not reused: it covers the compile graph
# (without hf_overrides) and changes between releases.


@dataclass(frozen=True)
class KVValuesSource:
    """What describe_kv_values() reads, taken from a VllmConfig at no cost."""

    model: str
    revision: str | None
    download_dir: str | None
    load_format: str
    model_weights: str
    loader_extra_config: str  # digest of load_config.model_loader_extra_config
    hf_config: str  # digest of the resolved HF config
    dtype: str | None
    quantization: str | None
    quantization_config: str  # digest of model_config.quantization_config
    override_attention_dtype: str | None
    kv_cache_dtype: str | None
    kv_cache_dtype_skip_layers: tuple[str, ...]
    calculate_kv_scales: bool
    mamba_cache_dtype: str | None
    mamba_ssm_cache_dtype: str | None
    max_model_len: int

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "KVValuesSource":
        model, cache = vllm_config.model_config, vllm_config.cache_config
        load = getattr(vllm_config, "load_config", None)
        return cls(
            model=str(model.model),
            revision=_name(getattr(model, "revision", None)),
            download_dir=_name(getattr(load, "download_dir", None)),
            load_format=str(getattr(load, "load_format", "auto")),
            loader_extra_config=_config_digest(
                getattr(load, "model_loader_extra_config", None) or {}
            ),
            model_weights=str(getattr(model, "model_weights", "") or ""),
            hf_config=_config_digest(model.hf_config),
            dtype=_name(model.dtype),
            quantization=_name(model.quantization),
            quantization_config=_config_digest(
                getattr(model, "quantization_config", None) or {}
            ),
            override_attention_dtype=_name(
                getattr(model, "override_attention_dtype", None)
            ),
            kv_cache_dtype=_name(cache.cache_dtype),
            kv_cache_dtype_skip_layers=tuple(
                str(x) for x in getattr(cache, "kv_cache_dtype_skip_layers", ())
            ),
            calculate_kv_scales=bool(getattr(cache, "calculate_kv_scales", False)),
            mamba_cache_dtype=_name(getattr(cache, "mamba_cache_dtype", None)),
            mamba_ssm_cache_dtype=_name(getattr(cache, "mamba_ssm_cache_dtype", None)),
            max_model_len=int(getattr(model, "max_model_len", 0) or 0),
        )


def describe_kv_values(source: KVValuesSource) -> dict:
    """The record of what the K/V values depend on, for a persistent tier's
    namespace. Reads the checkpoint's headers and a sample of its tensors
    (once, where a persistent tier starts), and logs the result."""
    start = time.monotonic()
    record = asdict(source)
    # the model's name is FileMapper's; where it is cached is not its values
    del record["model"], record["revision"], record["download_dir"]
    record["kv_cache_dtype_skip_layers"] = list(source.kv_cache_dtype_skip_layers)
    record["weights"] = weights_fingerprint(
        source.model, source.revision, source.load_format, source.download_dir
    )
    record["version"] = KV_VALUES_VERSION
    logger.info(
        "KV values of %s, the namespace of persistent KV caches: %s "
        "(fingerprinted in %.0f ms)",
        source.model,
        summary(record, source.revision),
        (time.monotonic() - start) * 1000,
    )
    return record


def summary(record: dict, revision: str | None = None) -> str:
    """The record in a few words, for a start-up line."""
    weights = record["weights"]
    where = weights["source"] + (f" revision {revision}" if revision else "")
    return (
        f"weights {weights['digest'] or 'not fingerprinted'} ({where}), "
        f"config {record['hf_config']}, dtype {record['dtype']}, "
        f"quantization {record['quantization']}, "
        f"kv cache dtype {record['kv_cache_dtype']}"
    )


def _name(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


# What layout_change() names, for a field of the record that differs (a field not
# named here: "other values: <field>").
_VALUE_CHANGES = {
    "version": "fingerprint version changed",
    "weights": "weights changed",
    "load_format": "weights' source changed",
    "model_weights": "weights' source changed",
    "loader_extra_config": "weights' source changed",
    "hf_config": "model config changed",
    "max_model_len": "max_model_len changed",
    **dict.fromkeys(
        (
            "dtype",
            "quantization",
            "quantization_config",
            "override_attention_dtype",
            "kv_cache_dtype",
            "kv_cache_dtype_skip_layers",
            "calculate_kv_scales",
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
        ),
        "dtype or quantization changed",
    ),
}


def layout_change(ours: dict, theirs: dict | None) -> str:
    """What differs between this layout's recorded fields (FileMapper's,
    config.json) and another layout's of the same model, for a start-up
    line: "weights changed", "model config changed", "dtype or quantization
    changed" (compute or cache dtypes), "other values: <field>" (a record field
    _VALUE_CHANGES does not name), "other settings: <field>, ..." (block
    layout, tier settings, parallelism)."""
    if theirs is None:
        return "no readable config.json"
    if "kv_values" not in theirs:
        return "written before the model's values were recorded"
    ours_values, their_values = ours.get("kv_values") or {}, theirs["kv_values"]
    if not isinstance(their_values, dict):
        return "unreadable kv_values"
    changes = []
    for field in sorted(set(ours_values) | set(their_values)):
        if ours_values.get(field) != their_values.get(field):
            change = _VALUE_CHANGES.get(field, f"other values: {field}")
            if change not in changes:
                changes.append(change)
    settings = sorted(
        k
        for k in set(ours) | set(theirs)
        if k != "kv_values" and ours.get(k) != theirs.get(k)
    )
    if settings:
        changes.append("other settings: " + ", ".join(settings))
    return "; ".join(changes) or "the same fields"


# HF's own bookkeeping in PretrainedConfig.to_dict(): not the model's.
_EXCLUDED_CONFIG_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation"}
)


def _config_digest(config: Any) -> str:
    if hasattr(config, "to_dict"):  # a PretrainedConfig
        config = config.to_dict()
    elif is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)  # QuantizationConfigArgs
    canonical = json.dumps(
        _without_bookkeeping(config),
        sort_keys=True,
        default=_json,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _json(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)  # one order in every process
    return str(value)


def _without_bookkeeping(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            str(k): _without_bookkeeping(v)  # str keys: sortable
            for k, v in value.items()
            if k not in _EXCLUDED_CONFIG_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_without_bookkeeping(v) for v in value]
    return value


# The files of a checkpoint that make its values (top level, as vLLM's
# loaders read them): weights, their index, quantization configs, remote
# code. Not the tokenizer, docs, or files a full hub download adds.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".tensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".npz",
    ".msgpack",
    ".h5",
)
_OTHER_FILES = re.compile(
    r".*\.index\.json|.*\.py|(hf_)?quant(ize|ization)?_config\.json|params\.json"
)
# A hub cache blob's name is its content's sha256 (LFS) or git sha1.
_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_SAMPLE_BYTES = 64  # read from the middle of every tensor of a safetensors file
_FILE_SAMPLES = 1024  # spread over any other file
_MAX_FILES = 10000
_MAX_HEADER_BYTES = 100 << 20
_DATA_OFFSETS = re.compile(rb'"data_offsets"\s*:\s*\[\s*(\d+)\s*,\s*(\d+)\s*\]')


def weights_fingerprint(
    model: str,
    revision: str | None = None,
    load_format: str = "auto",
    download_dir: str | None = None,
) -> dict:
    """{"source", "digest"} of a model's checkpoint.

    A local directory or file (gguf): each weight file's name and size, and
    its content sampled. A safetensors file: its header (every tensor's
    name, dtype, shape, offsets) and 64 bytes from the middle of every
    tensor: a rewrite that changes weights (a fine-tune, a re-quantization,
    a merged adapter) changes nearly every element of the tensors it
    touches. Content, not mtimes: a touch, a copy or a fresh download keeps
    the namespace. Other files (pickles, gguf) are sampled over their bytes
    and their mtime is included: a sample cannot see every tensor there.
    A hub model: the cache's blob names, which are content hashes. Where a
    safetensors file is, the loader reads no other format: .bin/.pt files
    beside it (training state, a second copy) do not count.
    Neither, or no weight file found: "unknown" and a warning.
    """
    if load_format == "dummy":
        return {"source": "dummy", "digest": None}
    why = "not a local path, nor a snapshot in the Hugging Face cache"
    try:
        source = "local" if os.path.exists(model) else "hub"
        path = (
            model if source == "local" else _hub_snapshot(model, revision, download_dir)
        )
        if path is not None:
            files = [path] if os.path.isfile(path) else _weight_files(path)
            if any(f.endswith(_WEIGHT_SUFFIXES) for f in files):
                return {"source": source, "digest": _digest(files)}
            why = f"no weight file in {path} (load_format {load_format})"
    except (OSError, ValueError) as e:
        why = str(e)
    logger.warning(
        "Cannot fingerprint the weights of %r: %s. Persistent KV caches tell "
        "its versions apart by its name and config only: after new weights "
        "at the same name, remove their directories.",
        model,
        why,
    )
    return {"source": "unknown", "digest": None}


def _hub_snapshot(
    model: str, revision: str | None, cache_dir: str | None
) -> str | None:
    """The snapshot folder of a hub model's revision in the Hugging Face cache,
    however much of it was downloaded (vLLM downloads only the files its
    loader reads); None if there is none."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        return None
    repo = os.path.join(
        cache_dir or constants.HF_HUB_CACHE,
        repo_folder_name(repo_id=model, repo_type="model"),
    )
    commit = revision or "main"
    ref = os.path.join(repo, "refs", commit)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit)
    return snapshot if os.path.isdir(snapshot) else None


def _weight_files(model_dir: str) -> list[str]:
    """The checkpoint's files in model_dir (regular files, or links to
    them), sorted by name."""
    found = []
    with os.scandir(model_dir) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not (
                name.endswith(_WEIGHT_SUFFIXES) or _OTHER_FILES.fullmatch(name)
            ):
                continue
            if entry.is_file():  # follows links; not a FIFO, not a broken link
                found.append(entry.path)
            if len(found) >= _MAX_FILES:
                raise ValueError(f"{_MAX_FILES} or more weight files in {model_dir}")
    if any(f.endswith(".safetensors") for f in found):
        found = [
            f
            for f in found
            if f.endswith(".safetensors") or not f.endswith(_WEIGHT_SUFFIXES)
        ]
    return sorted(found)


def _digest(paths: list[str]) -> str:
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        signatures = list(pool.map(_signature_or_unreadable, paths))
    digest = hashlib.sha256()
    for path, signature in zip(paths, signatures):
        digest.update(os.fsencode(os.path.basename(path)) + b"\0" + signature)
    return digest.hexdigest()[:32]


def _signature_or_unreadable(path: str) -> bytes:
    """A weight file that cannot be read fails the fingerprint (OSError);
    another checkpoint file (remote code, a config) counts as unreadable."""
    try:
        return _file_signature(path)
    except OSError as e:
        if path.endswith(_WEIGHT_SUFFIXES):
            raise
        return f"unreadable:{e.errno}".encode()


def _file_signature(path: str) -> bytes:
    if os.path.islink(path):
        blob = os.path.basename(os.readlink(path))
        if _BLOB_NAME.fullmatch(blob):
            return f"blob:{blob}".encode()  # the hub cache's content hash
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{stat.S_IFMT(st.st_mode)}".encode()
        if hasattr(os, "posix_fadvise"):  # samples far apart: no readahead
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        parts = [str(st.st_size).encode()]
        header = None
        if path.endswith(".safetensors"):
            header = _safetensors_header(fd, st.st_size)
        if header is not None:
            raw, tensors = header
            parts.append(raw)
            for begin, end in tensors:
                middle = 8 + len(raw) + (begin + end) // 2
                parts.append(os.pread(fd, _SAMPLE_BYTES, middle))
        else:
            parts.append(str(st.st_mtime_ns).encode())
            step = max(1, st.st_size // _FILE_SAMPLES)
            for offset in range(0, st.st_size, step):
                parts.append(os.pread(fd, _SAMPLE_BYTES, offset))
    finally:
        os.close(fd)
    return hashlib.sha256(b"\0".join(parts)).digest()


def _safetensors_header(
    fd: int, size: int
) -> tuple[bytes, list[tuple[int, int]]] | None:
    """A safetensors file's raw header and its tensors' (begin, end) data
    offsets, found without parsing the JSON (a MoE's headers hold ~10^5
    entries); None where it has none (then sampled as any other file)."""
    length = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\xff"), "little")
    if length > min(_MAX_HEADER_BYTES, size - 8):
        return None
    raw = os.pread(fd, length, 8)
    tensors = [(int(m[1]), int(m[2])) for m in _DATA_OFFSETS.finditer(raw)]
    return (raw, tensors) if tensors else None
