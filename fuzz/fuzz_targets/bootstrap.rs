//! Arbitrary text as a bootstrap, through `shunt::config` as `-c FILE` and
//! `--config-yaml` load it (JSON, YAML or binary protobuf, chosen by the first byte),
//! then validated and compiled into a snapshot as `--mode validate` does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shunt::config::load::{Format, parse};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, document)) = data.split_first() else {
        return;
    };
    let format = match selector % 3 {
        0 => Format::Json,
        1 => Format::Yaml,
        _ => Format::Binary,
    };
    let mut findings = Vec::new();
    let Ok(bootstrap) = parse(document, format, "fuzz", &mut findings) else {
        return;
    };
    let options = shunt::config::Options::default();
    let _ = shunt::config::load::load(&shunt::config::Options {
        config_yaml: std::str::from_utf8(document).ok().map(str::to_owned),
        ..Default::default()
    });
    let _ = shunt::config::check(&options, &shunt::snapshot::extensions::IMPLEMENTED);
    shunt_fuzz::compile_bootstrap(&bootstrap);
});
