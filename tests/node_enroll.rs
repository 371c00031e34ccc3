//! Enrolling pods into the node agent, as the enrollers do it: the `shunt` binary run as
//! `shunt-cni` by a "runtime" (env + stdin, as containerd and CRI-O invoke plugins), and
//! istio-cni's ZDS protocol over a real `SOCK_SEQPACKET` socket with the pod's netns fd
//! by SCM_RIGHTS. The agent side runs in the test process over a [`Pods`] that records
//! what it was asked, so enrollment is tested apart from serving.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::{Node, Pod, shunt_bin};
use prost::Message;
use serde_json::{Value, json};
use shunt::node::enroll::cni_server::CniServer;
use shunt::node::enroll::zds::{ZdsClient, proto};
use shunt::node::enroll::{Enrollment, Source, wire};
use shunt::node::{EnrollError, PodInfo, Pods};

/// A [`Pods`] that records each pod with the inode of the netns it was handed.
#[derive(Default)]
struct Recorder {
    pods: Mutex<BTreeMap<String, (PodInfo, u64)>>,
    refuse: Mutex<Option<String>>,
}

impl Pods for Recorder {
    fn add(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        if let Some(reason) = self.refuse.lock().unwrap().clone() {
            return Err(EnrollError {
                namespace: pod.namespace,
                name: pod.name,
                reason,
            });
        }
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

impl Recorder {
    fn uids(&self) -> Vec<String> {
        self.pods.lock().unwrap().keys().cloned().collect()
    }
    fn get(&self, uid: &str) -> Option<(PodInfo, u64)> {
        self.pods.lock().unwrap().get(uid).cloned()
    }
}

fn inode(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

/// A scratch directory (state dir, sockets, the plugin's name) removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("shunt-enroll-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    /// `shunt` under the name a runtime calls it by.
    fn plugin(&self) -> PathBuf {
        let link = self.path("shunt-cni");
        if !link.exists() {
            std::os::unix::fs::symlink(shunt_bin(), &link).unwrap();
        }
        link
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent side: an enrollment over a recorder, serving the CNI socket.
struct Agent {
    recorder: Arc<Recorder>,
    enrollment: Arc<Enrollment>,
    server: CniServer,
}

fn start_agent(scratch: &Scratch) -> Agent {
    let recorder = Arc::new(Recorder::default());
    let (enrollment, _) = Enrollment::open(recorder.clone(), &scratch.path("state")).unwrap();
    let enrollment = Arc::new(enrollment);
    let server = CniServer::start(&scratch.path("cni.sock"), enrollment.clone()).unwrap();
    Agent {
        recorder,
        enrollment,
        server,
    }
}

/// One plugin run: (parsed stdout, exit success).
struct Run {
    stdout: Value,
    success: bool,
}

impl Run {
    fn code(&self) -> u64 {
        self.stdout["code"].as_u64().unwrap_or(0)
    }
}

/// Runs the plugin as a runtime would: only `CNI_*` variables, the config on stdin.
fn invoke(plugin: &Path, env: &[(&str, &str)], stdin: &str) -> Run {
    let mut child = Command::new(plugin)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let stdout = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("stdout {text:?} is not JSON: {e}"))
    };
    Run {
        stdout,
        success: out.status.success(),
    }
}

fn prev_result(pod: &Pod) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "mac": "0a:58:0a:01:00:05", "sandbox": pod.netns_path()}],
        "ips": [
            {"address": format!("{}/24", pod.ipv4()), "gateway": "10.1.0.1", "interface": 0},
            {"address": format!("{}/64", pod.ipv6()), "interface": 0}
        ],
        "dns": {}
    })
}

fn conf(socket: &Path, prev: Option<&Value>, unavailable: &str) -> String {
    let mut c = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "shunt-cni",
        "agent_socket": socket,
        "agent_unavailable": unavailable,
        // These cases are about an agent that is gone, not one restarting.
        "agent_wait_seconds": 0,
    });
    if let Some(prev) = prev {
        c["prevResult"] = prev.clone();
    }
    c.to_string()
}

fn cni_args(ns: &str, name: &str, uid: &str) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID=ctr-{name};K8S_POD_UID={uid}"
    )
}

fn env<'a>(
    command: &'a str,
    container: &'a str,
    netns: &'a str,
    args: &'a str,
) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", args),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
}

