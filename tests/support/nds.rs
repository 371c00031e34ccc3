//! istio.networking.nds.v1.NameTable (`tests/fixtures/istio/protos/nds.proto`), as
//! istiod encodes it, for the tests that push one over ADS.

use harness::ads::{AdsServer, Any};

pub const TYPE_URL: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";

/// The proxy's own decoding types: the test encodes what the proxy decodes.
pub use shunt::dns::name_table::{NameInfo, NameTable};

/// A ServiceEntry host (registry External) at `ips`.
pub fn service_entry(ips: &[&str]) -> NameInfo {
    NameInfo {
        ips: ips.iter().map(|s| s.to_string()).collect(),
        registry: "External".into(),
        ..Default::default()
    }
}

/// Sets the server's name table to `table`, as version `version`.
pub fn push(server: &AdsServer, version: &str, table: &NameTable) {
    use prost::Message;
    let any = Any {
        type_url: TYPE_URL.into(),
        value: table.encode_to_vec(),
    };
    server.set(TYPE_URL, version, vec![(String::new(), any)]);
}
