//! A node whose pods are built by the real CNI plugins (Debian's
//! containernetworking-plugins: `bridge` + `host-local`) with `shunt-cni` chained after
//! them, each invoked as a container runtime invokes plugins (env + stdin, `prevResult`
//! passed along the chain, DEL in reverse order). The plugins run inside the harness
//! node's namespace (the "host" of this node), so nothing touches the test machine's.

mod support;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use harness::{Node, shunt_bin};
use serde_json::json;
use shunt::node::enroll::Enrollment;
use shunt::node::enroll::cni_server::CniServer;
use shunt::node::{EnrollError, PodInfo, Pods};
use support::cni::*;

/// A [`Pods`] that records each pod with the inode of the netns it was handed.
#[derive(Default)]
struct Recorder {
    pods: Mutex<BTreeMap<String, (PodInfo, u64)>>,
}

impl Pods for Recorder {
    fn add(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        let inode = std::fs::File::from(netns).metadata().unwrap().ino();
        self.pods
            .lock()
            .unwrap()
            .insert(pod.uid.clone(), (pod, inode));
        Ok(())
    }
    fn remove(&self, uid: &str) {
        self.pods.lock().unwrap().remove(uid);
    }
    fn served(&self) -> Vec<PodInfo> {
        self.pods
            .lock()
            .unwrap()
            .values()
            .map(|(p, _)| p.clone())
            .collect()
    }
}

#[test]
fn pods_built_by_bridge_and_host_local_are_enrolled_with_the_addresses_host_local_gave() {
    assert!(
        Path::new(CNI_PLUGINS).join("bridge").exists(),
        "no {CNI_PLUGINS}/bridge: run `cargo xtask setup` (containernetworking-plugins)"
    );
    let node = Node::new().unwrap();
    let scratch = Scratch::new("recorder");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.88.0.0/24"}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };

    let recorder = Arc::new(Recorder::default());
    let state = scratch.join("state");
    let start = |recorder: &Arc<Recorder>| {
        let (enrollment, _) = Enrollment::open(recorder.clone(), &state).unwrap();
        CniServer::start(&socket, Arc::new(enrollment)).unwrap()
    };
    let mut agent = start(&recorder);

    let sandboxes: Vec<Sandbox> = ["a", "b", "c"].iter().map(|t| Sandbox::new(t)).collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ctr-a", "ctr-b", "ctr-c"][i],
        netns: &paths[i],
        args: pod_args(["a", "b", "c"][i]),
    };
    let mut results = Vec::new();
    for (i, sandbox) in sandboxes.iter().enumerate() {
        let result = runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}"));
        let ip = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        assert_eq!(
            sandbox.eth0_ipv4(),
            std::slice::from_ref(&ip),
            "bridge put host-local's address on eth0"
        );
        let (pod, inode) =
            recorder.pods.lock().unwrap()[&format!("uid-{}", ["a", "b", "c"][i])].clone();
        assert_eq!(pod.ips, vec![ip.parse::<std::net::IpAddr>().unwrap()]);
        assert_eq!(inode, std::fs::metadata(sandbox.path()).unwrap().ino());
        results.push(result);
    }
    assert_eq!(recorder.pods.lock().unwrap().len(), 3);

    // DEL runs the chain backwards: shunt-cni withdraws, bridge/host-local release.
    runtime.del(&invocation(1), Some(&results[1]));
    assert!(!recorder.pods.lock().unwrap().contains_key("uid-b"));
    assert!(sandboxes[1].eth0_ipv4().is_empty(), "bridge removed eth0");

    // The agent restarts in the middle: an ADD while it is down fails (and the runtime
    // cleans up), the retry once it is back succeeds; the pods enrolled before are
    // rebuilt from the state directory.
    agent.stop();
    let down = runtime.add(&invocation(1)).unwrap_err();
    assert_eq!(down["code"], 11, "{down}");
    assert!(
        sandboxes[1].eth0_ipv4().is_empty(),
        "the failed ADD was cleaned up"
    );
    let recorder = Arc::new(Recorder::default());
    let _agent = start(&recorder);
    assert_eq!(
        recorder
            .pods
            .lock()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>(),
        ["uid-a", "uid-c"],
        "rebuilt from the state directory"
    );
    let again = runtime.add(&invocation(1)).unwrap();
    assert!(
        recorder.pods.lock().unwrap().contains_key("uid-b"),
        "re-ADD enrolled: {again}"
    );

    results[1] = again;
    for (i, result) in results.iter().enumerate() {
        runtime.del(&invocation(i), Some(result));
    }
    assert!(recorder.pods.lock().unwrap().is_empty());
}

