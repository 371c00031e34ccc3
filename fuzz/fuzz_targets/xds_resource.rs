//! Arbitrary bytes as an xDS resource (a proto-encoded `Listener`, `Cluster`,
//! `RouteConfiguration`, `ClusterLoadAssignment` or `Secret`, chosen by the first
//! byte) in an `Any`, decoded and compiled as the xDS client does: into the dynamic
//! resources of a snapshot, compiled with a bootstrap by `snapshot::compile_with`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    shunt_fuzz::compile_resource(selector, bytes);
});
