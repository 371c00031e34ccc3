//! A response judged resource by resource, shunt against a real Envoy 1.40: both proxies
//! (each in its own pod) take the same ADS pushes, state of the world and Delta, where
//! good and bad clusters and listeners are mixed (a listener `tcp_proxy` without a
//! cluster, a cluster with an unknown transport socket, and in state of the world a
//! listener name given twice). Both must answer alike: a NACK of the same version naming
//! the same resources in Envoy's words, the same active listeners and clusters with the
//! same versions, the refused listeners under `error_state` in `/config_dump` (Envoy
//! keeps none for clusters; shunt shows them), the same top-level versions, and the good
//! listeners serving. Route configurations and endpoints are judged one by one as well.
//! Needs root.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use harness::ads::resources::{named, tcp_proxy_listener};
use harness::ads::{AdsServer, Any, Received, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::Value;
use support::xds::{self, Reach, bootstrap, dump_section, eds_cluster, start_shunt, unix_server};
use support::*;

const ECHO: u16 = 9001;
const PORT: u16 = 10000;

fn listener(name: &str, port: u16, cluster: &str) -> (String, Any) {
    named(name, &tcp_proxy_listener(name, local(port), cluster))
}

/// A listener Envoy and shunt both refuse: its `tcp_proxy` names no cluster.
fn clusterless(name: &str, port: u16) -> (String, Any) {
    let mut bad = tcp_proxy_listener(name, local(port), "x");
    let filter = &mut bad.filter_chains[0].filters[0];
    let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) =
        &mut filter.config_type
    else {
        unreachable!()
    };
    use prost::Message;
    let mut proxy =
        envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy::decode(
            any.value.as_slice(),
        )
        .unwrap();
    proxy.cluster_specifier = None;
    any.value = proxy.encode_to_vec();
    named(name, &bad)
}

/// A cluster Envoy and shunt both refuse when they create it: its transport socket is
/// of a type no transport socket has. (A field out of its proto constraints, such as a
/// negative `connect_timeout`, is another matter: Envoy refuses the whole response.)
fn unsocketed(name: &str) -> (String, Any) {
    let mut cluster =
        harness::ads::resources::eds_cluster(name, harness::ads::resources::ads_source(), 1);
    cluster.transport_socket = Some(envoy_types::pb::envoy::config::core::v3::TransportSocket {
        name: "envoy.transport_sockets.router".into(),
        config_type: Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                AdsServer::any(
                    &envoy_types::pb::envoy::extensions::filters::http::router::v3::Router::default(
                    ),
                ),
            ),
        ),
    });
    named(name, &cluster)
}

/// One proxy under test.
struct Client {
    what: &'static str,
    node_id: String,
    pod: Pod,
    process: PodProcess,
}

impl Client {
    fn dump(&self) -> Value {
        xds::config_dump_at(&self.pod, xds::ADMIN)
    }

    /// What this client answered to the response of `type_url` at `version` (waits
    /// for it).
    fn reply(&self, server: &AdsServer, type_url: &str, version: &str) -> Received {
        let mut found = None;
        xds::eventually(
            &format!("{}: the answer to {type_url} {version}", self.what),
            &self.process,
            server,
            || {
                found = answer(server, &self.node_id, type_url, version);
                found.is_some()
            },
        );
        found.unwrap()
    }
}

fn answer(server: &AdsServer, node_id: &str, type_url: &str, version: &str) -> Option<Received> {
    let requests = server.requests();
    let streams: BTreeSet<u64> = requests
        .iter()
        .filter(|r| r.node_id.as_deref() == Some(node_id))
        .map(|r| r.stream)
        .collect();
    let sent = server.responses().into_iter().find(|s| {
        streams.contains(&s.stream) && s.type_url == type_url && s.version_info == version
    })?;
    requests
        .into_iter()
        .find(|r| r.stream == sent.stream && r.response_nonce == sent.nonce)
}

