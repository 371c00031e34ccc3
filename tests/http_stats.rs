//! Envoy's stats for HTTP traffic, checked against Envoy 1.40 itself: shunt and Envoy
//! take the same bootstrap in two pods (the same ADS stream's listeners, routes,
//! clusters and endpoints, and a static HTTP listener and clusters), get the same
//! requests (200s and 404s from the upstream, 503s with no healthy upstream, through an
//! EDS cluster that a CDS update replaces mid-way and through STATIC clusters), and
//! must then show the same cluster, listener and connection manager stats, by Envoy's
//! names. Needs root and Envoy (`$SHUNT_ENVOY_BIN`, or `cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use harness::ads::resources::{http_listener, load_assignment, named, route_config};
use harness::ads::{AdsServer, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::{Value, json};
use support::http_client::HttpClient;
use support::local;
use support::xds::{self, admin_at, eds_cluster, start_shunt, unix_server};

/// The RDS listener (`stat_prefix` `h1`) and the static one (`static_http`).
const RDS_PORT: u16 = 10000;
const STATIC_PORT: u16 = 10001;
/// The EDS cluster `backend`'s endpoint and the STATIC cluster `web`'s.
const BACKEND: u16 = 9001;
const WEB: u16 = 9002;
/// The TLS cluster `secure`'s endpoint.
const SECURE: u16 = 9003;
/// nginx over h2c: cluster `h2`'s endpoint.
const H2: u16 = 9004;
/// Where nothing listens: cluster `refused`'s endpoint.
const REFUSED: u16 = 9099;

/// An HTTP/1.1 server in `pod`: 404 for a path containing `missing`, else 200; keeps
/// connections open. Served from threads of the test.
fn http_backend(pod: &Pod, port: u16) {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(local(port)))
        .expect("entering the pod")
        .expect("binding the backend");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve_http(stream));
        }
    });
}

fn serve_http(stream: impl Read + Write) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        let mut missing = false;
        let mut first = true;
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if first {
                missing = line.contains("missing");
                first = false;
            }
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let (status, body) = if missing {
            ("404 Not Found", "missing")
        } else {
            ("200 OK", "ok")
        };
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let writer = reader.get_mut();
        if writer
            .write_all(answer.as_bytes())
            .and_then(|()| writer.flush())
            .is_err()
        {
            return;
        }
    }
}

/// [`http_backend`] over TLS with the certificate `chain` and its `key` (PEM).
fn https_backend(pod: &Pod, port: u16, chain: &str, key: &str) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain.as_bytes())
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let config = std::sync::Arc::new(config);
    let listener = pod
        .run_in_netns(move || TcpListener::bind(local(port)))
        .expect("entering the pod")
        .expect("binding the backend");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let config = config.clone();
            std::thread::spawn(move || {
                let conn = rustls::ServerConnection::new(config).unwrap();
                serve_http(rustls::StreamOwned::new(conn, stream));
            });
        }
    });
}

/// nginx in `pod` serving h2c on [`H2`] (404 under `/h2/missing`, else 200), its files
/// in `dir`.
fn h2_backend(pod: &Pod, dir: &std::path::Path) -> PodProcess {
    std::fs::create_dir_all(dir).unwrap();
    let d = dir.display();
    let config = format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{H2} http2; location / {{ return 200 \"ok\"; }}\n\
         location /h2/missing {{ return 404 \"missing\"; }} }}\n}}\n"
    );
    std::fs::write(dir.join("nginx.conf"), config).unwrap();
    let nginx = pod
        .command("/usr/sbin/nginx")
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .spawn()
        .expect("start nginx");
    harness::wait_for_port(pod, local(H2), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("nginx on {H2}: {e}\n{}", nginx.stderr_text()));
    nginx
}

fn static_cluster(name: &str, endpoints: &[SocketAddr]) -> Value {
    let lb_endpoints: Vec<Value> = endpoints
        .iter()
        .map(|e| json!({"endpoint": {"address": {"socket_address": {"address": e.ip().to_string(), "port_value": e.port()}}}}))
        .collect();
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}
    })
}

