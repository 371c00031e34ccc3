//! istio.networking.nds.v1.NameTable (`tests/fixtures/istio/protos/nds.proto`), as
//! istiod encodes it, for the tests that push one over ADS.

use std::collections::HashMap;

use harness::ads::{AdsServer, Any};

pub const TYPE_URL: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";

#[derive(Clone, PartialEq, prost::Message)]
pub struct NameTable {
    #[prost(map = "string, message", tag = "1")]
    pub table: HashMap<String, NameInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NameInfo {
    #[prost(string, repeated, tag = "1")]
    pub ips: Vec<String>,
    #[prost(string, tag = "2")]
    pub registry: String,
    #[prost(string, tag = "3")]
    pub shortname: String,
    #[prost(string, tag = "4")]
    pub namespace: String,
}

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
