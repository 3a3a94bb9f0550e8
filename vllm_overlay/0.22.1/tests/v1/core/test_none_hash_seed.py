# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NONE_HASH seeding: reproducible block hashes for cryptographic hash
functions without PYTHONHASHSEED (upstream #51875)."""

import pytest

import vllm.v1.core.kv_cache_utils as kv_cache_utils
from vllm.utils.hashing import sha256, sha256_cbor, xxhash, xxhash_cbor


@pytest.fixture
def restore_none_hash():
    """init_none_hash() sets a module global: put the previous value back."""
    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    yield
    if saved is not None:
        kv_cache_utils.NONE_HASH = saved


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_none_hash_is_reproducible_without_pythonhashseed(
    monkeypatch, restore_none_hash, hash_fn
):
    """Cryptographic hash functions derive NONE_HASH from a fixed default
    seed when PYTHONHASHSEED is unset, so block hashes (and caches keyed by
    them, e.g. a disk tier) survive restarts."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(hash_fn)
    first = kv_cache_utils.NONE_HASH
    kv_cache_utils.init_none_hash(hash_fn)
    assert first == kv_cache_utils.NONE_HASH
    assert first == hash_fn(kv_cache_utils.DEFAULT_NONE_HASH_SEED)


@pytest.mark.parametrize("hash_fn", [xxhash, xxhash_cbor])
def test_none_hash_stays_random_for_xxhash(monkeypatch, restore_none_hash, hash_fn):
    """xxhash is not collision resistant: without PYTHONHASHSEED its seed
    stays random per process (#12621), and PYTHONHASHSEED still fixes it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(hash_fn)
    first = kv_cache_utils.NONE_HASH
    kv_cache_utils.init_none_hash(hash_fn)
    assert first != kv_cache_utils.NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    kv_cache_utils.init_none_hash(hash_fn)
    assert hash_fn("0") == kv_cache_utils.NONE_HASH
