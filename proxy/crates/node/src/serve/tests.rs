//! NodePods against real network namespaces (needs root, as node mode does): each test
//! makes fresh namespaces of its own, so nothing touches the host's ports.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use shunt_upstream::netns::{in_netns, plain_tcp_socket};

fn new_netns() -> OwnedFd {
    assert_eq!(
        // SAFETY: plain syscall.
        unsafe { libc::geteuid() },
        0,
        "node mode's tests need root (network namespaces)"
    );
    std::thread::spawn(|| {
        // SAFETY: unshares only this short-lived thread's network namespace.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare");
        // A child forked from this thread starts in its namespace.
        let up = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip");
        assert!(up.success());
        OwnedFd::from(std::fs::File::open("/proc/thread-self/ns/net").unwrap())
    })
    .join()
    .unwrap()
}

fn pod(uid: &str) -> PodInfo {
    PodInfo {
        uid: uid.into(),
        name: format!("pod-{uid}"),
        namespace: "default".into(),
        container_id: format!("c-{uid}"),
        netns_path: None,
        ips: vec!["10.1.2.3".parse().unwrap(), "fd00::3".parse().unwrap()],
        service_account: None,
        dns: None,
        token_path: None,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A blocking connect made from inside `netns`.
fn connect_in(netns: &OwnedFd, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = in_netns(netns, || plain_tcp_socket(socket2::Domain::for_address(to)))?;
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    socket.connect(&to.into())?;
    Ok(socket.into())
}

fn health(netns: &OwnedFd, to: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = connect_in(netns, to)?;
    write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\n\r\n")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    Ok(reply)
}

#[test]
fn listeners_are_bound_inside_the_pod_when_add_returns() {
    let rt = runtime();
    let pods = NodePods::new(NodeOptions::default(), rt.handle().clone(), None);
    let netns = new_netns();
    pods.add(pod("a"), netns.try_clone().unwrap()).unwrap();

    // At once, no retry: the health port answers inside the pod, v4 and v6.
    for addr in ["127.0.0.1:15021", "[::1]:15021"] {
        let reply = health(&netns, addr.parse().unwrap(), "/healthz/ready").unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 "), "{addr}: {reply}");
    }
    let reply = health(&netns, "127.0.0.1:15021".parse().unwrap(), "/nope").unwrap();
    assert!(reply.starts_with("HTTP/1.1 404 "), "{reply}");
    for port in [15001, 15006] {
        connect_in(&netns, SocketAddr::from(([127, 0, 0, 1], port)))
            .unwrap_or_else(|e| panic!("port {port} in the pod: {e}"));
    }

    let summaries = pods.summaries();
    assert_eq!(summaries.len(), 1);
    // 15001, 15006, 15021 and 15090, each on 0.0.0.0 and [::].
    assert_eq!(
        summaries[0].listeners.len(),
        8,
        "{:?}",
        summaries[0].listeners
    );
    assert_eq!(
        summaries[0].node_id,
        "sidecar~10.1.2.3~pod-a.default~default.svc.cluster.local"
    );
}

#[test]
fn each_pod_has_its_own_listeners_and_remove_closes_them() {
    let rt = runtime();
    let pods = NodePods::new(NodeOptions::default(), rt.handle().clone(), None);
    let (na, nb) = (new_netns(), new_netns());
    // The same ports in two pods: no clash, each namespace has its own.
    pods.add(pod("a"), na.try_clone().unwrap()).unwrap();
    pods.add(pod("b"), nb.try_clone().unwrap()).unwrap();
    // Adding again is idempotent.
    pods.add(pod("a"), na.try_clone().unwrap()).unwrap();
    let mut uids: Vec<_> = pods.served().into_iter().map(|p| p.uid).collect();
    uids.sort();
    assert_eq!(uids, ["a", "b"]);

    let ready = "127.0.0.1:15021".parse().unwrap();
    pods.remove("a");
    let refused = health(&na, ready, "/healthz/ready").unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(
        health(&nb, ready, "/healthz/ready")
            .unwrap()
            .contains("200")
    );
    // Removing an unknown pod is no error (a repeated DEL).
    pods.remove("a");
    assert_eq!(pods.served().len(), 1);
}

#[test]
fn a_port_taken_in_the_pod_fails_the_add_and_leaves_nothing() {
    let rt = runtime();
    let pods = NodePods::new(NodeOptions::default(), rt.handle().clone(), None);
    let netns = new_netns();
    // The app already holds 15006 inside the pod.
    let taken = in_netns(&netns, || {
        std::net::TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], 15006)))
    })
    .unwrap();
    let err = pods.add(pod("a"), netns.try_clone().unwrap()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("default/pod-a"), "{text}");
    assert!(text.contains("0.0.0.0:15006"), "{text}");
    assert!(pods.served().is_empty());
    // 15001, opened before 15006 failed, was closed again.
    let refused = connect_in(&netns, SocketAddr::from(([127, 0, 0, 1], 15001))).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    drop(taken);
}

#[test]
fn upstream_sockets_of_a_scope_are_made_in_the_pod() {
    let rt = runtime();
    let netns = new_netns();
    // Listening on the pod's loopback only: reachable only from inside the pod.
    let app = in_netns(&netns, || {
        std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
    })
    .unwrap();
    let to = app.local_addr().unwrap();
    let netns = Arc::new(netns);
    let connected = rt.block_on(shunt_upstream::netns::scope(netns, async move {
        shunt_upstream::connect::connect(to, None, Duration::from_secs(5)).await
    }));
    let stream = connected.expect("connect from inside the pod");
    let (_, peer) = app.accept().unwrap();
    assert_eq!(peer, stream.local_addr().unwrap());
}