#[test]
fn a_running_shunt_node_serves_each_pod_the_instant_its_add_returns() {
    let node = Node::new().unwrap();
    let scratch = Scratch::new("agent");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let state = scratch.join("state");
    let log = scratch.join("node.log");
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.88.0.0/24"}]]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };
    let mut agent = NodeAgent::start(&node, &socket, &state, &log);
    let sandboxes: Vec<Sandbox> = ["a", "b", "c"]
        .iter()
        .map(|t| Sandbox::new(&format!("s{t}")))
        .collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ctr-a", "ctr-b", "ctr-c"][i],
        netns: &paths[i],
        args: pod_args(["a", "b", "c"][i]),
    };
    let mut ips = Vec::new();
    for (i, sandbox) in sandboxes.iter().enumerate() {
        let result = runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}\n{}", agent.log()));
        let ip = address(&result);
        // The first request, the instant ADD returned, finds the pod's proxy.
        assert_eq!(pod_health(&node, &ip), "200", "pod {i}: {}", agent.log());
        for port in [15001, 15006, 15021] {
            assert!(
                listening_ports(sandbox).contains(&port),
                "{port} in pod {i}"
            );
        }
        ips.push((ip, result));
    }

    // DEL: the pod's listeners close.
    runtime.del(&invocation(1), Some(&ips[1].1));
    assert!(
        listening_ports(&sandboxes[1]).is_empty(),
        "{:?}",
        listening_ports(&sandboxes[1])
    );

    // The agent dies: an ADD fails (the runtime will retry); a new agent serves the
    // pods of its state directory again before it takes requests, then the retry.
    agent.kill();
    assert_eq!(
        pod_health(&node, &ips[0].0),
        "000",
        "nothing serves while it is down"
    );
    let down = runtime.add(&invocation(1)).unwrap_err();
    assert_eq!(down["code"], 11, "{down}");
    let agent = NodeAgent::start(&node, &socket, &state, &log);
    assert_eq!(pod_health(&node, &ips[0].0), "200", "{}", agent.log());
    assert_eq!(pod_health(&node, &ips[2].0), "200", "{}", agent.log());
    let again = runtime.add(&invocation(1)).unwrap();
    assert_eq!(
        pod_health(&node, &address(&again)),
        "200",
        "{}",
        agent.log()
    );

    ips[1].1 = again;
    for (i, (_, result)) in ips.iter().enumerate() {
        runtime.del(&invocation(i), Some(result));
    }
    assert!(listening_ports(&sandboxes[0]).is_empty());
}