#[test]
fn version_lists_the_spec_versions_we_speak() {
    let scratch = Scratch::new("version");
    let run = invoke(
        &scratch.plugin(),
        &[("CNI_COMMAND", "VERSION")],
        r#"{"cniVersion":"1.0.0"}"#,
    );
    assert!(run.success);
    assert_eq!(run.stdout["cniVersion"], "1.0.0");
    let versions: Vec<&str> = run.stdout["supportedVersions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        versions.contains(&"1.0.0") && versions.contains(&"0.4.0"),
        "{versions:?}"
    );
}

#[test]
fn add_check_del_enroll_and_withdraw_the_pod_with_its_own_netns() {
    let scratch = Scratch::new("add");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("web").unwrap();
    let agent = start_agent(&scratch);
    let netns = pod.netns_path();
    let netns = netns.to_str().unwrap();
    let args = cni_args("shop", "web-0", "uid-web-0");
    let prev = prev_result(&pod);
    let config = conf(agent.server.path(), Some(&prev), "fail");

    let add = invoke(
        &scratch.plugin(),
        &env("ADD", "ctr-web", netns, &args),
        &config,
    );
    assert!(add.success, "{}", add.stdout);
    assert_eq!(add.stdout, prev, "ADD prints the previous result unchanged");
    let (info, ino) = agent
        .recorder
        .get("uid-web-0")
        .expect("the pod is enrolled");
    assert_eq!(
        ino,
        inode(&pod.netns_path()),
        "the fd received is the pod's netns"
    );
    assert_eq!(info.name, "web-0");
    assert_eq!(info.namespace, "shop");
    assert_eq!(info.container_id, "ctr-web");
    assert_eq!(info.netns_path.as_deref(), Some(pod.netns_path().as_path()));
    assert_eq!(
        info.ips,
        vec![pod.ipv4().into(), std::net::IpAddr::from(pod.ipv6())]
    );
    assert!(
        scratch.path("state/pods/uid-web-0.json").is_file(),
        "recorded"
    );

    let check = invoke(
        &scratch.plugin(),
        &env("CHECK", "ctr-web", netns, &args),
        &config,
    );
    assert!(check.success, "{}", check.stdout);

    // DEL by container id alone (a runtime may leave CNI_ARGS out on DEL).
    let del = invoke(&scratch.plugin(), &env("DEL", "ctr-web", "", ""), &config);
    assert!(del.success && del.stdout.is_null(), "{}", del.stdout);
    assert!(agent.recorder.uids().is_empty(), "withdrawn");
    assert!(!scratch.path("state/pods/uid-web-0.json").exists());

    // The pod ADDed again in a new sandbox; the old sandbox's DEL comes late and must
    // not withdraw it.
    let readd = invoke(
        &scratch.plugin(),
        &env("ADD", "ctr-web-2", netns, &args),
        &config,
    );
    assert!(readd.success, "{}", readd.stdout);
    let late = invoke(
        &scratch.plugin(),
        &env("DEL", "ctr-web", netns, &args),
        &config,
    );
    assert!(late.success, "{}", late.stdout);
    assert_eq!(
        agent.recorder.uids(),
        ["uid-web-0"],
        "a stale DEL left the pod"
    );
    let del = invoke(
        &scratch.plugin(),
        &env("DEL", "ctr-web-2", netns, &args),
        &config,
    );
    assert!(del.success, "{}", del.stdout);
    assert!(agent.recorder.uids().is_empty());

    let check = invoke(
        &scratch.plugin(),
        &env("CHECK", "ctr-web", netns, &args),
        &config,
    );
    assert!(!check.success);
    assert_eq!(check.code(), 100, "{}", check.stdout);
    let again = invoke(
        &scratch.plugin(),
        &env("DEL", "ctr-web", netns, &args),
        &config,
    );
    assert!(again.success, "a repeated DEL succeeds: {}", again.stdout);
}

