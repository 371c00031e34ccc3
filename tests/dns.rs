//! The DNS proxy end to end: `shunt proxy` with DNS on in a pod, its name table pushed
//! over ADS from the test server (once state of the world, once Delta), a real dnsmasq
//! as the pod's resolver in a pod of its own, and `dig` asking 127.0.0.1:15053 and
//! [::1]:15053 over UDP and TCP.
//!
//! Each run checks: the mesh's names (Kubernetes short and long forms, a wildcard
//! ServiceEntry, auto-allocated addresses, AAAA, NODATA) are answered locally and
//! authoritatively; other names are forwarded to dnsmasq, and the second time served
//! from the cache (dnsmasq logs one query); an answer dnsmasq truncates is fetched again
//! over TCP; a pushed table applies to the next query; a bad table is NACKed and the
//! last good one keeps answering; the counters move on `/stats`; the table is in
//! `/config_dump`. Needs root, dig and dnsmasq.

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use harness::ads::AdsServer;
use harness::{Node, Pod, PodProcess};
use support::nds::{NameInfo, NameTable, push, service_entry};
use support::xds::{
    self, bootstrap, config_dump_at, dump_section, eventually, start_shunt, stat_at, unix_server,
};

const NDS: &str = support::nds::TYPE_URL;
const CDS: &str = harness::ads::type_urls::CLUSTER;
const LDS: &str = harness::ads::type_urls::LISTENER;
/// TXT records for `big.test`: more than dnsmasq puts in 512 bytes.
const BIG_TXT_RECORDS: usize = 12;

fn service(ips: &[&str], ns: &str, name: &str) -> NameInfo {
    NameInfo {
        ips: ips.iter().map(|s| s.to_string()).collect(),
        registry: "Kubernetes".into(),
        shortname: name.into(),
        namespace: ns.into(),
        ..Default::default()
    }
}

/// The mesh as istiod would describe it to a pod in `default`, `productpage` at `ip`.
fn mesh(productpage_ip: &str) -> NameTable {
    let mut table = HashMap::new();
    table.insert(
        "productpage.default.svc.cluster.local".into(),
        service(&[productpage_ip], "default", "productpage"),
    );
    table.insert(
        "reviews.other.svc.cluster.local".into(),
        service(&["10.96.0.21"], "other", "reviews"),
    );
    table.insert("*.wild.example".into(), service_entry(&["240.240.0.5"]));
    // A ServiceEntry with resolution NONE and no address: auto-allocated both families.
    table.insert(
        "tcp-echo.external.test".into(),
        service_entry(&["240.240.0.1", "2001:2::f0f0:1"]),
    );
    table.insert("v4only.mesh.test".into(), service_entry(&["10.96.0.30"]));
    NameTable { table }
}

/// What dig printed: the status, the header flags and the answer records.
#[derive(Debug)]
struct Dig {
    status: String,
    flags: Vec<String>,
    /// `(name, type, value)`.
    answers: Vec<(String, String, String)>,
}

