//! The pod harness.
