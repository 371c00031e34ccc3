//! RBAC and path normalization next to real Envoy 1.40: the same static bootstrap
//! (Istio-style DENY filter before an ALLOW filter with shadow rules, `normalize_path`,
//! routes answered directly so the body says which route a normalized path took) is
//! served by shunt and by Envoy in one pod, a table of requests goes to both from
//! another pod, and statuses, bodies and the RBAC counters must be equal. Needs root.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use harness::{Node, shunt_bin, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::socket_address;
use support::pki::Pki;
use support::xds::stat_at;

fn rbac_filter(name: &str, config: Value) -> Value {
    let mut typed = config;
    typed["@type"] = json!("type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC");
    json!({"name": name, "typed_config": typed})
}

fn header(name: &str, exact: &str) -> Value {
    json!({"header": {"name": name, "string_match": {"exact": exact}}})
}

fn bootstrap(port: u16, admin: u16) -> Value {
    let deny = rbac_filter(
        "envoy.filters.http.rbac",
        json!({"rules": {"action": "DENY", "policies": {
            "ns[default]-policy[deny-admin]-rule[0]": {
                "permissions": [{"and_rules": {"rules": [
                    {"or_rules": {"rules": [{"url_path": {"path": {"prefix": "/admin"}}}]}}
                ]}}],
                "principals": [{"and_ids": {"ids": [{"any": true}]}}]
            },
            "ns[default]-policy[deny-header]-rule[0]": {
                "permissions": [{"any": true}],
                "principals": [{"header": {"name": "x-evil", "present_match": true}}]
            }
        }}}),
    );
    let allow = rbac_filter(
        "envoy.filters.http.rbac",
        json!({
            "rules": {"policies": {
                "ns[default]-policy[allow-get]-rule[0]": {
                    "permissions": [{"and_rules": {"rules": [
                        {"or_rules": {"rules": [header(":method", "GET"), header(":method", "HEAD")]}},
                        {"or_rules": {"rules": [
                            {"url_path": {"path": {"prefix": "/public"}}},
                            {"url_path": {"path": {"exact": "/b"}}},
                            {"url_path": {"path": {"exact": "/Case", "ignore_case": true}}}
                        ]}}
                    ]}}],
                    "principals": [{"any": true}]
                },
                "ns[default]-policy[allow-post-with-token]-rule[0]": {
                    "permissions": [{"and_rules": {"rules": [
                        header(":method", "POST"),
                        {"header": {"name": ":authority", "string_match": {"prefix": "svc", "ignore_case": true}}}
                    ]}}],
                    "principals": [{"header": {"name": "x-token", "string_match": {"exact": "secret"}}}]
                }
            }},
            "shadow_rules": {"action": "DENY", "policies": {"shadow-deny-b": {
                "permissions": [{"url_path": {"path": {"exact": "/b"}}}],
                "principals": [{"any": true}]
            }}},
            "shadow_rules_stat_prefix": "istio_dry_run_allow_"
        }),
    );
    let direct = |body: &str| json!({"status": 200, "body": {"inline_string": body}});
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {"listeners": [{
            "name": "http",
            "address": socket_address("0.0.0.0", port),
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "inbound_0.0.0.0_80",
                    "normalize_path": true,
                    "route_config": {"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                        {"match": {"path": "/b"}, "direct_response": direct("route b")},
                        {"match": {"prefix": "/public/"}, "direct_response": direct("route public")},
                        {"match": {"prefix": "/"}, "direct_response": direct("route default")}
                    ]}]},
                    "http_filters": [deny, allow, {
                        "name": "envoy.filters.http.router",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                    }]
                }
            }]}]
        }]}
    })
}

