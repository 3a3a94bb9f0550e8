"""Tests that run_tests.py keeps out of the pytest-xdist part of a group and runs after it,
one at a time: multi-process tests that wait on fixed deadlines (queue timeouts, a lookup
expiry), in both tracks' versions. Beside another worker's tests on a small machine they
miss them. Kept free of imports: run_tests.py (system Python) and hma_pytest both read it."""

_SHM_TESTS = "tests/v1/kv_offload/cpu/test_shared_offload_region.py::"

# nodeid prefixes
SERIAL = (
    *(_SHM_TESTS + n for n in ("test_multi_worker_race_", "test_multiprocess_race_",
                               "test_create_next_view_multiprocess_slots",
                               "test_create_next_worker_view_multiprocess_slots")),
    # a method of a class in 0.34.0: a nodeid prefix must name the class
    "tests/v1/kv_offload/tiering/p2p/test_manager.py::TestBidirectionalManager::"
    "test_lookup_expiry_allows_zmq_reconnect",
)