#[test]
fn bad_invocations_get_the_specs_error_codes() {
    let scratch = Scratch::new("errors");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("web").unwrap();
    let agent = start_agent(&scratch);
    let netns = pod.netns_path();
    let netns = netns.to_str().unwrap();
    let args = cni_args("shop", "web-0", "uid-web-0");
    let prev = prev_result(&pod);
    let good = conf(agent.server.path(), Some(&prev), "fail");
    let plugin = scratch.plugin();

    let no_command = invoke(&plugin, &[("CNI_CONTAINERID", "c")], &good);
    assert_eq!((no_command.success, no_command.code()), (false, 4));
    assert!(
        no_command.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("CNI_COMMAND")
    );
    assert_eq!(no_command.stdout["cniVersion"], "1.0.0");

    let garbage = invoke(&plugin, &env("ADD", "c", netns, &args), "{not json");
    assert_eq!((garbage.success, garbage.code()), (false, 6));

    let mut old: Value = serde_json::from_str(&good).unwrap();
    old["cniVersion"] = "0.2.0".into();
    let old = invoke(&plugin, &env("ADD", "c", netns, &args), &old.to_string());
    assert_eq!((old.success, old.code()), (false, 1), "{}", old.stdout);
    assert_eq!(
        old.stdout["cniVersion"], "0.2.0",
        "errors speak the config's version"
    );

    let unchained = conf(agent.server.path(), None, "fail");
    let unchained = invoke(&plugin, &env("ADD", "c", netns, &args), &unchained);
    assert_eq!((unchained.success, unchained.code()), (false, 7));

    let no_netns = invoke(
        &plugin,
        &env("ADD", "c", "/var/run/netns/no-such-pod", &args),
        &good,
    );
    assert_eq!((no_netns.success, no_netns.code()), (false, 4));
    assert!(
        no_netns.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("CNI_NETNS")
    );

    let mut bad_ip = prev.clone();
    bad_ip["ips"][1]["address"] = "not-an-ip".into();
    let bad_ip = invoke(
        &plugin,
        &env("ADD", "c", netns, &args),
        &conf(agent.server.path(), Some(&bad_ip), "fail"),
    );
    assert_eq!((bad_ip.success, bad_ip.code()), (false, 7));
    assert!(
        bad_ip.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("prevResult.ips[1].address")
    );

    *agent.recorder.refuse.lock().unwrap() = Some("no listeners for you".into());
    let refused = invoke(&plugin, &env("ADD", "c", netns, &args), &good);
    assert_eq!((refused.success, refused.code()), (false, 100));
    assert!(
        refused.stdout["details"]
            .as_str()
            .unwrap()
            .contains("no listeners for you"),
        "{}",
        refused.stdout
    );
    *agent.recorder.refuse.lock().unwrap() = None;
    let bad_uid = invoke(
        &plugin,
        &env("ADD", "c", netns, &cni_args("shop", "web-0", "../../etc")),
        &good,
    );
    assert_eq!((bad_uid.success, bad_uid.code()), (false, 100));
    assert!(
        bad_uid.stdout["details"].as_str().unwrap().contains("uid"),
        "{}",
        bad_uid.stdout
    );
    assert!(agent.recorder.uids().is_empty(), "nothing half-enrolled");
    assert!(agent.enrollment.recorded().is_empty(), "nothing recorded");
}

#[test]
fn agent_down_fails_or_passes_per_policy_and_excluded_namespaces_pass_through() {
    let scratch = Scratch::new("down");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("web").unwrap();
    let netns = pod.netns_path();
    let netns = netns.to_str().unwrap();
    let args = cni_args("shop", "web-0", "uid-web-0");
    let prev = prev_result(&pod);
    let nowhere = scratch.path("no-agent.sock");
    let plugin = scratch.plugin();

    let fail = invoke(
        &plugin,
        &env("ADD", "c", netns, &args),
        &conf(&nowhere, Some(&prev), "fail"),
    );
    assert_eq!((fail.success, fail.code()), (false, 11), "{}", fail.stdout);
    assert!(
        fail.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("no-agent.sock")
    );

    let pass = invoke(
        &plugin,
        &env("ADD", "c", netns, &args),
        &conf(&nowhere, Some(&prev), "pass"),
    );
    assert!(pass.success, "{}", pass.stdout);
    assert_eq!(pass.stdout, prev);

    let check = invoke(
        &plugin,
        &env("CHECK", "c", netns, &args),
        &conf(&nowhere, Some(&prev), "fail"),
    );
    assert_eq!((check.success, check.code()), (false, 11));

    let del = invoke(
        &plugin,
        &env("DEL", "c", netns, &args),
        &conf(&nowhere, Some(&prev), "fail"),
    );
    assert!(
        del.success,
        "DEL succeeds with the agent down: {}",
        del.stdout
    );

    let system = cni_args("kube-system", "coredns-0", "uid-dns");
    let excluded = invoke(
        &plugin,
        &env("ADD", "c", netns, &system),
        &conf(&nowhere, Some(&prev), "fail"),
    );
    assert!(excluded.success, "{}", excluded.stdout);
    assert_eq!(excluded.stdout, prev);

    let not_k8s = invoke(
        &plugin,
        &env("ADD", "c", netns, "IgnoreUnknown=1"),
        &conf(&nowhere, Some(&prev), "fail"),
    );
    assert!(
        not_k8s.success,
        "a non-Kubernetes container passes: {}",
        not_k8s.stdout
    );

    // A hung agent (it never accepts) counts as down once agent_timeout_seconds pass.
    let hung = scratch.path("hung.sock");
    let _listener = wire::bind(&hung).unwrap();
    for (policy, success) in [("fail", false), ("pass", true)] {
        let mut config: Value = serde_json::from_str(&conf(&hung, Some(&prev), policy)).unwrap();
        config["agent_timeout_seconds"] = 1.into();
        let run = invoke(&plugin, &env("ADD", "c", netns, &args), &config.to_string());
        assert_eq!(run.success, success, "{policy}: {}", run.stdout);
        if !success {
            assert_eq!(run.code(), 11, "{}", run.stdout);
        }
    }
}

