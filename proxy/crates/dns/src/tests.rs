//! The resolver on whole messages: local answers, the state before any table, bad
//! input, truncation. Forwarding is tested against a real dnsmasq in `tests/dns.rs`.

use std::collections::HashMap;

use hickory_proto::op::{Edns, Query};
use hickory_proto::rr::{Name, RData};

use super::name_table::NameInfo;
use super::*;

fn resolver(table: Option<NameTable>) -> Resolver {
    let tables = Arc::new(Tables::new(Scope::new(
        "default",
        "default.svc.cluster.local",
        vec!["default.svc.cluster.local".into()],
    )));
    if let Some(table) = table {
        tables.apply(table, "1").unwrap();
    }
    let upstreams = Upstreams {
        servers: Vec::new(),
        timeout: Duration::from_millis(100),
        netns: None,
    };
    Resolver::new(tables, upstreams, 16, DnsStats::new(&StatsStore::new()))
}

fn table(host: &str, ips: &[String]) -> NameTable {
    let mut table = HashMap::new();
    table.insert(
        host.to_owned(),
        NameInfo {
            ips: ips.to_vec(),
            registry: "External".into(),
            ..Default::default()
        },
    );
    NameTable { table }
}

fn query(name: &str, qtype: RecordType, edns: Option<u16>) -> Vec<u8> {
    let mut m = Message::new(4242, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
    if let Some(size) = edns {
        let mut e = Edns::new();
        e.set_max_payload(size);
        m.set_edns(e);
    }
    m.to_vec().unwrap()
}

async fn ask(r: &Resolver, bytes: &[u8], transport: Transport) -> Message {
    Message::from_vec(&r.answer(bytes, transport).await.expect("an answer")).unwrap()
}

#[tokio::test]
async fn a_mesh_name_is_answered_authoritatively_with_the_query_id() {
    let r = resolver(Some(table("echo.mesh.test", &["240.240.0.7".into()])));
    let reply = ask(
        &r,
        &query("Echo.Mesh.Test.", RecordType::A, None),
        Transport::Udp,
    )
    .await;
    assert_eq!(reply.metadata.id, 4242);
    assert!(reply.metadata.authoritative);
    assert!(reply.metadata.recursion_desired);
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    assert_eq!(reply.answers.len(), 1);
    assert_eq!(
        reply.answers[0].data,
        RData::A("240.240.0.7".parse().unwrap())
    );
    assert_eq!(r.stats().answered_locally.value(), 1);
    assert_eq!(r.stats().requests.value(), 1);
}

#[tokio::test]
async fn before_the_first_table_every_query_is_servfail() {
    let r = resolver(None);
    let reply = ask(
        &r,
        &query("echo.mesh.test.", RecordType::A, None),
        Transport::Tcp,
    )
    .await;
    assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
    assert_eq!(r.stats().upstream_requests.value(), 0);
}

#[tokio::test]
async fn with_no_upstream_server_a_forward_is_servfail_and_counted() {
    let r = resolver(Some(NameTable::default()));
    let reply = ask(
        &r,
        &query("upstream-only.test.", RecordType::A, None),
        Transport::Udp,
    )
    .await;
    assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
    assert_eq!(r.stats().upstream_requests.value(), 1);
    assert_eq!(r.stats().upstream_failures.value(), 1);
}

#[tokio::test]
async fn garbage_gets_formerr_when_it_has_a_header_and_nothing_otherwise() {
    let r = resolver(Some(NameTable::default()));
    let mut bad = query("x.test.", RecordType::A, None);
    bad.truncate(bad.len() - 3);
    let reply = ask(&r, &bad, Transport::Udp).await;
    assert_eq!(reply.metadata.id, 4242);
    assert_eq!(reply.metadata.response_code, ResponseCode::FormErr);
    assert_eq!(r.answer(&[1, 2, 3], Transport::Udp).await, None);
    // A response sent to us is not answered.
    let mut response = Message::from_vec(&query("x.test.", RecordType::A, None)).unwrap();
    response.metadata.message_type = MessageType::Response;
    assert_eq!(
        r.answer(&response.to_vec().unwrap(), Transport::Udp).await,
        None
    );
}

#[tokio::test]
async fn an_answer_too_big_for_udp_is_truncated_and_whole_over_tcp() {
    let ips: Vec<String> = (0..64).map(|i| format!("240.240.1.{i}")).collect();
    let r = resolver(Some(table("giant.mesh.test", &ips)));
    let udp = ask(
        &r,
        &query("giant.mesh.test.", RecordType::A, None),
        Transport::Udp,
    )
    .await;
    assert!(udp.metadata.truncation);
    assert!(udp.answers.is_empty());
    let edns = ask(
        &r,
        &query("giant.mesh.test.", RecordType::A, Some(4096)),
        Transport::Udp,
    )
    .await;
    assert!(!edns.metadata.truncation);
    assert_eq!(edns.answers.len(), 64);
    let tcp = ask(
        &r,
        &query("giant.mesh.test.", RecordType::A, None),
        Transport::Tcp,
    )
    .await;
    assert!(!tcp.metadata.truncation);
    assert_eq!(tcp.answers.len(), 64);
}

#[tokio::test]
async fn an_updated_table_applies_to_the_next_query_and_a_bad_one_changes_nothing() {
    let r = resolver(Some(table("echo.mesh.test", &["240.240.0.7".into()])));
    r.tables
        .apply(table("echo.mesh.test", &["240.240.0.8".into()]), "2")
        .unwrap();
    let reply = ask(
        &r,
        &query("echo.mesh.test.", RecordType::A, None),
        Transport::Udp,
    )
    .await;
    assert_eq!(
        reply.answers[0].data,
        RData::A("240.240.0.8".parse().unwrap())
    );
    let err = r
        .tables
        .apply(table("echo.mesh.test", &["240.240.0.999".into()]), "3")
        .unwrap_err();
    assert!(err.to_string().contains("240.240.0.999"), "{err}");
    assert_eq!(r.tables.current().unwrap().version, "2");
}