/// The dynamic entries of a dump section: name -> (active version, has error_state).
/// Envoy also lists refused listeners a second time without a name: those are left out.
fn entries(dump: &Value, section: &str) -> BTreeMap<String, (Value, bool)> {
    let (list, name_of): (&str, fn(&Value) -> Value) = match section {
        "ListenersConfigDump" => ("dynamic_listeners", |e| e["name"].clone()),
        _ => ("dynamic_active_clusters", |e| e["cluster"]["name"].clone()),
    };
    dump_section(dump, section)[list]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| {
            let name = name_of(e).as_str()?.to_owned();
            let version = if section == "ListenersConfigDump" {
                e["active_state"]["version_info"].clone()
            } else {
                e["version_info"].clone()
            };
            Some((name, (version, e["error_state"].is_object())))
        })
        .collect()
}

/// The refused entries of a dump section by name, including the unnamed Envoy lists
/// (named by their failed configuration).
fn refused(dump: &Value, section: &str) -> BTreeSet<String> {
    let list = if section == "ListenersConfigDump" {
        "dynamic_listeners"
    } else {
        "dynamic_active_clusters"
    };
    dump_section(dump, section)[list]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["error_state"].is_object())
        .filter_map(|e| {
            e["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .or(e["error_state"]["failed_configuration"]["name"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

/// shunt and Envoy, each in a pod of `node`, on the ADS server at `socket`.
fn start_both(
    node: &mut Node,
    dir: &std::path::Path,
    socket: &std::path::Path,
    delta: bool,
) -> Vec<Client> {
    let mut clients = Vec::new();
    for what in ["shunt", "envoy"] {
        let pod = node.add_pod(&what[..1]).unwrap();
        let mut config = bootstrap(socket, delta);
        let node_id = format!("sidecar~10.0.0.1~{what}.default~default.svc.cluster.local");
        config["node"]["id"] = node_id.clone().into();
        let path = dir.join(format!("{what}.json"));
        let process = if what == "shunt" {
            start_shunt(&pod, &path, &config, &["--concurrency", "1"])
        } else {
            std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
            pod.command(support::envoy::bin())
                .args([
                    "--concurrency",
                    "1",
                    "-l",
                    "warning",
                    "--disable-hot-restart",
                    "-c",
                ])
                .arg(&path)
                .spawn()
                .expect("start envoy")
        };
        clients.push(Client {
            what,
            node_id,
            pod,
            process,
        });
    }
    clients
}

fn partial_updates_match_envoy(delta: bool) {
    let (dir, socket, server) = unix_server(if delta {
        "partial-delta"
    } else {
        "partial-sotw"
    });
    let mut node = Node::new().unwrap();
    let clients = start_both(&mut node, &dir.0, &socket, delta);
    let _apps: Vec<PodProcess> = clients.iter().map(|c| start_app(&c.pod, &[ECHO])).collect();

    // Clusters: one good, one refused by both.
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![named(
            "backend",
            &harness::ads::resources::load_assignment("backend", &[local(ECHO)]),
        )],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![listener("good", PORT, "backend")],
    );
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("backend", 1), unsocketed("broken")],
    );
    let cds: Vec<Received> = clients
        .iter()
        .map(|c| c.reply(&server, type_urls::CLUSTER, "c1"))
        .collect();
    for (client, reply) in clients.iter().zip(&cds) {
        let (code, message) = reply
            .error_detail
            .clone()
            .unwrap_or_else(|| panic!("{}: c1 must be NACKed: {reply:?}", client.what));
        assert_eq!(code, 13, "{}: Envoy NACKs with INTERNAL", client.what);
        assert!(
            message.starts_with("Error adding/updating cluster(s) broken: "),
            "{}: {message}",
            client.what
        );
        assert!(!message.contains("backend: "), "{}: {message}", client.what);
    }
    assert_eq!(
        cds[0].version_info, cds[1].version_info,
        "the NACK's version"
    );

    // The good listener serves in both, on the good cluster.
    for client in &clients {
        let reply = client.reply(&server, type_urls::LISTENER, "l1");
        assert!(reply.is_ack(), "{}: {reply:?}", client.what);
        xds::eventually(
            &format!("{}: the good listener serves", client.what),
            &client.process,
            &server,
            || xds::reaches(&client.pod, local(PORT)) == Some(ECHO),
        );
    }

    // Listeners: the good one resent unchanged, a new good one, a refused one, and (state
    // of the world) a name given twice.
    let mut l2 = vec![
        listener("good", PORT, "backend"),
        clusterless("bad", PORT + 1),
        listener("fresh", PORT + 2, "backend"),
    ];
    if !delta {
        l2.push(listener("twin", PORT + 3, "backend"));
        // The store keys resources by name: a second key carries the same name.
        let (_, second) = listener("twin", PORT + 4, "backend");
        l2.push(("twin (again)".into(), second));
    }
    server.set(type_urls::LISTENER, "l2", l2);
    let lds: Vec<Received> = clients
        .iter()
        .map(|c| c.reply(&server, type_urls::LISTENER, "l2"))
        .collect();
    for (client, reply) in clients.iter().zip(&lds) {
        let (code, message) = reply
            .error_detail
            .clone()
            .unwrap_or_else(|| panic!("{}: l2 must be NACKed: {reply:?}", client.what));
        assert_eq!(code, 13, "{}", client.what);
        assert!(
            message.starts_with("Error adding/updating listener(s) "),
            "{}: {message}",
            client.what
        );
        assert!(message.contains("bad: "), "{}: {message}", client.what);
        assert!(!message.contains("fresh: "), "{}: {message}", client.what);
        assert!(!message.contains("good: "), "{}: {message}", client.what);
        if !delta {
            assert!(
                message.contains("twin: duplicate listener twin found\n"),
                "{}: {message}",
                client.what
            );
        }
    }
    assert_eq!(
        lds[0].version_info, lds[1].version_info,
        "the NACK's version"
    );
    if !delta {
        assert_eq!(
            lds[0].version_info, "l1",
            "a NACK carries the last version accepted whole"
        );
    }

    // Both serve the good ones, the first of the twins, and not the bad one.
    for client in &clients {
        xds::eventually(
            &format!("{}: fresh serves", client.what),
            &client.process,
            &server,
            || xds::reaches(&client.pod, local(PORT + 2)) == Some(ECHO),
        );
        assert_eq!(
            xds::reaches(&client.pod, local(PORT)),
            Some(ECHO),
            "{}",
            client.what
        );
        assert_eq!(
            xds::reach(&client.pod, local(PORT + 1)),
            Reach::Refused,
            "{}: the refused listener has no socket",
            client.what
        );
        if !delta {
            assert_eq!(
                xds::reaches(&client.pod, local(PORT + 3)),
                Some(ECHO),
                "{}",
                client.what
            );
            assert_eq!(
                xds::reach(&client.pod, local(PORT + 4)),
                Reach::Refused,
                "{}: the second twin is refused",
                client.what
            );
        }
    }

    // The dumps agree: active resources and their versions, what is refused, versions.
    let dumps: Vec<Value> = clients.iter().map(Client::dump).collect();
    for section in ["ListenersConfigDump", "ClustersConfigDump"] {
        let [ours, theirs] = [&dumps[0], &dumps[1]].map(|d| entries(d, section));
        let active = |e: &BTreeMap<String, (Value, bool)>| -> BTreeMap<String, Value> {
            e.iter()
                .filter(|(_, (v, _))| v.is_string())
                .map(|(n, (v, _))| (n.clone(), v.clone()))
                .collect()
        };
        assert_eq!(active(&ours), active(&theirs), "{section}: active versions");
        let [ours, theirs] = [&dumps[0], &dumps[1]].map(|d| refused(d, section));
        if section == "ListenersConfigDump" {
            assert_eq!(ours, theirs, "{section}: refused resources");
        } else {
            // Envoy 1.40 keeps no error state for clusters; shunt shows the refused one.
            assert!(theirs.is_empty(), "{theirs:?}");
            assert_eq!(ours, BTreeSet::from(["broken".to_owned()]));
        }
        assert_eq!(
            dump_section(&dumps[0], section)["version_info"],
            dump_section(&dumps[1], section)["version_info"],
            "{section}: version_info"
        );
    }
    // The refused listener's error state has the fields Envoy gives it.
    let error_fields = |dump: &Value| -> BTreeSet<String> {
        dump_section(dump, "ListenersConfigDump")["dynamic_listeners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["name"] == "bad")
            .and_then(|l| l["error_state"].as_object())
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(error_fields(&dumps[0]), error_fields(&dumps[1]));
    assert!(error_fields(&dumps[0]).contains("last_update_attempt"));
    let listeners = entries(&dumps[0], "ListenersConfigDump");
    assert!(
        listeners.contains_key("fresh") && listeners.contains_key("bad"),
        "{listeners:?}"
    );

    // A served listener updated to a bad version: refused, its last good version (l2)
    // keeps serving in both.
    server.set(
        type_urls::LISTENER,
        "l3",
        vec![
            listener("good", PORT, "backend"),
            clusterless("fresh", PORT + 2),
        ],
    );
    for client in &clients {
        let reply = client.reply(&server, type_urls::LISTENER, "l3");
        let (_, message) = reply
            .error_detail
            .clone()
            .unwrap_or_else(|| panic!("{}: l3 must be NACKed: {reply:?}", client.what));
        assert!(
            message.starts_with("Error adding/updating listener(s) fresh: "),
            "{}: {message}",
            client.what
        );
        assert_eq!(
            xds::reaches(&client.pod, local(PORT + 2)),
            Some(ECHO),
            "{}: the last good fresh serves",
            client.what
        );
    }
    let dumps: Vec<Value> = clients.iter().map(Client::dump).collect();
    // (Envoy also lists the removed twin while it drains, with no active state.)
    let [ours, theirs] = [&dumps[0], &dumps[1]].map(|d| {
        let mut e = entries(d, "ListenersConfigDump");
        e.retain(|_, (version, _)| version.is_string());
        e
    });
    assert_eq!(
        ours, theirs,
        "listeners after l3: versions and error states"
    );
    assert_eq!(ours["fresh"], (Value::from("l2"), true), "{ours:?}");

    // A good update clears the refusal in both.
    server.set(
        type_urls::LISTENER,
        "l4",
        vec![
            listener("good", PORT, "backend"),
            listener("fresh", PORT + 2, "backend"),
        ],
    );
    for client in &clients {
        let reply = client.reply(&server, type_urls::LISTENER, "l4");
        assert!(reply.is_ack(), "{}: {reply:?}", client.what);
    }
    let dumps: Vec<Value> = clients.iter().map(Client::dump).collect();
    let [ours, theirs] = [&dumps[0], &dumps[1]].map(|d| refused(d, "ListenersConfigDump"));
    assert_eq!(ours, theirs, "refused listeners after l4");
    assert!(ours.is_empty(), "{ours:?}");
    drop(clients);
    drop(dir);
}

#[test]
fn partial_sotw_updates_match_envoy() {
    partial_updates_match_envoy(false);
}

#[test]
fn partial_delta_updates_match_envoy() {
    partial_updates_match_envoy(true);
}

/// Route configurations are judged one by one too: of an RDS response with a changed
/// good one and a bad one, the good one applies and the bad one keeps its last good
/// version, in both (in the order where Envoy reaches the good one first).
#[test]
fn partial_route_updates_match_envoy() {
    let (dir, socket, server) = unix_server("partial-rds");
    let mut node = Node::new().unwrap();
    let clients = start_both(&mut node, &dir.0, &socket, false);
    server.set(type_urls::CLUSTER, "c1", vec![eds_cluster("backend", 1)]);
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![named(
            "backend",
            &harness::ads::resources::load_assignment("backend", &[local(ECHO)]),
        )],
    );
    let http = |name: &str, port: u16, routes: &str| {
        named(
            name,
            &harness::ads::resources::http_listener(name, local(port), routes),
        )
    };
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![http("h1", PORT, "one"), http("h2", PORT + 1, "two")],
    );
    let routes = |name: &str, prefixes: &[&str]| {
        let list: Vec<(&str, &str)> = prefixes.iter().map(|p| (*p, "backend")).collect();
        named(name, &harness::ads::resources::route_config(name, &list))
    };
    server.set(
        type_urls::ROUTE,
        "r1",
        vec![routes("one", &["/a"]), routes("two", &["/a"])],
    );
    for client in &clients {
        let reply = client.reply(&server, type_urls::ROUTE, "r1");
        assert!(reply.is_ack(), "{}: {reply:?}", client.what);
    }
    // "one" gets a virtual host whose domains repeat: both refuse it. (Envoy hands a
    // response to its RDS subscriptions newest first and stops at the first that throws:
    // a bad "two" would keep it from applying a good "one". shunt judges each alike.)
    let mut bad = harness::ads::resources::route_config("one", &[("/b", "backend")]);
    bad.virtual_hosts[0].domains = vec!["*".into(), "*".into()];
    server.set(
        type_urls::ROUTE,
        "r2",
        vec![routes("two", &["/a", "/b"]), named("one", &bad)],
    );
    let replies: Vec<Received> = clients
        .iter()
        .map(|c| c.reply(&server, type_urls::ROUTE, "r2"))
        .collect();
    for (client, reply) in clients.iter().zip(&replies) {
        assert!(reply.is_nack(), "{}: {reply:?}", client.what);
        assert_eq!(reply.version_info, "r1", "{}", client.what);
    }
    let versions = |dump: &Value| -> BTreeMap<String, Value> {
        dump_section(dump, "RoutesConfigDump")["dynamic_route_configs"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|r| {
                (
                    r["route_config"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    r["version_info"].clone(),
                )
            })
            .collect()
    };
    let [ours, theirs] = [&clients[0], &clients[1]].map(|c| versions(&c.dump()));
    assert_eq!(ours, theirs, "route configuration versions");
    assert_eq!(ours["one"], "r1", "{ours:?}");
    assert_eq!(ours["two"], "r2", "{ours:?}");
}

/// Endpoints too: of an EDS response with changed good endpoints for one cluster and
/// bad ones (an address that is no IP) for another, the good ones apply, in both.
#[test]
fn partial_endpoint_updates_match_envoy() {
    let (dir, socket, server) = unix_server("partial-eds");
    let mut node = Node::new().unwrap();
    let clients = start_both(&mut node, &dir.0, &socket, false);
    let _apps: Vec<PodProcess> = clients
        .iter()
        .map(|c| start_app(&c.pod, &[ECHO, ECHO + 1]))
        .collect();
    let cla = |name: &str, port: u16| {
        named(
            name,
            &harness::ads::resources::load_assignment(name, &[local(port)]),
        )
    };
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("one", 1), eds_cluster("two", 1)],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![cla("one", ECHO), cla("two", ECHO)],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![
            listener("l-one", PORT, "one"),
            listener("l-two", PORT + 1, "two"),
        ],
    );
    for client in &clients {
        assert!(client.reply(&server, type_urls::LISTENER, "l1").is_ack());
    }
    let mut bad = harness::ads::resources::load_assignment("one", &[local(ECHO)]);
    let Some(envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(
        endpoint,
    )) = &mut bad.endpoints[0].lb_endpoints[0].host_identifier
    else {
        unreachable!()
    };
    let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(socket)) =
        endpoint.address.as_mut().and_then(|a| a.address.as_mut())
    else {
        unreachable!()
    };
    socket.address = "not-an-ip".into();
    server.set(
        type_urls::ENDPOINT,
        "e2",
        vec![named("one", &bad), cla("two", ECHO + 1)],
    );
    for client in &clients {
        let reply = client.reply(&server, type_urls::ENDPOINT, "e2");
        assert!(reply.is_nack(), "{}: {reply:?}", client.what);
        assert_eq!(reply.version_info, "e1", "{}", client.what);
        xds::eventually(
            &format!("{}: two's new endpoints serve", client.what),
            &client.process,
            &server,
            || xds::reaches(&client.pod, local(PORT + 1)) == Some(ECHO + 1),
        );
        assert_eq!(
            xds::reaches(&client.pod, local(PORT)),
            Some(ECHO),
            "{}: one keeps its last good endpoints",
            client.what
        );
    }
}