/// istio-cni's end of ZDS: listens, reads the hello, sends requests, reads acks.
struct IstioCni {
    listener: std::os::unix::net::UnixListener,
}

impl IstioCni {
    fn accept(&self) -> UnixStream {
        let (conn, _) = self.listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let hello = wire::recv(conn.as_fd()).unwrap();
        let hello = proto::ZdsHello::decode(&hello.bytes[..]).unwrap();
        assert_eq!(hello.version, proto::Version::V1 as i32);
        conn
    }
}

fn request(conn: &UnixStream, payload: proto::Request, fd: Option<&OwnedFd>) -> String {
    let msg = proto::WorkloadRequest {
        payload: Some(payload),
    };
    wire::send(conn.as_fd(), &msg.encode_to_vec(), fd.map(AsFd::as_fd)).unwrap();
    let reply = wire::recv(conn.as_fd()).unwrap();
    let response = proto::WorkloadResponse::decode(&reply.bytes[..]).unwrap();
    match response.payload {
        Some(proto::Response::Ack(ack)) => ack.error,
        None => panic!("a response without an ack"),
    }
}

fn add(uid: &str, name: &str) -> proto::Request {
    proto::Request::Add(proto::AddWorkload {
        uid: uid.into(),
        workload_info: Some(proto::WorkloadInfo {
            name: name.into(),
            namespace: "shop".into(),
            service_account: format!("sa-{name}"),
        }),
    })
}

fn open(pod: &Pod) -> OwnedFd {
    std::fs::File::open(pod.netns_path()).unwrap().into()
}

#[test]
fn zds_enrolls_pods_from_istio_cni_with_their_netns_fds() {
    let scratch = Scratch::new("zds");
    let mut node = Node::new().unwrap();
    let a = node.add_pod("a").unwrap();
    let b = node.add_pod("b").unwrap();
    let recorder = Arc::new(Recorder::default());
    let (enrollment, _) = Enrollment::open(recorder.clone(), &scratch.path("state")).unwrap();
    let istio_cni = IstioCni {
        listener: wire::bind(&scratch.path("ztunnel.sock")).unwrap(),
    };
    let _client = ZdsClient::start(&scratch.path("ztunnel.sock"), Arc::new(enrollment)).unwrap();

    let conn = istio_cni.accept();
    assert_eq!(request(&conn, add("uid-a", "a"), Some(&open(&a))), "");
    let snap = proto::Request::SnapshotSent(proto::SnapshotSent {});
    assert_eq!(request(&conn, snap.clone(), None), "");
    assert_eq!(request(&conn, add("uid-b", "b"), Some(&open(&b))), "");
    let (info, ino) = recorder.get("uid-b").unwrap();
    assert_eq!(ino, inode(&b.netns_path()));
    assert_eq!(info.service_account.as_deref(), Some("sa-b"));
    assert_eq!((info.namespace.as_str(), info.name.as_str()), ("shop", "b"));
    assert_eq!(recorder.uids(), ["uid-a", "uid-b"]);

    let del = proto::Request::Del(proto::DelWorkload {
        uid: "uid-a".into(),
    });
    assert_eq!(request(&conn, del, None), "");
    assert_eq!(recorder.uids(), ["uid-b"]);

    // A pod serving refuses is said in the Ack; the session goes on.
    *recorder.refuse.lock().unwrap() = Some("bind failed".into());
    let refused = request(&conn, add("uid-c", "c"), Some(&open(&a)));
    assert!(refused.contains("bind failed"), "{refused}");
    *recorder.refuse.lock().unwrap() = None;

    // A broken protocol (an Add without its fd, a second SnapshotSent) is nacked and
    // the connection dropped; the client comes back with a new hello.
    let nack = request(&conn, add("uid-c", "c"), None);
    assert!(nack.contains("no netns fd"), "{nack}");
    let conn = istio_cni.accept();
    assert_eq!(request(&conn, snap.clone(), None), "", "a fresh session");
    assert!(request(&conn, snap, None).contains("second SnapshotSent"));
    let _conn = istio_cni.accept();
    // The empty snapshot of the fresh session removed uid-b.
    assert!(recorder.uids().is_empty(), "{:?}", recorder.uids());
}

