//! The story of one request across a node: the app in pod a calls pod b's address;
//! both pods have `shunt capture` + `shunt proxy`. a's proxy takes it outbound, b's
//! proxy takes it inbound and hands it to b's app from 127.0.0.6. Bytes arrive intact
//! and both proxies logged the flow.

mod support;

use std::net::{IpAddr, SocketAddr};

use harness::Node;
use support::*;

fn across_two_captured_pods(backend: &'static str) {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let capture = Capture::new(backend, &format!("e2e-{backend}"));
    capture.install(&a, &[]);
    capture.install(&b, &[]);
    let proxy_a = start_proxy(&a);
    let proxy_b = start_proxy(&b);
    let _app_b = start_app(&b, &[8080]);

    for target in [
        SocketAddr::new(IpAddr::V4(b.ipv4()), 8080),
        SocketAddr::new(IpAddr::V6(b.ipv6()), 8080),
    ] {
        // 8 MiB each way, checked by hash inside testapp.
        let caller = Caller {
            bytes: 8 << 20,
            ..Caller::app(&a)
        };
        let call = caller
            .call(target)
            .unwrap_or_else(|e| panic!("{backend}: call {target}: {e:#}"));
        assert_eq!(call.bytes, 8 << 20);
        let passthrough: IpAddr = if target.is_ipv4() { "127.0.0.6" } else { "::6" }
            .parse()
            .unwrap();
        assert_eq!(
            call.server_peer.ip(),
            passthrough,
            "{backend}: b's app should see the inbound passthrough source"
        );

        let out =
            log_entry_for(&proxy_a, call.client_local).expect("a's proxy logged the outbound flow");
        assert_eq!(out["direction"], "outbound");
        assert_eq!(out["original_dst"], target.to_string().as_str());
        assert_eq!(out["upstream_cluster"], "PassthroughCluster");
        assert_eq!(out["bytes_received"], 8 << 20);
        assert_eq!(
            out["bytes_sent"].as_u64().unwrap(),
            (8 << 20) + hello_len(&call)
        );

        // b's proxy saw a connection from a's proxy (a's pod address) to its own 8080.
        let inbound = access_log(&proxy_b)
            .into_iter()
            .find(|v| {
                v["direction"] == "inbound" && v["original_dst"] == target.to_string().as_str()
            })
            .or_else(|| {
                std::thread::sleep(std::time::Duration::from_secs(1));
                access_log(&proxy_b)
                    .into_iter()
                    .find(|v| v["original_dst"] == target.to_string().as_str())
            })
            .expect("b's proxy logged the inbound flow");
        let from: SocketAddr = inbound["downstream_remote_address"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let a_ip: IpAddr = if target.is_ipv4() {
            IpAddr::V4(a.ipv4())
        } else {
            IpAddr::V6(a.ipv6())
        };
        assert_eq!(from.ip(), a_ip);
        assert_eq!(inbound["bytes_received"], 8 << 20);
    }
    if backend == "ebpf" {
        // Per-pod counters: a redirected two outbound connects, b steered them inbound.
        let a_counts = capture.pod_counters(&a);
        let b_counts = capture.pod_counters(&b);
        assert!(
            a_counts.get("outbound_redirected").copied().unwrap_or(0) >= 2,
            "{a_counts:?}"
        );
        assert!(
            b_counts.get("inbound_steered").copied().unwrap_or(0) >= 2,
            "{b_counts:?}"
        );
        assert_eq!(b_counts.get("outbound_redirected"), None, "{b_counts:?}");
    }
    capture.cleanup(&a);
    capture.cleanup(&b);
}

/// The `HELLO peer=.. local=..` line testapp's server sends first.
fn hello_len(call: &Call) -> u64 {
    format!(
        "HELLO peer={} local={}\n",
        call.server_peer, call.server_local
    )
    .len() as u64
}

#[test]
fn request_crosses_two_ebpf_captured_pods() {
    across_two_captured_pods("ebpf");
}

#[test]
fn request_crosses_two_iptables_captured_pods() {
    across_two_captured_pods("iptables");
}
