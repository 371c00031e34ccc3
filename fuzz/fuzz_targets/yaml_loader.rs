//! YAML bootstraps spelled from YAML's own tokens: each input byte picks one (flow
//! brackets, node properties `!tag` and `&anchor`, aliases, merge keys, quoted and plain
//! scalars, comments, block indicators, line breaks), so the fuzzer reaches deep flow
//! nesting behind tags and anchors at once rather than by chance. Every document goes
//! through the YAML loader as `-c FILE` does; it must answer (a bootstrap or a refusal
//! naming what is wrong), never panic, and never go quadratic: a spelling that slips
//! past the flow-depth check before parsing shows up as a timeout (`-timeout`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shunt::config::load::{Format, parse};

fuzz_target!(|data: &[u8]| {
    let document = shunt_fuzz::yaml_from_tokens(data);
    let mut findings = Vec::new();
    if let Err(err) = parse(
        document.as_bytes(),
        Format::Yaml,
        "fuzz.yaml",
        &mut findings,
    ) {
        assert!(err.to_string().starts_with("fuzz.yaml: "), "{err}");
    }
});