#[test]
fn http_rbac_and_path_normalization_match_envoy() {
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let client = node.add_pod("client").expect("pod client");
    let dir = TempDir::new("rbac");
    let (shunt_port, shunt_admin, envoy_port, envoy_admin) = (10000, 15000, 10100, 15100);
    let shunt_config = dir.0.join("shunt.json");
    let envoy_config = dir.0.join("envoy.json");
    std::fs::write(
        &shunt_config,
        bootstrap(shunt_port, shunt_admin).to_string(),
    )
    .unwrap();
    std::fs::write(
        &envoy_config,
        bootstrap(envoy_port, envoy_admin).to_string(),
    )
    .unwrap();
    let shunt = proxy
        .command(shunt_bin())
        .args(["proxy", "--concurrency", "1", "-c"])
        .arg(&shunt_config)
        .spawn()
        .expect("start shunt");
    let envoy = proxy
        .command(support::envoy::bin())
        .args([
            "--concurrency",
            "1",
            "--use-dynamic-base-id",
            "-l",
            "warning",
            "-c",
        ])
        .arg(&envoy_config)
        .spawn()
        .expect("start envoy");
    for port in [shunt_port, envoy_port] {
        wait_for_port(
            &proxy,
            SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(30),
        )
        .unwrap_or_else(|e| {
            panic!(
                "port {port}: {e}\nshunt: {}\nenvoy: {}",
                shunt.stderr_text(),
                envoy.stderr_text()
            )
        });
    }
    // (method, path, extra curl args)
    let requests: &[(&str, &str, &[&str])] = &[
        ("GET", "/public/x", &[]),
        ("GET", "/public", &[]),
        ("GET", "/private", &[]),
        ("GET", "/b", &[]),
        ("GET", "/b?x=1", &[]),
        ("GET", "/b/", &[]),
        ("GET", "/B", &[]),
        ("GET", "/case", &[]),
        ("GET", "/CASE?q", &[]),
        ("POST", "/public/x", &[]),
        ("HEAD", "/public/x", &[]),
        ("GET", "/admin/x", &[]),
        ("GET", "/public/../admin", &[]),
        ("GET", "/public/%2e%2e/admin", &[]),
        ("GET", "/x/../public/y", &[]),
        ("GET", "/public/./y", &[]),
        ("GET", "/public//y", &[]),
        ("GET", "/%70ublic/y", &[]),
        ("GET", "/public%2Fy", &[]),
        ("GET", "/public/x", &["-H", "x-evil: 1"]),
        (
            "POST",
            "/anything",
            &["-H", "x-token: secret", "-H", "host: svc.ns"],
        ),
        (
            "POST",
            "/anything",
            &["-H", "x-token: secret", "-H", "host: SVC.ns"],
        ),
        (
            "POST",
            "/anything",
            &["-H", "x-token: wrong", "-H", "host: svc.ns"],
        ),
        (
            "POST",
            "/anything",
            &["-H", "x-token: secret", "-H", "host: other"],
        ),
        ("DELETE", "/b", &[]),
        ("GET", "/admin?/public", &[]),
    ];
    let ask = |port: u16, method: &str, path: &str, extra: &[&str]| -> (u16, String) {
        let url = format!("http://{}:{port}{path}", proxy.ipv4());
        let mut args: Vec<&str> = vec![
            "-s",
            "-S",
            "--path-as-is",
            "--max-time",
            "10",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
        ];
        if method == "HEAD" {
            args.push("-I");
        } else {
            args.extend(["-X", method]);
        }
        args.extend(extra);
        let out = client
            .command("curl")
            .args(args)
            .arg(&url)
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let body = if method == "HEAD" {
            String::new()
        } else {
            body.to_owned()
        };
        (code.trim().parse().unwrap_or(0), body)
    };
    let mut mismatches = Vec::new();
    let mut denied = 0;
    for (method, path, extra) in requests {
        let from_shunt = ask(shunt_port, method, path, extra);
        let from_envoy = ask(envoy_port, method, path, extra);
        if from_envoy.0 == 403 {
            denied += 1;
        }
        if from_shunt != from_envoy {
            mismatches.push(format!(
                "{method} {path} {extra:?}: shunt {from_shunt:?}, envoy {from_envoy:?}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(denied >= 5, "the table must exercise denials: {denied}");
    for stat in [
        "http.inbound_0.0.0.0_80.rbac.shadow_allowed",
        "http.inbound_0.0.0.0_80.rbac.allowed",
        "http.inbound_0.0.0.0_80.rbac.denied",
        "http.inbound_0.0.0.0_80.rbac.istio_dry_run_allow_.shadow_allowed",
        "http.inbound_0.0.0.0_80.rbac.istio_dry_run_allow_.shadow_denied",
    ] {
        let envoy_value = stat_at(&proxy, &format!("127.0.0.1:{envoy_admin}"), stat);
        let shunt_value = stat_at(&proxy, &format!("127.0.0.1:{shunt_admin}"), stat);
        assert!(
            envoy_value.is_some(),
            "Envoy has no {stat}: {}",
            support::xds::admin_at(
                &proxy,
                &format!("127.0.0.1:{envoy_admin}"),
                "/stats?filter=rbac"
            )
            .1
        );
        assert_eq!(shunt_value, envoy_value, "{stat}");
    }
}

const SLEEP: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const OTHER: &str = "spiffe://cluster.local/ns/test/sa/other";

fn authenticated(matcher: Value) -> Value {
    json!({"authenticated": {"principal_name": matcher}})
}

/// mTLS as Istio's inbound chains: the server certificate, client certificates from the
/// CA required.
fn downstream_mtls(pki: &Pki) -> Value {
    json!({"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "require_client_certificate": true,
        "common_tls_context": {
            "tls_certificates": [{"certificate_chain": {"filename": pki.file("server.pem")},
                                  "private_key": {"filename": pki.file("server.key")}}],
            "validation_context": {"trusted_ca": {"filename": pki.file("ca.pem")}}
        }
    }})
}

fn network_rbac(stat_prefix: &str, rules: Value) -> Value {
    json!({"name": "envoy.filters.network.rbac", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC",
        "stat_prefix": stat_prefix, "rules": rules}})
}

/// Two mTLS listeners with RBAC on the peer's identity (`authenticated.principal_name`
/// exact / prefix / regex, and the subject of a certificate without SANs), `source_ip`,
/// `destination_port` and `requested_server_name`: HTTP on `http`, TCP to the echo
/// server on `tcp`.
fn mtls_bootstrap(pki: &Pki, client: std::net::Ipv4Addr, ports: MtlsPorts) -> Value {
    let MtlsPorts { http, tcp, admin } = ports;
    let client_ip = json!({"source_ip": {"address_prefix": client.to_string(), "prefix_len": 32}});
    let deny = rbac_filter(
        "envoy.filters.http.rbac",
        json!({"rules": {"action": "DENY", "policies": {"deny-test-admin": {
            "permissions": [{"url_path": {"path": {"prefix": "/admin"}}}],
            "principals": [authenticated(json!({"safe_regex": {"regex": ".*/ns/test/.*"}}))]
        }}}}),
    );
    let allow = rbac_filter(
        "envoy.filters.http.rbac",
        json!({
            "rules": {"policies": {
                "sleep-get": {
                    "permissions": [header(":method", "GET")],
                    "principals": [authenticated(json!({"exact": SLEEP}))]
                },
                "test-ns-public": {
                    "permissions": [{"url_path": {"path": {"prefix": "/public"}}}],
                    "principals": [authenticated(json!({"prefix": "spiffe://cluster.local/ns/test/"}))]
                },
                "sni-and-port": {
                    "permissions": [{"and_rules": {"rules": [
                        {"destination_port": http},
                        {"requested_server_name": {"exact": "special.test"}}
                    ]}}],
                    "principals": [{"and_ids": {"ids": [
                        client_ip.clone(),
                        authenticated(json!({"safe_regex": {"regex": ".*/sa/other"}}))
                    ]}}]
                },
                "subject-only": {
                    "permissions": [{"any": true}],
                    "principals": [authenticated(json!({"exact": "CN=nosan"}))]
                },
                "elsewhere": {
                    "permissions": [{"any": true}],
                    "principals": [{"source_ip": {"address_prefix": "10.254.0.0", "prefix_len": 16}}]
                }
            }},
            "shadow_rules": {"action": "DENY", "policies": {"shadow-sleep-public": {
                "permissions": [{"url_path": {"path": {"prefix": "/public"}}}],
                "principals": [authenticated(json!({"exact": SLEEP}))]
            }}},
            "shadow_rules_stat_prefix": "istio_dry_run_allow_"
        }),
    );
    let tcp_deny = network_rbac(
        "tcp_deny.",
        json!({"action": "DENY", "policies": {"deny-other-blocked": {
            "permissions": [{"requested_server_name": {"exact": "blocked.test"}}],
            "principals": [authenticated(json!({"safe_regex": {"regex": ".*/sa/other"}}))]
        }}}),
    );
    let tcp_allow = network_rbac(
        "tcp_allow.",
        json!({"policies": {
            "sleep-on-port": {
                "permissions": [{"destination_port": tcp}],
                "principals": [authenticated(json!({"exact": SLEEP}))]
            },
            "test-ns-by-sni": {
                "permissions": [{"requested_server_name": {"prefix": "tcp."}}],
                "principals": [authenticated(json!({"prefix": "spiffe://cluster.local/ns/test/"}))]
            },
            "subject-from-client": {
                "permissions": [{"destination_port_range": {"start": tcp, "end": tcp + 1}}],
                "principals": [{"and_ids": {"ids": [
                    client_ip,
                    authenticated(json!({"safe_regex": {"regex": "CN=no.*"}}))
                ]}}]
            }
        }}),
    );
    let direct = json!({"status": 200, "body": {"inline_string": "ok"}});
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "http_mtls",
                    "address": socket_address("0.0.0.0", http),
                    // As on Istio's inbound listeners; the TCP one has none, so its
                    // `requested_server_name` is "" in Envoy (the inspector tells it).
                    "listener_filters": [{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}}],
                    "filter_chains": [{
                        "transport_socket": downstream_mtls(pki),
                        "filters": [{
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                "stat_prefix": "inbound_mtls",
                                "route_config": {"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"],
                                    "routes": [{"match": {"prefix": "/"}, "direct_response": direct}]}]},
                                "http_filters": [deny, allow, {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                                }]
                            }
                        }]
                    }]
                },
                {
                    "name": "tcp_mtls",
                    "address": socket_address("0.0.0.0", tcp),
                    "filter_chains": [{
                        "transport_socket": downstream_mtls(pki),
                        "filters": [tcp_deny, tcp_allow, {
                            "name": "envoy.filters.network.tcp_proxy",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                "stat_prefix": "echo", "cluster": "echo"}
                        }]
                    }]
                }
            ],
            "clusters": [{
                "name": "echo", "type": "STATIC", "connect_timeout": "2s",
                "load_assignment": {"cluster_name": "echo", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": socket_address("127.0.0.1", ECHO)}}]}]}
            }]
        }
    })
}

