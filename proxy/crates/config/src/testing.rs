//! Where the tests' inputs are: this crate's `testdata/` and the repository's
//! third-party fixtures. For this crate's tests and, with the `testing` feature, the
//! tests of the crates above.

use std::path::{Path, PathBuf};

/// This crate's own test bootstraps.
pub const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/testdata");

/// The third-party inputs, in the repository (`tests/fixtures/`, see its SOURCES.md).
pub fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures")
}
