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

/// A resolver that never answers, and a DNS proxy forwarding to it: a burst of queries
/// from one client takes one upstream socket, at most the client's bound in flight, and
/// every query over the bound is answered SERVFAIL at once and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_to_a_silent_resolver_is_bounded_and_shares_one_socket() {
    use std::collections::HashSet;
    // The silent resolver: it records where each query came from.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let upstreams = Upstreams {
        servers: vec![silent.local_addr().unwrap()],
        timeout: Duration::from_secs(2),
        netns: None,
    };
    let tables = Arc::new(Tables::new(Scope::new(
        "default",
        "default.svc.cluster.local",
        vec![],
    )));
    tables.apply(NameTable::default(), "1").unwrap();
    let resolver = Arc::new(Resolver::new(
        tables,
        upstreams,
        16,
        DnsStats::new(&StatsStore::new()),
    ));
    let sockets = server::bind(&["127.0.0.1:0".parse().unwrap()], false).unwrap();
    let listen = sockets.udp[0].local_addr().unwrap();
    let tasks = server::serve(sockets, resolver.clone()).unwrap();
    let client = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    client.connect(listen).await.unwrap();
    const QUERIES: u16 = 600;
    // Every query is answered: over the bound at once, the rest at the timeout. Read as
    // they come, so that no answer is lost to a full receive buffer.
    let receiver = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut answered = HashSet::new();
            let mut buf = vec![0u8; 4096];
            while answered.len() < usize::from(QUERIES) {
                let len = tokio::time::timeout(Duration::from_secs(30), client.recv(&mut buf))
                    .await
                    .expect("every query answered")
                    .unwrap();
                let reply = Message::from_vec(&buf[..len]).unwrap();
                assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
                answered.insert(reply.metadata.id);
            }
            answered
        })
    };
    // In batches, so that the proxy's own receive buffer takes them all.
    for batch in (0..QUERIES).collect::<Vec<_>>().chunks(50) {
        for &id in batch {
            let mut m = Message::new(id, MessageType::Query, OpCode::Query);
            m.add_query(Query::query(
                Name::from_ascii(format!("n{id}.example.")).unwrap(),
                RecordType::A,
            ));
            client.send(&m.to_vec().unwrap()).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(receiver.await.unwrap().len(), usize::from(QUERIES));
    let shed = resolver.stats().upstream_shed.value();
    let forwarded = resolver.stats().upstream_requests.value();
    assert_eq!(
        forwarded,
        in_flight::MAX_IN_FLIGHT_PER_CLIENT as u64,
        "forwarded"
    );
    assert_eq!(shed, u64::from(QUERIES) - forwarded, "shed");
    // What reached the resolver came from one socket.
    let mut buf = vec![0u8; 4096];
    let mut ports = HashSet::new();
    let mut received = 0;
    while let Ok(Ok((_, from))) =
        tokio::time::timeout(Duration::from_millis(200), silent.recv_from(&mut buf)).await
    {
        ports.insert(from.port());
        received += 1;
    }
    assert_eq!(received, forwarded, "queries the resolver saw");
    assert_eq!(ports.len(), 1, "source ports of the forwarded queries");
    assert_eq!(resolver.upstream_sockets(), 1);
    assert_eq!(resolver.in_flight(), 0, "every place came back");
    for task in tasks {
        task.abort();
    }
}