/// The xDS tests' ADS bootstrap, with STATIC clusters `web` and `empty` (no endpoints)
/// and a static HTTP listener on `STATIC_PORT` routing to `web`.
fn bootstrap(socket: &std::path::Path, ca: &str) -> Value {
    let mut bootstrap = xds::bootstrap(socket, false);
    let statics = &mut bootstrap["static_resources"];
    statics["clusters"].as_array_mut().unwrap().extend([
        static_cluster("web", &[local(WEB)]),
        static_cluster("empty", &[]),
        static_cluster("refused", &[local(REFUSED)]),
        // TLS to its endpoint through `transport_socket_matches` (Istio's shape).
        {
            let mut secure = static_cluster("secure", &[local(SECURE)]);
            secure["transport_socket_matches"] = json!([{
                "name": "tls", "match": {},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "sni": "server.test",
                    "common_tls_context": {"validation_context": {"trusted_ca": {"filename": ca}}}
                }}
            }]);
            secure
        },
        // HTTP/2 to its endpoint.
        {
            let mut h2 = static_cluster("h2", &[local(H2)]);
            h2["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            });
            h2
        },
        // Its stats are `cluster.alt_stats.*`.
        {
            let mut alt = static_cluster("alt", &[local(WEB)]);
            alt["alt_stat_name"] = json!("alt_stats");
            alt
        },
    ]);
    let hcm = json!({
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "static_http",
            "codec_type": "AUTO",
            "route_config": {"name": "static", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "web"}}
            ]}]},
            "http_filters": [{
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
            }]
        }
    });
    statics["listeners"] = json!([{
        "name": "static_http",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": STATIC_PORT}},
        "filter_chains": [{"filters": [hcm]}]
    }]);
    bootstrap
}

/// Both proxies ACKed version `version` of `type_url` (two streams).
fn both_acked(server: &AdsServer, type_url: &str, version: &str) -> bool {
    let acked: std::collections::HashSet<_> = server
        .requests()
        .iter()
        .filter(|r| r.type_url == type_url && r.is_ack() && r.version_info == version)
        .map(|r| r.stream)
        .collect();
    acked.len() >= 2
}

