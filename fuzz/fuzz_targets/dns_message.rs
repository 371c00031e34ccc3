//! Arbitrary bytes as what reaches the DNS proxy: the first byte picks the input.
//!
//! - 0: a datagram on the UDP socket, 1: a message on a TCP connection, through
//!   `Resolver::answer` with a fixed name table and no upstream server (a forwarded
//!   query fails at once with SERVFAIL). Every answer must parse, carry the query's id,
//!   and over UDP fit what the client said it takes.
//! - 2: a proto-encoded `NameTable` as NDS delivers it, built into a lookup table (a
//!   bad one is refused, never a panic) and asked for each of its own names.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hickory_proto::op::Message;
use hickory_proto::rr::RecordType;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use shunt::dns::name_table::{LookupTable, NameInfo, NameTable, Scope};
use shunt::dns::upstream::Upstreams;
use shunt::dns::{DnsStats, Resolver, Tables, Transport};

fn scope() -> Scope {
    Scope::new(
        "default",
        "default.svc.cluster.local",
        vec![
            "default.svc.cluster.local".into(),
            "svc.cluster.local".into(),
        ],
    )
}

fn fixture() -> &'static (tokio::runtime::Runtime, Resolver) {
    static FIXTURE: OnceLock<(tokio::runtime::Runtime, Resolver)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let tables = Arc::new(Tables::new(scope()));
        let mut table = HashMap::new();
        table.insert(
            "productpage.default.svc.cluster.local".to_owned(),
            NameInfo {
                ips: vec!["10.96.0.20".into()],
                registry: "Kubernetes".into(),
                shortname: "productpage".into(),
                namespace: "default".into(),
                alt_hosts: Vec::new(),
            },
        );
        table.insert(
            "*.wild.example".to_owned(),
            NameInfo {
                ips: (0..80).map(|i| format!("240.240.0.{i}")).collect(),
                registry: "External".into(),
                ..Default::default()
            },
        );
        tables.apply(NameTable { table }, "fuzz").unwrap();
        let upstreams = Upstreams {
            servers: Vec::new(),
            timeout: Duration::from_millis(10),
            netns: None,
        };
        let stats = shunt::stats::Store::new();
        let resolver = Resolver::new(tables, upstreams, 64, DnsStats::new(&stats));
        (runtime, resolver)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, input)) = data.split_first() else {
        return;
    };
    match pick % 3 {
        0 | 1 => {
            let transport = if pick % 3 == 0 {
                Transport::Udp
            } else {
                Transport::Tcp
            };
            let (runtime, resolver) = fixture();
            let Some(bytes) = runtime.block_on(resolver.answer(input, transport)) else {
                return;
            };
            let reply = Message::from_vec(&bytes).expect("every answer parses");
            assert_eq!(reply.metadata.id.to_be_bytes(), input[..2]);
            if let (Transport::Udp, Ok(query)) = (transport, Message::from_vec(input)) {
                let limit = usize::from(query.max_payload());
                assert!(
                    bytes.len() <= limit,
                    "{} bytes over UDP, {limit} allowed",
                    bytes.len()
                );
            }
        }
        _ => {
            let Ok(table) = NameTable::decode(input) else {
                return;
            };
            let Ok(lookup) = LookupTable::build(&table, &scope()) else {
                return;
            };
            for host in table.table.keys() {
                let mut name = host.to_ascii_lowercase();
                if !name.ends_with('.') {
                    name.push('.');
                }
                for qtype in [RecordType::A, RecordType::AAAA, RecordType::TXT] {
                    let _ = lookup.lookup(qtype, &name);
                }
            }
        }
    }
});