#[test]
fn a_restart_rebuilds_pods_from_the_state_dir_and_reconciles_with_the_snapshot() {
    let scratch = Scratch::new("restart");
    let mut node = Node::new().unwrap();
    let pods: Vec<Pod> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| node.add_pod(n).unwrap())
        .collect();
    let info = |pod: &Pod, netns_path: Option<PathBuf>| PodInfo {
        uid: format!("uid-{}", pod.name()),
        name: pod.name().into(),
        namespace: "shop".into(),
        container_id: format!("ctr-{}", pod.name()),
        netns_path,
        ips: vec![pod.ipv4().into()],
        service_account: None,
        dns: None,
        token_path: None,
    };
    {
        let before = Arc::new(Recorder::default());
        let (enrollment, _) = Enrollment::open(before.clone(), &scratch.path("state")).unwrap();
        // a: a CNI pod still running after the restart; b: a CNI pod deleted while the
        // agent was down (its netns mount is gone); c, d: ZDS pods.
        enrollment
            .add(
                Source::Cni,
                info(&pods[0], Some(pods[0].netns_path())),
                open(&pods[0]),
            )
            .unwrap();
        enrollment
            .add(
                Source::Cni,
                info(&pods[1], Some(scratch.path("gone-netns"))),
                open(&pods[1]),
            )
            .unwrap();
        enrollment
            .add(Source::Zds, info(&pods[2], None), open(&pods[2]))
            .unwrap();
        enrollment
            .add(Source::Zds, info(&pods[3], None), open(&pods[3]))
            .unwrap();
        // e: a ZDS pod whose netns istio-cni cannot open after the restart (it sends Keep).
        let e = PodInfo {
            uid: "uid-e".into(),
            name: "e".into(),
            ..info(&pods[3], None)
        };
        enrollment.add(Source::Zds, e, open(&pods[3])).unwrap();
        assert_eq!(before.uids().len(), 5);
        // A damaged record is reported, not fatal.
        std::fs::write(scratch.path("state/pods/uid-x.json"), "{").unwrap();
    } // the agent "crashes": nothing is removed

    let after = Arc::new(Recorder::default());
    let (enrollment, restored) = Enrollment::open(after.clone(), &scratch.path("state")).unwrap();
    assert_eq!(restored.served, ["uid-a"]);
    assert_eq!(restored.dropped.len(), 1);
    assert_eq!(restored.dropped[0].0, "uid-b");
    assert!(
        restored.dropped[0].1.contains("gone-netns"),
        "{:?}",
        restored.dropped
    );
    assert_eq!(restored.awaiting_snapshot, ["uid-c", "uid-d", "uid-e"]);
    assert_eq!(restored.unreadable.len(), 1);
    assert!(restored.unreadable[0].contains("uid-x.json"));
    assert_eq!(after.uids(), ["uid-a"]);
    assert_eq!(
        after.get("uid-a").unwrap().1,
        inode(&pods[0].netns_path()),
        "reopened by path"
    );

    // istio-cni's snapshot sends c again, keeps e and leaves d out: d is gone.
    let enrollment = Arc::new(enrollment);
    let istio_cni = IstioCni {
        listener: wire::bind(&scratch.path("ztunnel.sock")).unwrap(),
    };
    let _client = ZdsClient::start(&scratch.path("ztunnel.sock"), enrollment.clone()).unwrap();
    let conn = istio_cni.accept();
    assert_eq!(request(&conn, add("uid-c", "c"), Some(&open(&pods[2]))), "");
    let keep = proto::Request::Keep(proto::KeepWorkload {
        uid: "uid-e".into(),
    });
    assert_eq!(request(&conn, keep, None), "");
    assert_eq!(
        request(
            &conn,
            proto::Request::SnapshotSent(proto::SnapshotSent {}),
            None
        ),
        ""
    );
    assert_eq!(after.uids(), ["uid-a", "uid-c"]);
    let recorded: HashSet<String> = enrollment
        .recorded()
        .into_iter()
        .map(|r| r.pod.uid)
        .collect();
    assert_eq!(
        recorded,
        HashSet::from(["uid-a".to_owned(), "uid-c".to_owned(), "uid-e".to_owned()])
    );
    assert!(scratch.path("state/pods/uid-e.json").exists(), "kept");
    assert!(!scratch.path("state/pods/uid-d.json").exists());
    assert!(!scratch.path("state/pods/uid-b.json").exists());
}