#[derive(Clone, Copy)]
struct MtlsPorts {
    http: u16,
    tcp: u16,
    admin: u16,
}

const ECHO: u16 = 9000;

/// One TLS connection from `pod` to `target` with SNI `sni` and the client certificate
/// `identity` (if any): whether `payload` came back through the echo server (the
/// connection was allowed) before the connection ended.
fn tls_echoed(
    pod: &harness::Pod,
    pki: &Pki,
    target: SocketAddr,
    sni: &str,
    identity: Option<&str>,
) -> bool {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::io::{Read, Write};
    use std::sync::Arc;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pki.read("ca.pem").as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match identity {
        Some(id) => {
            let chain: Vec<_> =
                CertificateDer::pem_slice_iter(pki.read(&format!("{id}.pem")).as_bytes())
                    .map(Result::unwrap)
                    .collect();
            let key =
                PrivateKeyDer::from_pem_slice(pki.read(&format!("{id}.key")).as_bytes()).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let name = ServerName::try_from(sni.to_owned()).unwrap();
    const PAYLOAD: &[u8] = b"the payload that only an allowed connection echoes";
    pod.run_in_netns(move || {
        let Ok(mut tcp) = std::net::TcpStream::connect(target) else {
            return false;
        };
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
        if tls.write_all(PAYLOAD).and_then(|_| tls.flush()).is_err() {
            return false;
        }
        // The echo server greets first (HELLO ...\n), then echoes; read until the
        // payload is back or the connection ends.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(PAYLOAD.len()).any(|w| w == PAYLOAD) {
            match tls.read(&mut buf) {
                Ok(0) | Err(_) => return false,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .expect("entering the client pod")
}

/// Every `*rbac.*` counter the admin API at `admin` in `pod` lists.
fn rbac_stats(pod: &harness::Pod, admin: u16) -> std::collections::BTreeMap<String, u64> {
    let (status, body) =
        support::xds::admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, _)| name.contains("rbac."))
        .collect()
}

/// RBAC on mTLS identities next to Envoy 1.40: an Istio-like PKI (a root, SPIFFE URI
/// leaves for two service accounts, and a certificate with no SAN whose subject is its
/// identity), the same HTTP and network RBAC in shunt and Envoy, a table of requests and
/// connections from each identity, and equal outcomes and equal RBAC counters.
#[test]
fn rbac_on_mtls_principals_matches_envoy() {
    let pki = Pki::new("rbac-mtls");
    pki.issue(
        "server",
        "ca",
        "DNS:server.test,DNS:special.test,DNS:tcp.special.test,DNS:blocked.test",
    );
    pki.issue("sleep", "ca", &format!("URI:{SLEEP}"));
    pki.issue("other", "ca", &format!("URI:{OTHER}"));
    pki.issue("nosan", "ca", "");
    pki.open_to_the_proxy();
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let client = node.add_pod("client").expect("pod client");
    let _echo = proxy
        .command(harness::testapp_bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{ECHO}")])
        .spawn()
        .expect("echo app");
    let shunt_ports = MtlsPorts {
        http: 10443,
        tcp: 10444,
        admin: 15000,
    };
    let envoy_ports = MtlsPorts {
        http: 11443,
        tcp: 11444,
        admin: 15100,
    };
    let write = |name: &str, ports| {
        let path = pki.dir.0.join(name);
        std::fs::write(
            &path,
            mtls_bootstrap(&pki, client.ipv4(), ports).to_string(),
        )
        .unwrap();
        path
    };
    let shunt = proxy
        .command(shunt_bin())
        .args(["proxy", "--concurrency", "1", "-c"])
        .arg(write("shunt.json", shunt_ports))
        .spawn()
        .expect("start shunt");
    let envoy = proxy
        .command(support::envoy::bin())
        .args([
            "--concurrency",
            "1",
            "--use-dynamic-base-id",
            "-l",
            "warning",
            "-c",
        ])
        .arg(write("envoy.json", envoy_ports))
        .spawn()
        .expect("start envoy");
    for port in [
        shunt_ports.http,
        shunt_ports.tcp,
        envoy_ports.http,
        envoy_ports.tcp,
        ECHO,
    ] {
        wait_for_port(
            &proxy,
            SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(30),
        )
        .unwrap_or_else(|e| {
            panic!(
                "port {port}: {e}\nshunt: {}\nenvoy: {}",
                shunt.stderr_text(),
                envoy.stderr_text()
            )
        });
    }

    let https =
        |ports: MtlsPorts, identity: Option<&str>, sni: &str, method: &str, path: &str| -> u16 {
            let mut cmd = client.command("curl").args([
                "-sS",
                "--max-time",
                "10",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                method,
                "--cacert",
            ]);
            cmd = cmd.arg(pki.file("ca.pem")).arg("--resolve").arg(format!(
                "{sni}:{}:{}",
                ports.http,
                proxy.ipv4()
            ));
            if let Some(id) = identity {
                cmd = cmd
                    .arg("--cert")
                    .arg(pki.file(&format!("{id}.pem")))
                    .arg("--key")
                    .arg(pki.file(&format!("{id}.key")));
            }
            let out = cmd
                .arg(format!("https://{sni}:{}{path}", ports.http))
                .output()
                .expect("curl");
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .unwrap_or(0)
        };
    // (identity, SNI, method, path)
    let requests: &[(Option<&str>, &str, &str, &str)] = &[
        (Some("sleep"), "server.test", "GET", "/x"),
        (Some("sleep"), "server.test", "POST", "/x"),
        (Some("sleep"), "server.test", "GET", "/admin"),
        (Some("sleep"), "server.test", "GET", "/public/a"),
        (Some("sleep"), "server.test", "POST", "/public/a"),
        (Some("other"), "server.test", "GET", "/public/a"),
        (Some("other"), "server.test", "GET", "/admin/a"),
        (Some("other"), "server.test", "GET", "/x"),
        (Some("other"), "special.test", "GET", "/x"),
        (Some("other"), "special.test", "POST", "/x"),
        (Some("other"), "special.test", "GET", "/admin"),
        (Some("sleep"), "special.test", "POST", "/x"),
        (Some("nosan"), "server.test", "DELETE", "/x"),
        (None, "server.test", "GET", "/x"),
    ];
    let mut mismatches = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (identity, sni, method, path) in requests {
        let ours = https(shunt_ports, *identity, sni, method, path);
        let theirs = https(envoy_ports, *identity, sni, method, path);
        seen.insert(theirs);
        if ours != theirs {
            mismatches.push(format!(
                "HTTP {identity:?} {sni} {method} {path}: shunt {ours}, envoy {theirs}"
            ));
        }
    }
    // (identity, SNI)
    let connections: &[(Option<&str>, &str)] = &[
        (Some("sleep"), "server.test"),
        (Some("sleep"), "blocked.test"),
        (Some("other"), "server.test"),
        (Some("other"), "tcp.special.test"),
        (Some("other"), "blocked.test"),
        (Some("nosan"), "server.test"),
        (None, "server.test"),
    ];
    let mut echoed = 0;
    for (identity, sni) in connections {
        let at = |port| SocketAddr::from((proxy.ipv4(), port));
        let ours = tls_echoed(&client, &pki, at(shunt_ports.tcp), sni, *identity);
        let theirs = tls_echoed(&client, &pki, at(envoy_ports.tcp), sni, *identity);
        echoed += usize::from(theirs);
        if ours != theirs {
            mismatches.push(format!(
                "TCP {identity:?} {sni}: shunt echoed {ours}, envoy {theirs}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{}\nshunt: {}",
        mismatches.join("\n"),
        shunt.stderr_text()
    );
    assert!(
        seen.contains(&200) && seen.contains(&403) && echoed > 0 && echoed < connections.len(),
        "the table must both allow and deny: {seen:?}, {echoed} echoed"
    );

    let theirs = rbac_stats(&proxy, envoy_ports.admin);
    let ours = rbac_stats(&proxy, shunt_ports.admin);
    assert!(theirs.len() >= 8, "{theirs:?}");
    let differ: Vec<String> = theirs
        .iter()
        .filter(|(name, value)| ours.get(*name) != Some(value))
        .map(|(name, value)| format!("{name}: envoy {value}, shunt {:?}", ours.get(name)))
        .collect();
    assert!(
        differ.is_empty(),
        "{}\nshunt has: {ours:?}",
        differ.join("\n")
    );
}