impl Dig {
    fn values(&self, rtype: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .answers
            .iter()
            .filter(|a| a.1 == rtype)
            .map(|a| a.2.clone())
            .collect();
        v.sort();
        v
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// Runs `dig @server -p 15053 NAME TYPE EXTRA...` in `pod`.
fn dig(pod: &Pod, server: IpAddr, name: &str, qtype: &str, extra: &[&str]) -> Dig {
    let out = pod
        .command("dig")
        .arg(format!("@{server}"))
        .args([
            "-p",
            "15053",
            "+tries=1",
            "+time=3",
            "+noall",
            "+comments",
            "+answer",
        ])
        .args(extra)
        .args([name, qtype])
        .timeout(Duration::from_secs(20))
        .output()
        .expect("run dig");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text
        .split("status: ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("dig {name} {qtype} {extra:?}: no status in\n{text}"))
        .to_owned();
    let flags = text
        .split(";; flags: ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let answers = text
        .lines()
        .filter(|l| !l.starts_with(';') && !l.trim().is_empty())
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.len() >= 5).then(|| {
                (
                    fields[0].to_owned(),
                    fields[3].to_owned(),
                    fields[4..].join(" "),
                )
            })
        })
        .collect();
    Dig {
        status,
        flags,
        answers,
    }
}

/// dnsmasq in `pod`, the pod's only resolver: `upstream-only.test` (and below it) is
/// 192.0.2.10 for 300 s, `big.test` has more TXT than 512 bytes hold, anything else is
/// NXDOMAIN. It logs every query it gets.
fn start_dnsmasq(pod: &Pod) -> PodProcess {
    let mut cmd = pod.command("dnsmasq").args([
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--no-poll",
        "--bind-interfaces",
        "--port=53",
        "--log-queries",
        "--log-facility=-",
        "--pid-file=",
        "--local=/#/",
        "--local-ttl=300",
        "--edns-packet-max=512",
        "--address=/upstream-only.test/192.0.2.10",
    ]);
    cmd = cmd.arg(format!("--listen-address={}", pod.ipv4()));
    for i in 0..BIG_TXT_RECORDS {
        cmd = cmd.arg(format!(
            "--txt-record=big.test,record-{i}-{}",
            "x".repeat(60)
        ));
    }
    let dnsmasq = cmd.spawn().expect("start dnsmasq");
    dnsmasq
        .wait_for_stderr(|e| e.contains("started, version"), Duration::from_secs(10))
        .expect("dnsmasq starts");
    dnsmasq
}

/// How many queries for `name` (any type) dnsmasq logged.
fn upstream_queries(dnsmasq: &PodProcess, name: &str) -> usize {
    dnsmasq
        .stderr_text()
        .lines()
        .filter(|l| l.contains("query[") && l.contains(&format!("] {name} from")))
        .count()
}

fn stat(pod: &Pod, name: &str) -> u64 {
    stat_at(pod, xds::ADMIN, name).unwrap_or(0)
}

fn nds_acked(server: &AdsServer, version: &str, delta: bool) -> bool {
    xds::acked(server, NDS, version, delta, None)
}

fn answers_the_mesh_and_forwards_the_rest(delta: bool) {
    let (dir, socket, server) = unix_server(if delta { "dns-delta" } else { "dns-sotw" });
    server.set(CDS, "c1", vec![]);
    server.set(LDS, "l1", vec![]);
    push(&server, "n1", &mesh("10.96.0.20"));

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let resolver = node.add_pod("resolver").unwrap();
    let dnsmasq = start_dnsmasq(&resolver);
    let resolv_conf = dir.0.join("resolv.conf");
    std::fs::write(
        &resolv_conf,
        format!(
            "nameserver {}\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n",
            resolver.ipv4()
        ),
    )
    .unwrap();
    let mut config = bootstrap(&socket, delta);
    // Delta: DNS_CAPTURE in the node metadata, as pilot-agent writes ISTIO_META_*;
    // state of the world: the environment variable.
    if delta {
        config["node"]["metadata"]["DNS_CAPTURE"] = "true".into();
    }
    let path = dir.0.join("bootstrap.json");
    let resolv = resolv_conf.display().to_string();
    let proxy = if delta {
        start_shunt(&pod, &path, &config, &["--dns-resolv-conf", &resolv])
    } else {
        std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
        pod.command(harness::shunt_bin())
            .env("ISTIO_META_DNS_CAPTURE", "true")
            .args(["proxy", "--dns-resolv-conf", &resolv, "-c"])
            .arg(&path)
            .spawn()
            .expect("start shunt proxy")
    };

    eventually("name table n1 ACKed", &proxy, &server, || {
        nds_acked(&server, "n1", delta)
    });
    let nds = server
        .requests()
        .into_iter()
        .find(|r| r.type_url == NDS)
        .unwrap();
    assert!(
        nds.resource_names.is_empty(),
        "the name table is asked whole"
    );
    assert_eq!(nds.delta, delta);

    let v4: IpAddr = "127.0.0.1".parse().unwrap();
    let v6: IpAddr = "::1".parse().unwrap();
    for server_ip in [v4, v6] {
        for transport in [&[][..], &["+tcp"][..]] {
            let ask = |name: &str, qtype: &str| dig(&pod, server_ip, name, qtype, transport);
            let at = format!("at {server_ip} {transport:?}");
            // A Kubernetes service in the pod's namespace, in every form.
            for name in [
                "productpage",
                "productpage.default",
                "productpage.default.svc",
                "productpage.default.svc.cluster.local",
            ] {
                let d = ask(name, "A");
                assert_eq!(d.status, "NOERROR", "{name} {at}");
                assert!(d.has_flag("aa"), "{name} is answered authoritatively {at}");
                assert_eq!(d.values("A"), ["10.96.0.20"], "{name} {at}: {d:?}");
            }
            // The first search domain's form: a CNAME to the name, then its address.
            let d = ask("productpage.default.default.svc.cluster.local", "A");
            assert_eq!(d.values("CNAME"), ["productpage.default."], "{at}: {d:?}");
            assert_eq!(d.values("A"), ["10.96.0.20"], "{at}");
            // Another namespace: `reviews.other` is ours, a bare `reviews` is not.
            assert_eq!(
                ask("reviews.other", "A").values("A"),
                ["10.96.0.21"],
                "{at}"
            );
            assert_eq!(ask("reviews", "A").status, "NXDOMAIN", "{at}");
            // A wildcard ServiceEntry answers for any name under it.
            let d = ask("api.wild.example", "A");
            assert_eq!(d.answers[0].0, "api.wild.example.", "{at}");
            assert_eq!(d.values("A"), ["240.240.0.5"], "{at}");
            // Auto-allocated addresses, both families.
            assert_eq!(
                ask("tcp-echo.external.test", "A").values("A"),
                ["240.240.0.1"]
            );
            assert_eq!(
                ask("tcp-echo.external.test", "AAAA").values("AAAA"),
                ["2001:2::f0f0:1"],
                "{at}"
            );
            // In the table without an AAAA: NODATA from us, not forwarded.
            let d = ask("v4only.mesh.test", "AAAA");
            assert_eq!(d.status, "NOERROR", "{at}");
            assert!(d.has_flag("aa") && d.answers.is_empty(), "{at}: {d:?}");
            // A search-domain artefact of a FQDN is not in the table: dnsmasq says NXDOMAIN.
            let d = ask("productpage.default.svc.cluster.local.cluster.local", "A");
            assert_eq!(d.status, "NXDOMAIN", "{at}");
        }
    }
    assert_eq!(
        upstream_queries(&dnsmasq, "v4only.mesh.test")
            + upstream_queries(&dnsmasq, "productpage.default.svc.cluster.local"),
        0,
        "mesh names never reach the upstream"
    );

    // Forwarded, then served from the cache: dnsmasq sees one query.
    let hits = stat(&pod, "dns.cache_hits_total");
    for transport in [&[][..], &["+tcp"][..]] {
        let d = dig(&pod, v4, "upstream-only.test", "A", transport);
        assert_eq!(d.status, "NOERROR");
        assert_eq!(d.values("A"), ["192.0.2.10"]);
    }
    let d = dig(&pod, v6, "upstream-only.test", "A", &[]);
    assert_eq!(d.values("A"), ["192.0.2.10"]);
    assert_eq!(upstream_queries(&dnsmasq, "upstream-only.test"), 1);
    assert_eq!(stat(&pod, "dns.cache_hits_total"), hits + 2);
    // A TCP client is forwarded over TCP.
    let d = dig(&pod, v4, "tcp.upstream-only.test", "A", &["+tcp"]);
    assert_eq!(d.values("A"), ["192.0.2.10"]);

    // dnsmasq truncates big.test at 512 bytes: asked again over TCP, the client gets it
    // all (it offered 4096 bytes over UDP).
    let retries = stat(&pod, "dns.upstream_tcp_retries_total");
    let d = dig(&pod, v4, "big.test", "TXT", &["+bufsize=4096", "+ignore"]);
    assert!(!d.has_flag("tc"), "{d:?}");
    assert_eq!(d.values("TXT").len(), BIG_TXT_RECORDS, "{d:?}");
    assert_eq!(stat(&pod, "dns.upstream_tcp_retries_total"), retries + 1);
    // Without EDNS the client gets TC from us and its own TCP retry gets it all.
    let d = dig(&pod, v4, "big.test", "TXT", &["+noedns", "+ignore"]);
    assert!(d.has_flag("tc"), "{d:?}");
    let d = dig(&pod, v4, "big.test", "TXT", &["+noedns"]);
    assert_eq!(d.values("TXT").len(), BIG_TXT_RECORDS, "{d:?}");

    // An updated table applies to the next query.
    push(&server, "n2", &mesh("10.96.0.99"));
    eventually("name table n2 ACKed", &proxy, &server, || {
        nds_acked(&server, "n2", delta)
    });
    assert_eq!(
        dig(&pod, v4, "productpage", "A", &[]).values("A"),
        ["10.96.0.99"]
    );

    // A bad table is NACKed, naming the bad address; n2 keeps answering.
    let mut bad = mesh("10.96.0.20");
    bad.table
        .insert("broken.mesh.test".into(), service_entry(&["not-an-ip"]));
    push(&server, "n3", &bad);
    let nack = server
        .wait_for(Duration::from_secs(20), |r| {
            r.type_url == NDS && r.error_detail.is_some()
        })
        .expect("the bad table is NACKed");
    let (_, message) = nack.error_detail.unwrap();
    assert!(
        message.contains(r#"NameTable.table["broken.mesh.test"].ips[0]: "not-an-ip""#),
        "{message}"
    );
    assert_eq!(
        dig(&pod, v4, "productpage", "A", &[]).values("A"),
        ["10.96.0.99"]
    );

    // Counters on /stats, the table in /config_dump.
    assert!(stat(&pod, "dns.requests_total") >= 40);
    assert!(stat(&pod, "dns.answered_locally_total") >= 30);
    assert!(stat(&pod, "dns.upstream_requests_total") >= 4);
    assert!(stat(&pod, "dns.nxdomain_total") >= 8);
    assert_eq!(stat(&pod, "dns.upstream_failures_total"), 0);
    assert_eq!(stat(&pod, "nds.update_rejected"), 1);
    let (status, prometheus) = xds::admin_at(&pod, xds::ADMIN, "/stats/prometheus");
    assert_eq!(status, 200);
    assert!(
        prometheus.contains("envoy_dns_answered_locally_total"),
        "{prometheus}"
    );
    let dump = config_dump_at(&pod, xds::ADMIN);
    let table = dump_section(&dump, "istio.networking.nds.v1.NameTable");
    assert_eq!(
        table["table"]["productpage.default.svc.cluster.local"]["ips"],
        serde_json::json!(["10.96.0.99"])
    );
    assert_eq!(
        table["table"]["productpage.default.svc.cluster.local"]["shortname"],
        "productpage"
    );
    drop(proxy);
    drop(dnsmasq);
}

#[test]
fn state_of_the_world_name_table_answers_the_mesh_and_forwards_the_rest() {
    answers_the_mesh_and_forwards_the_rest(false);
}

#[test]
fn delta_name_table_answers_the_mesh_and_forwards_the_rest() {
    answers_the_mesh_and_forwards_the_rest(true);
}

/// Without a bootstrap (the passthrough proxy) there is no xDS and so no name table:
/// DNS is forwarded, from the proxy's own uid after it dropped root.
#[test]
fn the_passthrough_proxy_with_dns_forwards_every_query() {
    let dir = support::TempDir::new("dns-passthrough");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let resolver = node.add_pod("resolver").unwrap();
    let dnsmasq = start_dnsmasq(&resolver);
    let resolv_conf = dir.0.join("resolv.conf");
    std::fs::write(&resolv_conf, format!("nameserver {}\n", resolver.ipv4())).unwrap();
    let proxy = pod
        .command(harness::shunt_bin())
        .args([
            "proxy",
            "--dns-listen",
            "127.0.0.1:15053",
            "--dns-resolv-conf",
        ])
        .arg(&resolv_conf)
        .spawn()
        .expect("start shunt proxy");
    let v4: IpAddr = "127.0.0.1".parse().unwrap();
    // Its sockets are bound once it runs as 1337: the TCP one says they are.
    harness::wait_for_port(
        &pod,
        std::net::SocketAddr::new(v4, 15053),
        Duration::from_secs(30),
    )
    .unwrap_or_else(|e| panic!("{e:#}\n{}", proxy.stderr_text()));
    support::wait_until(
        "the DNS proxy answers",
        &proxy,
        || dig(&pod, v4, "upstream-only.test", "A", &[]).values("A") == ["192.0.2.10"],
        String::new,
    );
    assert_eq!(dig(&pod, v4, "productpage", "A", &[]).status, "NXDOMAIN");
    assert_eq!(upstream_queries(&dnsmasq, "productpage"), 1);
}

#[test]
fn a_resolv_conf_that_cannot_be_read_stops_the_start_naming_it() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("app").unwrap();
    let out = pod
        .command(harness::shunt_bin())
        .args([
            "proxy",
            "--dns-listen",
            "127.0.0.1:15053",
            "--dns-resolv-conf",
            "/nonexistent/resolv.conf",
        ])
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("reading /nonexistent/resolv.conf"),
        "{stderr}"
    );
}
