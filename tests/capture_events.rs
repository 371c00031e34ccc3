//! Decision events (issue 42): for every row of docs/capture.md's "How the eBPF capture
//! decides" tables, a connection made in a pod produces exactly one decision event from
//! the hook that decides it, with the expected reason and istio-iptables rule, and
//! `shunt inspect --explain` predicts it without making the connection. A flood with
//! events on never blocks the programs: what the ring cannot hold is dropped and
//! counted, and what it delivers plus what it dropped is every decision. The programs'
//! aya-log records reach the pod's proxy log (sidecar) and the node process's log (node
//! mode, across a restart), and node mode tags every event with the pod's name.
//!
//! The node: pod `a` is captured (the seed's flags plus DNS capture) and runs `shunt
//! proxy`, its stand-in DNS proxy (dnsmasq as uid 1337 on its loopback 15053) and the
//! app (`testapp serve`); `b` and `c` are plain peers, `r` the resolver a's resolv.conf
//! names. `shunt inspect --follow --json` reads the events, one JSON object a line.

mod support;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{Node, Pod, PodProcess, shunt_bin, testapp_bin, wait_for_port};
use serde_json::Value;
use support::*;

const APP_PORT: u16 = 8080;
const OTHER_PORT: u16 = 9090;

/// A running `shunt inspect --follow --json`, its lines collected as they come.
struct Follower {
    child: Child,
    events: Arc<Mutex<Vec<Value>>>,
    stderr: Arc<Mutex<String>>,
}