fn wait(what: &str, procs: &[&PodProcess], server: &AdsServer, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        for p in procs {
            assert!(
                p.try_wait().is_none(),
                "a proxy exited: {}",
                p.stderr_text()
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting: {what}\n{}\nserver received:\n{}",
            procs
                .iter()
                .map(|p| p.stderr_text())
                .collect::<Vec<_>>()
                .join("\n----\n"),
            xds::describe(&server.requests())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Counters and gauges of `/stats?format=json`, by name.
fn stats(pod: &Pod) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, xds::ADMIN, "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .collect()
}

/// The sample counts of the histograms of `/stats/prometheus` (`<name>_count{labels}`),
/// by the line's name and labels.
fn histogram_counts(pod: &Pod) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, xds::ADMIN, "/stats/prometheus");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            let (metric, _) = name.split_once('{').unwrap_or((name, ""));
            metric.ends_with("_count").then_some(())?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// Stats knowingly not Envoy's once CDS has replaced cluster `backend`, with why.
/// Envoy makes a cluster's response code stats and `upstream_rq_time` lazily in the
/// cluster's own stats scope: when an update replaces the cluster, the old scope goes
/// with the old cluster and those stats start again from zero (its eagerly made stats,
/// `upstream_rq_total` and the rest, carry on). shunt keeps counting all of them under
/// the same names across the update, as Envoy does for its eager stats.
const REPLACED_CLUSTER: &[(&str, &str)] = &[
    (
        "cluster.backend.upstream_rq_2xx",
        "Envoy restarts lazy stats at a cluster update",
    ),
    (
        "cluster.backend.upstream_rq_200",
        "Envoy restarts lazy stats at a cluster update",
    ),
    (
        "cluster.backend.upstream_rq_4xx",
        "Envoy restarts lazy stats at a cluster update",
    ),
    (
        "cluster.backend.upstream_rq_404",
        "Envoy restarts lazy stats at a cluster update",
    ),
    (
        "envoy_cluster_upstream_rq_time_count{envoy_cluster_name=\"backend\"}",
        "Envoy restarts lazy stats at a cluster update",
    ),
];

type Table = Vec<(String, Option<u64>, Option<u64>)>;

/// Each stat of `names` (counters, gauges) and `histograms` (prometheus `_count`
/// lines) in shunt's pod and in Envoy's.
fn table(shunt: &Pod, envoy: &Pod, names: &[String], histograms: &[String]) -> Table {
    let (ours, theirs) = (stats(shunt), stats(envoy));
    let (our_h, their_h) = (histogram_counts(shunt), histogram_counts(envoy));
    let mut table = Vec::new();
    for name in names {
        table.push((
            name.clone(),
            ours.get(name).copied(),
            theirs.get(name).copied(),
        ));
    }
    // Envoy's prometheus output leaves out a histogram never recorded; shunt's shows
    // it with a count of 0.
    for name in histograms {
        let ours = our_h.get(name).copied().filter(|&n| n > 0);
        table.push((name.clone(), ours, their_h.get(name).copied()));
    }
    table
}

fn differing(table: &Table, known: &[(&str, &str)]) -> Vec<String> {
    table
        .iter()
        .filter(|(name, ours, theirs)| ours != theirs && !known.iter().any(|(k, _)| k == name))
        .map(|(name, ours, theirs)| format!("{name}: shunt {ours:?}, envoy {theirs:?}"))
        .collect()
}

/// Waits for the stats to agree (gauges settle as closed connections are seen,
/// Envoy's histograms at its 5 s flush), then fails on those that do not.
fn compare(
    when: &str,
    shunt: &Pod,
    envoy: &Pod,
    names: &[String],
    histograms: &[String],
    known: &[(&str, &str)],
) {
    let deadline = Instant::now() + Duration::from_secs(12);
    let mut now = table(shunt, envoy, names, histograms);
    while !differing(&now, known).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        now = table(shunt, envoy, names, histograms);
    }
    println!("{when}:");
    for (name, ours, theirs) in &now {
        println!("  {name:70} shunt {ours:?} envoy {theirs:?}");
    }
    let differ = differing(&now, known);
    assert!(
        differ.is_empty(),
        "{when}: stats differ from Envoy's:\n{}",
        differ.join("\n")
    );
}

