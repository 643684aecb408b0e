//! End-to-end tests of keel across crates; the tests live under `tests/tests/`.
