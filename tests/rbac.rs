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