#[test]
fn http_stats_match_envoys_on_the_same_traffic() {
    let (dir, socket, server) = unix_server("httpstats");
    server.set(type_urls::CLUSTER, "c1", vec![eds_cluster("backend", 1)]);
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![named(
            "backend",
            &load_assignment("backend", &[local(BACKEND)]),
        )],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![named("h1", &http_listener("h1", local(RDS_PORT), "routes"))],
    );
    server.set(
        type_urls::ROUTE,
        "r1",
        vec![named(
            "routes",
            &route_config(
                "routes",
                &[
                    ("/web", "web"),
                    ("/none", "empty"),
                    ("/refused", "refused"),
                    ("/alt", "alt"),
                    ("/secure", "secure"),
                    ("/h2", "h2"),
                    ("/", "backend"),
                ],
            ),
        )],
    );
    let config = dir.0.join("bootstrap.json");

    let mut node = Node::new().unwrap();
    let shunt_pod = node.add_pod("s").unwrap();
    let envoy_pod = node.add_pod("e").unwrap();
    let pki = support::pki::Pki::new("httpstats-pki");
    let (chain, key) = pki.server("backend");
    pki.open_to_the_proxy();
    for pod in [&shunt_pod, &envoy_pod] {
        http_backend(pod, BACKEND);
        http_backend(pod, WEB);
        https_backend(pod, SECURE, &chain, &key);
    }
    let _nginx = [&shunt_pod, &envoy_pod]
        .map(|pod| h2_backend(pod, &dir.0.join(format!("nginx-{}", pod.name()))));
    let shunt = start_shunt(
        &shunt_pod,
        &config,
        &bootstrap(&socket, &pki.file("ca.pem")),
        &["--concurrency", "1"],
    );
    let envoy = envoy_pod
        .command(support::envoy::bin())
        .args([
            "--concurrency",
            "1",
            "-l",
            "warning",
            "--use-dynamic-base-id",
            "-c",
        ])
        .arg(&config)
        .spawn()
        .expect("start envoy");
    let procs = [&shunt, &envoy];
    for pod in [&shunt_pod, &envoy_pod] {
        wait("ready", &procs, &server, || {
            admin_at(pod, xds::ADMIN, "/ready").0 == 200
        });
    }
    for (type_url, version) in [
        (type_urls::CLUSTER, "c1"),
        (type_urls::ENDPOINT, "e1"),
        (type_urls::LISTENER, "l1"),
        (type_urls::ROUTE, "r1"),
    ] {
        wait(&format!("both ACK {version}"), &procs, &server, || {
            both_acked(&server, type_url, version)
        });
    }
    // The listener serves once its routes are in: give the last step a moment.
    std::thread::sleep(Duration::from_millis(500));

    let clusters = [
        "backend",
        "web",
        "empty",
        "refused",
        "alt_stats",
        "secure",
        "h2",
    ];
    let cluster_stats = [
        "upstream_rq_total",
        "upstream_rq_completed",
        "upstream_rq_active",
        "upstream_rq_pending_total",
        "upstream_rq_2xx",
        "upstream_rq_200",
        "upstream_rq_4xx",
        "upstream_rq_404",
        "upstream_rq_5xx",
        "upstream_rq_503",
        "upstream_cx_total",
        "upstream_cx_active",
        "upstream_cx_http1_total",
        "upstream_cx_http2_total",
        "upstream_cx_none_healthy",
        "upstream_cx_connect_fail",
        "upstream_rq_pending_failure_eject",
        "membership_total",
        "membership_healthy",
    ];
    let hcm_stats = [
        "downstream_rq_total",
        "downstream_rq_completed",
        "downstream_rq_active",
        "downstream_rq_http1_total",
        "downstream_rq_2xx",
        "downstream_rq_4xx",
        "downstream_rq_5xx",
        "downstream_cx_total",
        "downstream_cx_active",
        "downstream_cx_http1_total",
        "downstream_cx_http1_active",
        "downstream_cx_http2_total",
        "downstream_cx_http2_active",
        "downstream_rq_http2_total",
        "no_route",
        "no_cluster",
    ];
    let mut names = Vec::new();
    for c in clusters {
        names.extend(cluster_stats.iter().map(|s| format!("cluster.{c}.{s}")));
    }
    names.push("cluster.secure.ssl.handshake".to_owned());
    for prefix in ["h1", "static_http"] {
        names.extend(hcm_stats.iter().map(|s| format!("http.{prefix}.{s}")));
    }
    for (addr, prefix) in [
        ("127.0.0.1_10000", "h1"),
        ("127.0.0.1_10001", "static_http"),
    ] {
        for s in ["downstream_cx_total", "downstream_cx_active"] {
            names.push(format!("listener.{addr}.{s}"));
        }
        for s in [
            "downstream_rq_2xx",
            "downstream_rq_4xx",
            "downstream_rq_5xx",
            "downstream_rq_completed",
        ] {
            names.push(format!("listener.{addr}.http.{prefix}.{s}"));
        }
    }
    let histograms: Vec<String> = clusters
        .iter()
        .map(|c| format!("envoy_cluster_upstream_rq_time_count{{envoy_cluster_name=\"{c}\"}}"))
        .collect();

    // The same traffic through each proxy.
    let traffic = |pod: &Pod, phase: u8| {
        let mut expect = Vec::new();
        let mut got = Vec::new();
        if phase == 1 {
            let mut rds = HttpClient::connect(pod, RDS_PORT);
            for (path, status, times) in [
                ("/eds/ok", 200, 10),
                ("/eds/missing", 404, 5),
                ("/web/ok", 200, 5),
                ("/web/missing", 404, 3),
                ("/none", 503, 4),
                ("/refused", 503, 2),
                ("/alt/ok", 200, 3),
                ("/alt/missing", 404, 1),
                ("/secure/ok", 200, 3),
                ("/secure/missing", 404, 2),
                ("/h2/ok", 200, 4),
                ("/h2/missing", 404, 1),
            ] {
                for _ in 0..times {
                    expect.push(status);
                    got.push(rds.get(path).0);
                }
            }
            let mut fixed = HttpClient::connect(pod, STATIC_PORT);
            for (path, status, times) in [("/ok", 200, 6), ("/missing", 404, 2)] {
                for _ in 0..times {
                    expect.push(status);
                    got.push(fixed.get(path).0);
                }
            }
            // HTTP/2 downstream: one connection, three concurrent streams. (Not curl:
            // Debian's curl 7.88.1 fails a second request on a reused prior-knowledge
            // HTTP/2 connection, "Error in the HTTP2 framing layer", against Envoy too.)
            let url = |path: &str| format!("http://127.0.0.1:{RDS_PORT}{path}");
            let out = pod
                .command("nghttp")
                .arg("-v")
                .args([url("/eds/ok1"), url("/eds/ok2"), url("/eds/missing")])
                .output()
                .expect("run nghttp");
            let text = String::from_utf8_lossy(&out.stdout);
            let mut codes: Vec<u16> = text
                .lines()
                .filter_map(|l| l.split(":status: ").nth(1)?.trim().parse().ok())
                .collect();
            codes.sort_unstable();
            expect.extend([200, 200, 404]);
            got.extend(codes);
            // Two more downstream connections, one request each.
            for _ in 0..2 {
                expect.push(200);
                got.push(HttpClient::connect(pod, RDS_PORT).get("/eds/ok").0);
            }
        } else {
            let mut rds = HttpClient::connect(pod, RDS_PORT);
            for (path, status, times) in [("/eds/ok", 200, 7), ("/eds/missing", 404, 1)] {
                for _ in 0..times {
                    expect.push(status);
                    got.push(rds.get(path).0);
                }
            }
        }
        assert_eq!(got, expect, "through {}", pod.name());
    };
    for pod in [&shunt_pod, &envoy_pod] {
        traffic(pod, 1);
    }
    compare(
        "before the update",
        &shunt_pod,
        &envoy_pod,
        &names,
        &histograms,
        &[],
    );
    // CDS replaces cluster `backend` (a new connect timeout); its stats carry on.
    server.set(type_urls::CLUSTER, "c2", vec![eds_cluster("backend", 2)]);
    wait("both ACK c2", &procs, &server, || {
        both_acked(&server, type_urls::CLUSTER, "c2")
    });
    std::thread::sleep(Duration::from_millis(500));
    for pod in [&shunt_pod, &envoy_pod] {
        traffic(pod, 2);
    }

    compare(
        "after the update",
        &shunt_pod,
        &envoy_pod,
        &names,
        &histograms,
        REPLACED_CLUSTER,
    );
    // Nothing above was vacuous: the traffic was counted.
    let ours = stats(&shunt_pod);
    assert_eq!(ours.get("cluster.backend.upstream_rq_total"), Some(&28));
    drop(envoy);
    drop(shunt);
}
