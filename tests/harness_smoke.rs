//! The pod harness, end to end: pods talk over IPv4 and IPv6, processes run in their
//! pod's netns and cgroup with the requested credentials, and nothing is left behind.
//!
//! Each test builds its own Node; tests run in parallel threads, and every Node gets
//! its own subnet and names, so they do not interfere.

use anyhow::{Context, Result, ensure};
use harness::{Node, Pod, PodProcess, testapp_bin, wait_for_port};
use serde::Deserialize;
use std::{
    fs,
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt,
    path::PathBuf,
    time::{Duration, Instant},
};

const APP_UID: u32 = 1000;
const APP_GID: u32 = 1000;
const WAIT: Duration = Duration::from_secs(10);

/// What `testapp call` prints.
#[derive(Debug, Deserialize)]
struct CallReply {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    server_peer: Option<String>,
    #[serde(default)]
    server_local: Option<String>,
    #[serde(default)]
    client_local: Option<String>,
    #[serde(default)]
    bytes: Option<usize>,
}

/// Start `testapp serve` on 0.0.0.0:8080 and [::]:8080 in `pod`, as the app user, and
/// wait until both listeners are up.
fn serve(pod: &Pod) -> Result<PodProcess> {
    let server = pod
        .command(testapp_bin())
        .args(["serve", "--listen", "0.0.0.0:8080", "--listen", "[::]:8080"])
        .uid(APP_UID)
        .gid(APP_GID)
        .spawn()?;
    wait_for_port(pod, "0.0.0.0:8080".parse()?, WAIT)?;
    wait_for_port(pod, "[::]:8080".parse()?, WAIT)?;
    Ok(server)
}