/// With capture on (eBPF attached at the node's cgroup, fail-closed): pods built by
/// bridge + host-local with shunt-cni chained reach each other and the outside through
/// the node process, original destinations kept, the inbound side seeing 127.0.0.6 as
/// behind a sidecar; a pod's first call, made the instant its ADD returned, goes
/// through; DEL releases a pod; with the agent killed calls are refused, and the next
/// agent serves the recorded pods again; a pod ADDed again is served.
#[test]
fn with_capture_cni_pods_talk_through_the_node_process_across_del_re_add_and_restart() {
    let node = Node::new().unwrap();
    let scratch = Scratch::new("capture");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let state = scratch.join("state");
    let log = scratch.join("node.log");
    let pins = Pins(PathBuf::from(format!(
        "/sys/fs/bpf/shunt-test-{}-cni-capture",
        std::process::id()
    )));
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.89.0.0/24"}]]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };
    let mut agent = NodeAgent::start_with(&node, &socket, &state, &log, Some(&pins.0));
    let sandboxes: Vec<Sandbox> = ["a", "b", "c"]
        .iter()
        .map(|t| Sandbox::new(&format!("k{t}")))
        .collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ktr-a", "ktr-b", "ktr-c"][i],
        netns: &paths[i],
        args: pod_args(["ka", "kb", "kc"][i]),
    };
    // The runtime's own loopback network first (containerd runs the `loopback` plugin
    // apart from the conflist): capture redirects to the pod's 127.0.0.1.
    for i in 0..3 {
        let lo = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
        let (ok, out) = runtime.exec("ADD", &invocation(i), &lo);
        assert!(ok, "loopback ADD: {out}");
    }
    let add = |i: usize, agent: &NodeAgent| {
        runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}\n{}", agent.log()))
    };
    let a = add(0, &agent);
    let b = add(1, &agent);
    let (a_ip, b_ip) = (address(&a), address(&b));
    let _app_b = serve(&node, &paths[1], 8080);
    // The outside: an app in the node's namespace, at the bridge's gateway.
    let gateway = "10.89.0.1";
    let _outside = serve(&node, &node.bridge_netns_path(), 9090);

    // c's first call, the instant its ADD returned: captured and served.
    let c = add(2, &agent);
    let first = call(&node, &paths[2], &format!("{b_ip}:8080"));
    assert_eq!(first["ok"], true, "{first}\n{}", agent.log());
    assert_eq!(
        peer_ip(&first),
        "127.0.0.6",
        "b's app sees the inbound passthrough"
    );
    assert_eq!(first["bytes"], 65536);

    // a to b: through a's outbound and b's inbound, original destination kept.
    let ab = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(ab["ok"], true, "{ab}\n{}", agent.log());
    assert_eq!(peer_ip(&ab), "127.0.0.6");
    // Both proxies saw the original destination (their access log lines).
    let target = format!("{b_ip}:8080");
    let client_local = ab["client_local"].as_str().unwrap().to_owned();
    let outbound = agent.entry("a's outbound", |v| {
        v["direction"] == "outbound" && v["downstream_remote_address"] == client_local.as_str()
    });
    assert_eq!(outbound["original_dst"], target.as_str(), "{outbound}");
    let upstream_local = outbound["upstream_local_address"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        upstream_local.starts_with(&format!("{a_ip}:")),
        "{outbound}"
    );
    let inbound = agent.entry("b's inbound", |v| {
        v["direction"] == "inbound" && v["downstream_remote_address"] == upstream_local.as_str()
    });
    assert_eq!(inbound["original_dst"], target.as_str(), "{inbound}");
    // a to the outside: the outside sees a's own address (a's upstream left from a).
    let out = call(&node, &paths[0], &format!("{gateway}:9090"));
    assert_eq!(out["ok"], true, "{out}\n{}", agent.log());
    assert_eq!(peer_ip(&out), a_ip);

    // DEL c: released, its listeners closed.
    runtime.del(&invocation(2), Some(&c));
    assert!(listening_ports(&sandboxes[2]).is_empty());

    // The agent dies: fail-closed, a's calls are refused in the kernel.
    agent.kill();
    let refused = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(refused["ok"], false, "{refused}");
    // A new agent serves the recorded pods again before it takes requests.
    let agent = NodeAgent::start_with(&node, &socket, &state, &log, Some(&pins.0));
    let again = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(again["ok"], true, "{again}\n{}", agent.log());
    assert_eq!(peer_ip(&again), "127.0.0.6");

    // c ADDed again: served at once.
    let c = add(2, &agent);
    let back = call(&node, &paths[2], &format!("{b_ip}:8080"));
    assert_eq!(back["ok"], true, "{back}\n{}", agent.log());
    assert_eq!(peer_ip(&back), "127.0.0.6");

    for (i, result) in [(0, &a), (1, &b), (2, &c)] {
        runtime.del(&invocation(i), Some(result));
    }
    drop(agent);
    let _ = std::fs::remove_dir(node.cgroup_path().join("agent"));
}