impl Follower {
    fn start(bpffs: &std::path::Path, args: &[&str]) -> Follower {
        let mut child = Command::new(shunt_bin())
            .args(["inspect", "--follow", "--json", "--bpffs"])
            .arg(bpffs)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start shunt inspect --follow");
        let events = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (out, err) = (events.clone(), stderr.clone());
        let (child_out, child_err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in BufReader::new(child_out).lines().map_while(Result::ok) {
                let v = serde_json::from_str::<Value>(&line)
                    .unwrap_or_else(|e| panic!("--follow --json printed {line:?}: {e}"));
                out.lock().unwrap().push(v);
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(child_err).lines().map_while(Result::ok) {
                let mut e = err.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        });
        let f = Follower {
            child,
            events,
            stderr,
        };
        f.wait_stderr("following decision events");
        f
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn wait_stderr(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.stderr().contains(what) {
            assert!(
                Instant::now() < deadline,
                "shunt inspect --follow never said {what:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn count(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    /// The events from index `from` on that `pred` keeps: waits until one comes (5 s at
    /// most), then a little longer for any that should not.
    fn matching(&self, from: usize, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        let found = |f: &Follower| -> Vec<Value> {
            f.events.lock().unwrap()[from..]
                .iter()
                .filter(|v| pred(v))
                .cloned()
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while found(self).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        found(self)
    }

    fn since(&self, from: usize) -> Vec<Value> {
        self.events.lock().unwrap()[from..].to_vec()
    }

    /// SIGINT, as an operator's Ctrl-C; returns every event and what it said.
    fn stop(mut self) -> (Vec<Value>, String) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        std::thread::sleep(Duration::from_millis(100));
        (self.events.lock().unwrap().clone(), self.stderr())
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The outcomes of a deciding hook (not the bookkeeping after it).
fn is_decision(v: &Value) -> bool {
    matches!(
        v["outcome"].as_str(),
        Some("captured" | "passed" | "dropped")
    )
}

/// How a row's connection is made.
#[derive(Clone, Copy)]
enum How {
    /// `testapp call`: TCP with the echo protocol.
    Call,
    /// `testapp probe`: a TCP connect only (the peer speaks another protocol).
    Probe,
    /// `testapp dns-query` over UDP (connected socket or not).
    Query { connect: bool },
}

/// Which hook decides, and so how its event is found and what `--explain` answers.
#[derive(Clone, Copy, PartialEq)]
enum Hook {
    /// connect4/6 or sendmsg4/6: the event carries the caller's socket cookie.
    Socket,
    /// sk_lookup in the destination pod: the event carries the caller's address.
    Lookup,
}

struct Row<'a> {
    name: &'static str,
    caller: Caller<'a>,
    how: How,
    target: SocketAddr,
    hook: Hook,
    decision: &'static str,
    rule: &'static str,
    /// The `--explain` answer that predicts it.
    explain: &'static str,
}

/// What one connection gave: its socket cookie and its client address, as far as known.
struct Made {
    cookie: u64,
    client: Option<SocketAddr>,
}

fn make(row: &Row) -> Result<Made, String> {
    let c = &row.caller;
    let cmd = c.pod.command(testapp_bin()).uid(c.uid).gid(c.gid);
    let cmd = match row.how {
        How::Call => {
            let v = c.call_json(row.target);
            let cookie = v["cookie"].as_u64().unwrap_or(0);
            let client = v["client_local"].as_str().and_then(|s| s.parse().ok());
            return Ok(Made { cookie, client });
        }
        How::Probe => cmd.args(["probe", &row.target.to_string(), "--timeout-ms", "2000"]),
        How::Query { connect } => {
            let mut cmd = cmd
                .args([
                    "dns-query",
                    &row.target.to_string(),
                    "--name",
                    "whoami.test",
                ])
                .args(["--connect", if connect { "yes" } else { "no" }])
                .args(["--timeout-ms", "500"]);
            if let Some(bind) = c.bind {
                cmd = cmd.arg("--bind").arg(bind.to_string());
            }
            cmd
        }
    };
    let what = cmd.description();
    let out = cmd.output().map_err(|e| format!("{what}: {e:#}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.trim())
        .map_err(|_| format!("{what} printed {stdout:?} {:?}", out.stderr))?;
    match v["cookie"].as_u64() {
        Some(cookie) if cookie != 0 => Ok(Made {
            cookie,
            client: None,
        }),
        _ => Err(format!("{what}: no socket cookie in {v}")),
    }
}

/// `shunt inspect --explain` for the row, as JSON.
fn explain(capture: &Capture, pod: &Pod, row: &Row) -> Value {
    let c = &row.caller;
    let mut cmd = Command::new(shunt_bin());
    cmd.args(["inspect", "--json", "--bpffs"])
        .arg(&capture.bpffs)
        .arg("--explain")
        .arg(row.target.to_string())
        .args(["--pod", &pod_name(pod)])
        .args(["--uid", &c.uid.to_string(), "--gid", &c.gid.to_string()]);
    if let Some(src) = c.bind {
        cmd.arg("--src").arg(src.to_string());
    }
    let out = cmd.output().expect("run shunt inspect --explain");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "shunt inspect --explain printed no JSON ({e}): {stdout:?} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn pod_name(pod: &Pod) -> String {
    use std::os::unix::fs::MetadataExt;
    format!("pod_{}", std::fs::metadata(pod.netns_path()).unwrap().ino())
}

/// Runs one row; a description of what differs, if anything.
fn check(row: &Row, follower: &Follower, capture: &Capture, captured: &Pod) -> Result<(), String> {
    let from = follower.count();
    let made = make(row)?;
    let events = match row.hook {
        Hook::Socket => follower.matching(from, |v| {
            v["cookie"].as_u64() == Some(made.cookie) && is_decision(v)
        }),
        Hook::Lookup => {
            let target = row.target.to_string();
            let client_ip = match row.target {
                SocketAddr::V4(_) => IpAddr::V4(row.caller.pod.ipv4()),
                SocketAddr::V6(_) => IpAddr::V6(row.caller.pod.ipv6()),
            };
            follower.matching(from, |v| {
                let src: Option<SocketAddr> = v["src"].as_str().and_then(|s| s.parse().ok());
                let from_caller = match made.client {
                    Some(client) => src == Some(client),
                    None => src.is_some_and(|s| s.ip() == client_ip),
                };
                v["dst"] == target.as_str() && from_caller && is_decision(v)
            })
        }
    };
    let [event] = events.as_slice() else {
        return Err(format!(
            "{} decision events for it, not one: {events:?}\n(all since: {:?})",
            events.len(),
            follower.since(from)
        ));
    };
    let (decision, rule) = (event["decision"].as_str(), event["rule"].as_str());
    if (decision, rule) != (Some(row.decision), Some(row.rule)) {
        return Err(format!(
            "event says {} (rule {:?}), not {} (rule {:?}): {event}",
            event["decision"], event["rule"], row.decision, row.rule
        ));
    }
    if row.hook == Hook::Socket {
        let (uid, gid) = (event["uid"].as_u64(), event["gid"].as_u64());
        if (uid, gid) != (Some(row.caller.uid.into()), Some(row.caller.gid.into())) {
            return Err(format!("event names uid/gid {uid:?}/{gid:?}: {event}"));
        }
        if event["pod"] != pod_name(captured).as_str() {
            return Err(format!("event names pod {}: {event}", event["pod"]));
        }
    }
    let answer = explain(capture, captured, row);
    let predicted = &answer[row.explain];
    if (predicted["decision"].as_str(), predicted["rule"].as_str())
        != (Some(row.decision), Some(row.rule))
    {
        return Err(format!(
            "--explain predicted {} (rule {}) as {}: {answer}",
            predicted["decision"], predicted["rule"], row.explain
        ));
    }
    Ok(())
}

fn v4(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(pod.ipv4()), port)
}
fn v6(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(pod.ipv6()), port)
}

/// dnsmasq on `port` of `listen` answering `whoami.test` with `whoami`.
fn dnsmasq(pod: &Pod, listen: &[IpAddr], port: u16, whoami: &str) -> harness::PodCommand {
    let mut cmd = pod
        .command("dnsmasq")
        .args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-hosts",
            "--bind-interfaces",
            "--log-facility=-",
            "--pid-file=",
            "--no-resolv",
        ])
        .arg(format!("--port={port}"))
        .arg(format!("--address=/whoami.test/{whoami}"));
    for ip in listen {
        cmd = cmd.arg(format!("--listen-address={ip}"));
    }
    cmd
}

fn start_dnsmasq(cmd: harness::PodCommand, pod: &Pod, at: SocketAddr) -> PodProcess {
    let server = cmd.spawn().expect("start dnsmasq");
    wait_for_port(pod, at, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}\ndnsmasq: {}", server.stderr_text()));
    server
}

#[test]
fn every_row_of_the_decision_tables_gives_one_event_with_its_rule_and_explain_predicts_it() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let c = node.add_pod("c").expect("pod c");
    let r = node.add_pod("r").expect("pod r");
    let mut servers = vec![
        start_app(&a, &[APP_PORT, OTHER_PORT, 15008, 15020]),
        start_app(&b, &[APP_PORT, OTHER_PORT]),
        start_app(&c, &[APP_PORT, OTHER_PORT]),
    ];
    // Something on a's 127.0.0.1:53 (not a resolver), for rule 22.
    let loopback_53 = a
        .command(testapp_bin())
        .args(["serve", "--listen", "127.0.0.1:53"])
        .spawn()
        .expect("testapp on 127.0.0.1:53");
    wait_for_port(&a, local(53), Duration::from_secs(10)).expect("127.0.0.1:53");
    servers.push(loopback_53);
    let r4 = IpAddr::V4(r.ipv4());
    servers.push(start_dnsmasq(
        dnsmasq(&r, &[r4], 53, "10.99.0.2"),
        &r,
        SocketAddr::new(r4, 53),
    ));
    let proxy_dns = dnsmasq(&a, &["127.0.0.1".parse().unwrap()], 15053, "240.240.0.1")
        .args(["--user=", "--group="])
        .arg(format!("--server={r4}"))
        .uid(PROXY_UID)
        .gid(PROXY_UID);
    servers.push(start_dnsmasq(proxy_dns, &a, local(15053)));

    let capture = Capture::new("ebpf", "events-rows");
    let resolver = r4.to_string();
    capture.install(&a, &["--redirect-dns", "--dns-servers-v4", &resolver]);
    let proxy = start_proxy(&a);
    let follower = Follower::start(&capture.bpffs, &["--pod", &pod_name(&a)]);

    let app = || Caller::app(&a);
    let proxy_uid = || Caller {
        uid: PROXY_UID,
        gid: PROXY_UID,
        ..Caller::app(&a)
    };
    let row = |name, caller, how, target, hook, decision, rule, explain| Row {
        name,
        caller,
        how,
        target,
        hook,
        decision,
        rule,
        explain,
    };
    use Hook::*;
    use How::*;
    let rows = vec![
        row(
            "app to a remote service (23)",
            app(),
            Call,
            v4(&b, APP_PORT),
            Socket,
            "outbound_redirected",
            "23",
            "outbound",
        ),
        row(
            "app to a remote service over IPv6 (23)",
            app(),
            Call,
            v6(&b, APP_PORT),
            Socket,
            "outbound_redirected",
            "23",
            "outbound",
        ),
        row(
            "proxy uid to its own pod IP (16)",
            proxy_uid(),
            Call,
            v4(&a, APP_PORT),
            Socket,
            "inbound_redirected_local",
            "16",
            "outbound",
        ),
        row(
            "source bound to 127.0.0.6 (15)",
            Caller {
                bind: Some("127.0.0.6".parse().unwrap()),
                ..proxy_uid()
            },
            Call,
            v4(&a, APP_PORT),
            Socket,
            "skip_inbound_passthrough_source",
            "15",
            "outbound",
        ),
        row(
            "app to its own pod IP (17)",
            app(),
            Call,
            v4(&a, APP_PORT),
            Socket,
            "skip_app_local",
            "17",
            "outbound",
        ),
        row(
            "app to loopback (17)",
            app(),
            Call,
            local(APP_PORT),
            Socket,
            "skip_app_local",
            "17",
            "outbound",
        ),
        row(
            "proxy uid's own outbound (18)",
            proxy_uid(),
            Call,
            v4(&b, APP_PORT),
            Socket,
            "skip_proxy_uid",
            "18",
            "outbound",
        ),
        row(
            "proxy gid's own outbound (21)",
            Caller {
                gid: PROXY_UID,
                ..app()
            },
            Call,
            v4(&b, APP_PORT),
            Socket,
            "skip_proxy_gid",
            "21",
            "outbound",
        ),
        row(
            "inbound TCP (13)",
            Caller::app(&b),
            Call,
            v4(&a, APP_PORT),
            Lookup,
            "inbound_steered",
            "13",
            "inbound",
        ),
        row(
            "inbound TCP over IPv6 (13)",
            Caller::app(&b),
            Call,
            v6(&a, APP_PORT),
            Lookup,
            "inbound_steered",
            "13",
            "inbound",
        ),
        row(
            "inbound to excluded 15020 (9-12)",
            Caller::app(&b),
            Call,
            v4(&a, 15020),
            Lookup,
            "inbound_skip_port",
            "9-12",
            "inbound",
        ),
        row(
            "inbound to the tunnel port 15008 (9-12)",
            Caller::app(&b),
            Call,
            v4(&a, 15008),
            Lookup,
            "inbound_skip_port",
            "9-12",
            "inbound",
        ),
        // DNS capture's table.
        row(
            "app's UDP query to its resolver",
            app(),
            Query { connect: false },
            SocketAddr::new(r4, 53),
            Socket,
            "dns_captured_udp",
            "dns",
            "dns_udp",
        ),
        row(
            "app's connected UDP query (glibc)",
            app(),
            Query { connect: true },
            SocketAddr::new(r4, 53),
            Socket,
            "dns_captured_udp",
            "dns",
            "dns_udp",
        ),
        row(
            "app's TCP to its resolver's port 53",
            app(),
            Probe,
            SocketAddr::new(r4, 53),
            Socket,
            "dns_captured_tcp",
            "dns",
            "outbound",
        ),
        row(
            "the proxy's own UDP query (18)",
            proxy_uid(),
            Query { connect: false },
            SocketAddr::new(r4, 53),
            Socket,
            "dns_skip_proxy_uid",
            "18",
            "dns_udp",
        ),
        row(
            "UDP to port 53 of another address",
            app(),
            Query { connect: false },
            v4(&c, 53),
            Socket,
            "dns_skip_not_resolver",
            "",
            "dns_udp",
        ),
        row(
            "UDP from 127.0.0.6 over lo (15)",
            Caller {
                bind: Some("127.0.0.6".parse().unwrap()),
                ..app()
            },
            Query { connect: false },
            local(53),
            Socket,
            "dns_skip_inbound_passthrough_source",
            "15",
            "dns_udp",
        ),
        row(
            "app's TCP to 127.0.0.1:53, not a resolver (22)",
            app(),
            Call,
            local(53),
            Socket,
            "skip_loopback",
            "22",
            "outbound",
        ),
    ];
    let mut failures: Vec<String> = rows
        .iter()
        .filter_map(|row| {
            check(row, &follower, &capture, &a)
                .err()
                .map(|e| format!("{}: {e}", row.name))
        })
        .collect();

    // The DNS proxy's reply reaches the app from the resolver's address (its own row).
    let from = follower.count();
    let query = Row {
        name: "reply",
        caller: app(),
        how: Query { connect: false },
        target: SocketAddr::new(r4, 53),
        hook: Socket,
        decision: "",
        rule: "",
        explain: "",
    };
    match make(&query) {
        Ok(made) => {
            let restored = follower.matching(from, |v| {
                v["cookie"].as_u64() == Some(made.cookie) && v["decision"] == "dns_reply_restored"
            });
            if restored.len() != 1 || restored[0]["src"] != format!("{r4}:53").as_str() {
                failures.push(format!("the DNS proxy's reply: {restored:?}"));
            }
        }
        Err(e) => failures.push(format!("the DNS proxy's reply: {e}")),
    }

    // With the proxy gone, its listener leaves the map: inbound is refused (SK_DROP).
    drop(proxy);
    std::thread::sleep(Duration::from_millis(200));
    let refused = row(
        "inbound with no listener: dropped (13)",
        Caller::app(&b),
        Call,
        v4(&a, APP_PORT),
        Lookup,
        "inbound_no_listener",
        "13",
        "inbound",
    );
    if let Err(e) = check(&refused, &follower, &capture, &a) {
        failures.push(format!("{}: {e}", refused.name));
    }

    let (_, said) = follower.stop();
    assert!(
        failures.is_empty(),
        "{} row(s) wrong:\n{}\nfollower: {said}",
        failures.len(),
        failures.join("\n")
    );
    // The follower switched a's events on for its life, and off again.
    let state = inspect_json(&capture);
    let pod = state["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pod"] == pod_name(&a).as_str())
        .unwrap();
    assert_eq!(pod["events"], false, "{pod}");
    drop(servers);
}

#[test]
fn istio_iptables_flags_give_their_rules_in_events_and_explain() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let c = node.add_pod("c").expect("pod c");
    let _apps = [
        start_app(&a, &[APP_PORT, OTHER_PORT]),
        start_app(&b, &[APP_PORT, OTHER_PORT]),
        start_app(&c, &[APP_PORT, OTHER_PORT]),
    ];
    let capture = Capture::new("ebpf", "events-flags");
    let (b6, c4) = (format!("{}/128", b.ipv6()), format!("{}/32", c.ipv4()));
    capture.install(
        &a,
        &[
            "-o",
            "9090",
            "-x",
            &b6,
            "-i",
            &c4,
            "-b",
            &APP_PORT.to_string(),
        ],
    );
    let follower = Follower::start(&capture.bpffs, &["--pod", &pod_name(&a)]);
    let rows = [
        Row {
            name: "excluded outbound port (-o)",
            caller: Caller::app(&a),
            how: How::Call,
            target: v4(&c, OTHER_PORT),
            hook: Hook::Socket,
            decision: "skip_excluded_port",
            rule: "-o",
            explain: "outbound",
        },
        Row {
            name: "excluded CIDR (-x)",
            caller: Caller::app(&a),
            how: How::Call,
            target: v6(&b, APP_PORT),
            hook: Hook::Socket,
            decision: "skip_excluded_cidr",
            rule: "-x",
            explain: "outbound",
        },
        Row {
            name: "not in -i",
            caller: Caller::app(&a),
            how: How::Call,
            target: v4(&b, APP_PORT),
            hook: Hook::Socket,
            decision: "skip_not_included_cidr",
            rule: "-i",
            explain: "outbound",
        },
        Row {
            name: "inbound port not in -b",
            caller: Caller::app(&b),
            how: How::Call,
            target: v4(&a, OTHER_PORT),
            hook: Hook::Lookup,
            decision: "inbound_skip_port",
            rule: "-b",
            explain: "inbound",
        },
    ];
    let failures: Vec<String> = rows
        .iter()
        .filter_map(|row| {
            check(row, &follower, &capture, &a)
                .err()
                .map(|e| format!("{}: {e}", row.name))
        })
        .collect();
    // The ring hands each record to one reader: a second follower is refused.
    let second = Command::new(shunt_bin())
        .args(["inspect", "--follow", "--bpffs"])
        .arg(&capture.bpffs)
        .output()
        .expect("run a second follower");
    let (_, said) = follower.stop();
    assert!(
        failures.is_empty(),
        "{} row(s) wrong:\n{}\nfollower: {said}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        !second.status.success()
            && String::from_utf8_lossy(&second.stderr).contains("another `shunt inspect --follow`"),
        "{second:?}"
    );

    // --port and --decision: only the -o connection to 9090 passes both.
    let filtered = Follower::start(
        &capture.bpffs,
        &[
            "--pod",
            &pod_name(&a),
            "--port",
            "9090",
            "--decision",
            "passed",
        ],
    );
    let to_9090 = Caller::app(&a)
        .call(v4(&c, OTHER_PORT))
        .expect("a -> c:9090");
    let to_8080 = Caller::app(&a).call(v4(&b, APP_PORT)).expect("a -> b:8080");
    std::thread::sleep(Duration::from_millis(500));
    let (shown, said) = filtered.stop();
    let cookies: Vec<u64> = shown.iter().filter_map(|v| v["cookie"].as_u64()).collect();
    assert!(
        shown.iter().all(|v| v["outcome"] == "passed")
            && cookies.contains(&to_9090.cookie)
            && !cookies.contains(&to_8080.cookie),
        "{shown:?}\n{said}"
    );
}

fn inspect_json(capture: &Capture) -> Value {
    let out = Command::new(shunt_bin())
        .args(["inspect", "--json", "--bpffs"])
        .arg(&capture.bpffs)
        .output()
        .expect("run shunt inspect");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "shunt inspect --json: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn inspect(capture: &Capture, args: &[&str]) -> String {
    let out = Command::new(shunt_bin())
        .args(["inspect", "--bpffs"])
        .arg(&capture.bpffs)
        .args(args)
        .output()
        .expect("run shunt inspect");
    assert!(
        out.status.success(),
        "shunt inspect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// 256 KiB of 88-byte records (80 and the ring's 8-byte header).
const RING_RECORDS: u64 = 256 * 1024 / 88;

#[test]
fn a_flood_with_events_on_never_blocks_and_what_the_ring_cannot_hold_is_counted() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let _app = start_app(&a, &[APP_PORT]);
    let capture = Capture::new("ebpf", "events-flood");
    capture.install(&a, &[]);
    // On, and nobody reading: every app-to-loopback connect is one skip_app_local event.
    inspect(&capture, &["--events", "on", "--pod", &pod_name(&a)]);
    let before = capture.pod_counters(&a);
    let dropped_before = inspect_json(&capture)["events"]["dropped"]
        .as_u64()
        .unwrap();
    // Floods of 2.5 s until the ring is outgrown twice over: how many one flood makes
    // depends on how busy the machine is.
    let mut connections = 0;
    for _ in 0..8 {
        let report = run_ok(
            a.command(testapp_bin())
                .uid(APP_UID)
                .gid(APP_UID)
                .arg("bench-connect")
                .arg(local(APP_PORT).to_string())
                .args([
                    "--duration-ms",
                    "2500",
                    "--concurrency",
                    "2",
                    "--payload",
                    "0",
                ]),
        );
        let report: Value = serde_json::from_str(report.trim()).expect("bench-connect report");
        assert_eq!(report["errors"].as_u64().unwrap_or(0), 0, "{report}");
        connections += report["connections"].as_u64().unwrap();
        if connections > 2 * RING_RECORDS {
            break;
        }
    }
    assert!(
        connections > RING_RECORDS,
        "the flood must outgrow the ring: {connections} connections"
    );
    let after = capture.pod_counters(&a);
    let counted = after["skip_app_local"] - before.get("skip_app_local").copied().unwrap_or(0);
    assert_eq!(counted, connections, "one decision per connection");

    // Read what the ring holds.
    let follower = Follower::start(&capture.bpffs, &["--pod", &pod_name(&a)]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = usize::MAX;
    while follower.count() != last && Instant::now() < deadline {
        last = follower.count();
        std::thread::sleep(Duration::from_millis(300));
    }
    let (events, said) = follower.stop();
    assert!(
        said.contains("events shown"),
        "the follower did not stop cleanly: {said}"
    );
    let delivered = events
        .iter()
        .filter(|v| v["decision"] == "skip_app_local")
        .count() as u64;
    let dropped = inspect_json(&capture)["events"]["dropped"]
        .as_u64()
        .unwrap()
        - dropped_before;
    assert!(dropped > 0, "the ring never filled: {delivered} delivered");
    assert!(
        delivered <= RING_RECORDS,
        "{delivered} delivered, more than the ring holds"
    );
    assert_eq!(
        delivered + dropped,
        connections,
        "every decision is delivered or counted as dropped"
    );
}

#[test]
fn the_programs_aya_log_records_reach_the_pods_proxy_log() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let _app = start_app(&b, &[APP_PORT]);
    let capture = Capture::new("ebpf", "events-log");
    capture.install(&a, &[]);
    let proxy = a
        .command(shunt_bin())
        .args(["proxy", "--concurrency", "1"])
        .env("SHUNT_BPFFS", &capture.bpffs)
        .spawn()
        .expect("start shunt proxy");
    wait_for_port(&a, local(15001), Duration::from_secs(10)).expect("proxy listening");
    // A process in a's cgroup (where capture is attached) but in b's network namespace,
    // which has no capture config: the connect hook says so in the log.
    let stray = a
        .command("nsenter")
        .arg(format!("--net={}", b.netns_path().display()))
        .arg(testapp_bin())
        .args(["call", &v4(&b, APP_PORT).to_string()])
        .output()
        .expect("run the stray call");
    assert!(
        stray.status.success(),
        "{}",
        String::from_utf8_lossy(&stray.stdout)
    );
    proxy
        .wait_for_stderr(
            |l| l.contains("WARN") && l.contains("has no POD_CONFIG entry"),
            Duration::from_secs(5),
        )
        .unwrap_or_else(|_| panic!("no warning in the proxy's log:\n{}", proxy.stderr_text()));
}

/// `nodeserve` (node mode's serving with its eBPF capture) in the node's bridge
/// namespace, under the node's cgroup, driven on stdin.
struct NodeAgent {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
    cgroup: std::path::PathBuf,
}

impl NodeAgent {
    fn start(node: &Node, bpffs: &std::path::Path, tag: &str) -> NodeAgent {
        let cgroup = node.cgroup_path().join(format!("agent-{tag}"));
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", node.bridge_netns_path().display()))
            .arg(env!("CARGO_BIN_EXE_nodeserve"))
            .arg("--join-cgroup")
            .arg(&cgroup)
            .arg("--cgroup")
            .arg(node.cgroup_path())
            .arg("--bpffs")
            .arg(bpffs)
            .args(["--failure-policy", "fail-open"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start nodeserve");
        let stdin = child.stdin.take().unwrap();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (out, err) = (stdout.clone(), stderr.clone());
        let (child_out, child_err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in BufReader::new(child_out).lines().map_while(Result::ok) {
                out.lock().unwrap().push(line);
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(child_err).lines().map_while(Result::ok) {
                let mut e = err.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        });
        let agent = NodeAgent {
            child,
            stdin,
            stdout,
            stderr,
            cgroup,
        };
        agent.wait_reply("@ready");
        agent
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn wait_reply(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(line) = self
                .stdout
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.starts_with(prefix))
            {
                return line.clone();
            }
            assert!(
                Instant::now() < deadline,
                "nodeserve: no {prefix}\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Enrolls `pod` as `namespace/<pod name>`.
    fn add(&mut self, pod: &Pod, namespace: &str) {
        use std::io::Write;
        let line = format!(
            "add {0} {0} {namespace} {1} {2} {3}\n",
            pod.name(),
            pod.netns_path().display(),
            pod.ipv4(),
            pod.ipv6()
        );
        self.stdin.write_all(line.as_bytes()).unwrap();
        self.stdin.flush().unwrap();
        let reply = self.wait_reply(&format!("@added {} ", pod.name()));
        assert!(reply.starts_with("@added"), "{reply}\n{}", self.stderr());
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

#[test]
fn node_mode_tags_events_with_pod_names_and_logs_a_fail_open_pass_after_a_restart() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let _app = start_app(&b, &[APP_PORT]);
    let capture = Capture::new("ebpf", "events-node");
    let mut agent = NodeAgent::start(&node, &capture.bpffs, "1");
    agent.add(&a, "shop");
    agent.add(&b, "shop");

    // By name: the node's records gave the kernel maps each pod's namespace and name.
    let follower = Follower::start(&capture.bpffs, &["--pod", "shop/a"]);
    let call = Caller::app(&a).call(v4(&b, APP_PORT)).expect("a -> b");
    let redirected = follower.matching(0, |v| {
        v["cookie"].as_u64() == Some(call.cookie) && is_decision(v)
    });
    // The node proxy's own connection upstream, from inside a, passes by its mark.
    let upstream = follower.matching(0, |v| v["decision"] == "skip_node_proxy_mark");
    let (_, said) = follower.stop();
    assert_eq!(redirected.len(), 1, "{redirected:?}\n{said}");
    let e = &redirected[0];
    assert_eq!(
        (
            e["pod_name"].as_str(),
            e["decision"].as_str(),
            e["rule"].as_str()
        ),
        (Some("shop/a"), Some("outbound_redirected"), Some("23")),
        "{e}"
    );
    assert!(
        upstream.iter().any(|v| v["pod_name"] == "shop/a"
            && v["rule"] == "mark"
            && v["dst"] == v4(&b, APP_PORT).to_string().as_str()),
        "{upstream:?}"
    );
    let listed = inspect(&capture, &[]);
    assert!(
        listed.contains("(shop/a)") && listed.contains("(shop/b)"),
        "{listed}"
    );

    // The node process dies; a's pods fail open: the connect passes and the program
    // logs it into the node's pinned ring, which the next node process reads.
    agent.kill();
    let passed = Caller::app(&a)
        .call(v4(&b, APP_PORT))
        .expect("fail-open a -> b");
    assert_eq!(passed.server_peer.ip(), IpAddr::V4(a.ipv4()));
    let agent = NodeAgent::start(&node, &capture.bpffs, "2");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !agent.stderr().contains("passed uncaptured (fail-open)") {
        assert!(
            Instant::now() < deadline,
            "the restarted node process did not log the fail-open pass:\n{}",
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let line = agent
        .stderr()
        .lines()
        .find(|l| l.contains("passed uncaptured (fail-open)"))
        .unwrap()
        .to_owned();
    assert!(
        line.contains("WARN") && line.contains("shunt::ebpf"),
        "{line}"
    );
}