/// `testapp call target` from `pod`, as the app user.
fn call(pod: &Pod, target: SocketAddr, bytes: usize) -> Result<CallReply> {
    let out = pod
        .command(testapp_bin())
        .args(["call", &target.to_string(), "--bytes", &bytes.to_string()])
        .uid(APP_UID)
        .gid(APP_GID)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).with_context(|| {
        format!(
            "parsing `testapp call` output {stdout:?} (stderr {:?})",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn ip_of(addr: &Option<String>) -> Result<IpAddr> {
    let addr = addr.as_deref().context("missing address")?;
    Ok(addr.parse::<SocketAddr>()?.ip())
}

/// (real, effective, saved, fs) uids, the same for gids, and supplementary groups, from
/// /proc/<pid>/status.
fn credentials(pid: u32) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|rest| {
                rest.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok((field("Uid:"), field("Gid:"), field("Groups:")))
}

#[test]
fn pods_talk_over_ipv4_and_ipv6_as_an_unprivileged_user() -> Result<()> {
    // A node with two pods.
    let mut node = Node::new()?;
    let a = node.add_pod("a")?;
    let b = node.add_pod("b")?;
    assert_ne!(a.ipv4(), b.ipv4());

    // b runs the echo server as uid/gid 1000 on both address families.
    let server = serve(&b)?;

    // It really runs as 1000:1000, with no supplementary groups.
    let (uids, gids, groups) = credentials(server.pid())?;
    assert_eq!(uids, [APP_UID; 4], "server uids");
    assert_eq!(gids, [APP_GID; 4], "server gids");
    assert!(groups.is_empty(), "server groups: {groups:?}");

    // a calls b by IPv4 and by IPv6; the bytes come back and b sees a's address.
    let cases = [
        (IpAddr::from(b.ipv4()), IpAddr::from(a.ipv4())),
        (IpAddr::from(b.ipv6()), IpAddr::from(a.ipv6())),
    ];
    for (server_ip, client_ip) in cases {
        let target = SocketAddr::new(server_ip, 8080);
        let reply = call(&a, target, 100_000)?;
        assert!(reply.ok, "call {target} failed: {:?}", reply.error);
        assert_eq!(reply.bytes, Some(100_000));
        assert_eq!(ip_of(&reply.server_peer)?, client_ip, "{reply:?}");
        assert_eq!(ip_of(&reply.server_local)?, server_ip, "{reply:?}");
        assert_eq!(ip_of(&reply.client_local)?, client_ip, "{reply:?}");

        // The server logged the same connection.
        let peer = reply.server_peer.as_deref().unwrap();
        let accept = format!("ACCEPT peer={peer} local={target}");
        server.wait_for_stdout(|line| line == accept, WAIT)?;
    }

    // Dropping the node kills the server and removes every netns and cgroup it made.
    let server_pid = server.pid();
    let leftovers: Vec<PathBuf> = vec![
        a.netns_path(),
        b.netns_path(),
        node.bridge_netns_path(),
        a.cgroup_path(),
        b.cgroup_path(),
        node.cgroup_path(),
    ];
    for path in &leftovers {
        assert!(
            path.exists(),
            "{} should exist while the node lives",
            path.display()
        );
    }
    drop(node);
    for path in &leftovers {
        assert!(!path.exists(), "{} survived the node", path.display());
    }
    assert!(
        !PathBuf::from(format!("/proc/{server_pid}")).exists(),
        "server {server_pid} survived the node"
    );
    // Commands in a dropped node's pods fail cleanly.
    assert!(a.command("true").output().is_err());
    drop(server);
    Ok(())
}

#[test]
fn a_pod_process_runs_in_the_pod_netns_and_cgroup() -> Result<()> {
    let mut node = Node::new()?;
    let pod = node.add_pod("solo")?;
    let sleeper = pod
        .command("sleep")
        .arg("60")
        .uid(APP_UID)
        .gid(APP_GID)
        .spawn()?;
    let pid = sleeper.pid();

    let netns_inode = fs::metadata(pod.netns_path())?.ino();
    let link = fs::read_link(format!("/proc/{pid}/ns/net"))?;
    assert_eq!(link.to_string_lossy(), format!("net:[{netns_inode}]"));

    let cgroup = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let relative = pod.cgroup_path();
    let relative = relative.strip_prefix(harness::cgroup2_mount()?)?;
    let want = format!("0::/{}", relative.display());
    assert!(
        cgroup.lines().any(|l| l == want),
        "/proc/{pid}/cgroup is {cgroup:?}, want a line {want:?}"
    );
    let procs = fs::read_to_string(pod.cgroup_path().join("cgroup.procs"))?;
    assert!(procs.lines().any(|l| l == pid.to_string()), "{procs:?}");

    let (uids, gids, groups) = credentials(pid)?;
    assert_eq!(
        (uids, gids, groups.len()),
        (vec![1000; 4], vec![1000; 4], 0)
    );

    // Root is the default, inside the pod netns: it sees eth0 with the pod's addresses.
    let addrs = pod
        .command("ip")
        .args(["-o", "addr", "show", "dev", "eth0"])
        .output_ok()?;
    assert!(
        addrs.contains(&format!("inet {}/24", pod.ipv4())),
        "{addrs}"
    );
    assert!(
        addrs.contains(&format!("inet6 {}/64", pod.ipv6())),
        "{addrs}"
    );
    let routes = pod
        .command("ip")
        .args(["-o", "route", "show", "default"])
        .output_ok()?;
    assert!(
        routes.contains(&format!("via {}", node.gateway_ipv4())),
        "{routes}"
    );
    let routes = pod
        .command("ip")
        .args(["-o", "-6", "route", "show", "default"])
        .output_ok()?;
    assert!(
        routes.contains(&format!("via {}", node.gateway_ipv6())),
        "{routes}"
    );
    let id = pod.command("id").args(["-u"]).output_ok()?;
    assert_eq!(id.trim(), "0");
    Ok(())
}

#[test]
fn two_nodes_alive_at_once_do_not_clash() -> Result<()> {
    let mut first = Node::new()?;
    let mut second = Node::new()?;
    assert_ne!(first.subnet(), second.subnet());
    assert_ne!(first.name(), second.name());

    let (c1, s1) = (first.add_pod("client")?, first.add_pod("server")?);
    let (c2, s2) = (second.add_pod("client")?, second.add_pod("server")?);
    assert_ne!(s1.ipv4(), s2.ipv4());
    assert_ne!(s1.ipv6(), s2.ipv6());
    assert_ne!(s1.netns_path(), s2.netns_path());
    assert_ne!(s1.cgroup_path(), s2.cgroup_path());

    let _srv1 = serve(&s1)?;
    let _srv2 = serve(&s2)?;
    for (client, server) in [(&c1, &s1), (&c2, &s2)] {
        let reply = call(client, SocketAddr::new(server.ipv4().into(), 8080), 10)?;
        assert!(reply.ok, "call failed: {:?}", reply.error);
        assert_eq!(ip_of(&reply.server_peer)?, IpAddr::from(client.ipv4()));
    }
    // The nodes are separate networks: node 1's client cannot reach node 2's server.
    let out = c1
        .command(testapp_bin())
        .args(["probe", &format!("{}:8080", s2.ipv4())])
        .output()?;
    assert!(!out.status.success(), "reached another node's pod");
    Ok(())
}

#[test]
fn output_kills_a_command_that_overruns_its_timeout() -> Result<()> {
    let mut node = Node::new()?;
    let pod = node.add_pod("slow")?;
    let started = Instant::now();
    let err = pod
        .command("sleep")
        .arg("30")
        .timeout(Duration::from_millis(300))
        .output()
        .expect_err("sleep 30 should time out");
    assert!(started.elapsed() < Duration::from_secs(5));
    let msg = format!("{err:#}");
    assert!(
        msg.contains("sleep 30") && msg.contains("timed out"),
        "{msg}"
    );

    // wait_for_stdout gives up early when the process exits without the line.
    let quick = pod.command("echo").arg("hello").spawn()?;
    assert_eq!(quick.wait_for_stdout(|l| l == "hello", WAIT)?, "hello");
    let err = quick
        .wait_for_stdout(|l| l == "never", WAIT)
        .expect_err("no such line");
    assert!(format!("{err:#}").contains("without printing"), "{err:#}");
    Ok(())
}

#[test]
fn a_new_node_sweeps_leftovers_of_dead_test_processes() -> Result<()> {
    // Fake what a SIGKILLed test run leaves: a netns and a cgroup named after a pid
    // that no longer exists.
    let mut child = std::process::Command::new("true").spawn()?;
    child.wait()?;
    let dead = child.id();
    let ghost_node = format!("sh{dead}-0");
    let ghost_ns = format!("{ghost_node}-ghost");
    let status = std::process::Command::new("ip")
        .args(["netns", "add", &ghost_ns])
        .status()?;
    ensure!(status.success(), "ip netns add {ghost_ns}");
    let ghost_cgroup = harness::cgroup2_mount()?
        .join("shunt-test")
        .join(&ghost_node)
        .join("ghost");
    fs::create_dir_all(&ghost_cgroup)?;
    let ghost_ns_path = PathBuf::from("/var/run/netns").join(&ghost_ns);
    assert!(ghost_ns_path.exists());

    let _node = Node::new()?;
    assert!(!ghost_ns_path.exists(), "leftover netns was not swept");
    assert!(
        !ghost_cgroup.parent().unwrap().exists(),
        "leftover cgroup was not swept"
    );
    Ok(())
}
