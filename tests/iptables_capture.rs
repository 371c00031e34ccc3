//! The iptables backend's istio-iptables extras, in pods with real peers: DNS capture
//! (`--redirect-dns`) sends the app's queries to the agent's port 15053 while the
//! proxy's own reach the real resolver; `--run-validation` proves the redirect or
//! fails saying so; `--skip-rule-apply` writes nothing; and every table the goldens use
//! (mangle for TPROXY and the INVALID drop, raw for DNS zones) installs for real and
//! cleans up.

mod support;

use std::net::IpAddr;

use harness::{Node, Pod, PodProcess, shunt_bin};
use support::*;

/// A name only the stand-in DNS proxy in the pod knows, and one only the real resolver knows.
const PROXY_NAME: &str = "only-proxy.mesh.test";
const PROXY_ANSWER: &str = "10.1.2.3";
const UPSTREAM_NAME: &str = "only-upstream.example.test";
const UPSTREAM_ANSWER: &str = "10.9.9.9";

/// dnsmasq answering `name` with `answer` and nothing else (no upstream, no hosts file).
fn dnsmasq(
    pod: &Pod,
    uid: u32,
    listen: &[IpAddr],
    port: u16,
    name: &str,
    answer: &str,
) -> PodProcess {
    let mut cmd = pod.command("dnsmasq");
    for addr in listen {
        cmd = cmd.arg(format!("--listen-address={addr}"));
    }
    cmd.uid(uid)
        .gid(uid)
        .args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--log-facility=-",
            "--log-queries",
            "--pid-file=",
        ])
        .arg(format!("--port={port}"))
        .arg(format!("--address=/{name}/{answer}"))
        .arg(format!(
            "--user={}",
            if uid == 0 { "root" } else { "nobody" }
        ))
        .spawn()
        .expect("start dnsmasq")
}

/// `dig +short` as `uid` to port 53: the A records it got (empty on no answer).
fn dig(pod: &Pod, uid: u32, server: IpAddr, name: &str, tcp: bool) -> String {
    dig_port(pod, uid, server, 53, name, tcp)
}

fn dig_port(pod: &Pod, uid: u32, server: IpAddr, port: u16, name: &str, tcp: bool) -> String {
    let mut cmd = pod
        .command("dig")
        .uid(uid)
        .gid(uid)
        .args(["+short", "+tries=1", "+time=2"]);
    if tcp {
        cmd = cmd.arg("+tcp");
    }
    let out = cmd
        .arg(format!("@{server}"))
        .args(["-p", &port.to_string(), name, "A"])
        .output()
        .expect("run dig");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn wait_for_answer(
    pod: &Pod,
    uid: u32,
    (server, port): (IpAddr, u16),
    name: &str,
    answer: &str,
    dns: &PodProcess,
) {
    wait_until(
        &format!("dnsmasq at {server}:{port} answering {name}"),
        dns,
        || dig_port(pod, uid, server, port, name, false) == answer,
        || dns.stderr_text(),
    );
}

fn saved_rules(pod: &Pod) -> String {
    run_ok(pod.command("iptables-save")) + &run_ok(pod.command("ip6tables-save"))
}

/// Lines of iptables-save that are rules or our chains (not tables, comments, policies).
fn capture_lines(pod: &Pod) -> Vec<String> {
    saved_rules(pod)
        .lines()
        .filter(|l| l.starts_with("-A") || l.starts_with(":ISTIO"))
        .map(String::from)
        .collect()
}

#[test]
fn the_apps_dns_reaches_the_proxy_on_15053_and_the_proxys_own_reaches_the_resolver() {
    let mut node = Node::new().expect("node");
    let app = node.add_pod("app").expect("pod app");
    let resolver_pod = node.add_pod("resolver").expect("pod resolver");
    let resolvers = [
        IpAddr::V4(resolver_pod.ipv4()),
        IpAddr::V6(resolver_pod.ipv6()),
    ];

    let upstream = dnsmasq(
        &resolver_pod,
        0,
        &resolvers,
        53,
        UPSTREAM_NAME,
        UPSTREAM_ANSWER,
    );
    for resolver in resolvers {
        wait_for_answer(
            &resolver_pod,
            0,
            (resolver, 53),
            UPSTREAM_NAME,
            UPSTREAM_ANSWER,
            &upstream,
        );
    }
    // The agent's DNS proxy stands in: uid 1337 on loopback port 15053, no upstream.
    let loopback: [IpAddr; 2] = ["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
    let stand_in = dnsmasq(&app, PROXY_UID, &loopback, 15053, PROXY_NAME, PROXY_ANSWER);
    for lo in loopback {
        wait_for_answer(
            &app,
            PROXY_UID,
            (lo, 15053),
            PROXY_NAME,
            PROXY_ANSWER,
            &stand_in,
        );
    }

    // The pod's resolvers come from its resolv.conf, as istio-iptables reads them.
    let dir = TempDir::new("dns-resolv");
    let resolv = dir.0.join("resolv.conf");
    std::fs::write(
        &resolv,
        format!(
            "search default.svc.cluster.local\nnameserver {}\nnameserver {}\noptions ndots:5\n",
            resolvers[0], resolvers[1]
        ),
    )
    .unwrap();
    let capture = Capture::new("iptables", "dns");
    capture.install(
        &app,
        &["--redirect-dns", "--resolv-conf", resolv.to_str().unwrap()],
    );
    let rules = saved_rules(&app);
    let (v4, v6) = (resolvers[0], resolvers[1]);
    for rule in [
        format!(
            "-A ISTIO_OUTPUT_DNS -d {v4}/32 -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053"
        ),
        format!("-A ISTIO_OUTPUT_DNS -d {v4}/32 -p udp -m udp --dport 53 -j CT --zone 2"),
        format!("-A ISTIO_INBOUND -s {v4}/32 -p udp -m udp --sport 53 -j CT --zone 1"),
        format!(
            "-A ISTIO_OUTPUT_DNS -d {v6}/128 -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053"
        ),
        format!("-A ISTIO_INBOUND -s {v6}/128 -p udp -m udp --sport 53 -j CT --zone 1"),
    ] {
        assert!(rules.contains(&rule), "missing {rule:?} in:\n{rules}");
    }

    let mut wrong = Vec::new();
    for resolver in resolvers {
        let mut expect = |who: &str, uid: u32, name: &str, tcp: bool, want: Option<&str>| {
            let got = dig(&app, uid, resolver, name, tcp);
            let ok = match want {
                Some(answer) => got == answer,
                None => got != PROXY_ANSWER && got != UPSTREAM_ANSWER,
            };
            if !ok {
                wrong.push(format!(
                    "{who} (uid {uid}) {} {name} @{resolver}: got {got:?}, want {want:?}",
                    if tcp { "TCP" } else { "UDP" }
                ));
            }
        };
        for tcp in [false, true] {
            // The app asks its resolver; the stand-in answers, the resolver never sees it.
            expect("app", APP_UID, PROXY_NAME, tcp, Some(PROXY_ANSWER));
            expect("app", APP_UID, UPSTREAM_NAME, tcp, None);
            // The proxy's own queries (its forwards) leave the pod.
            expect(
                "proxy",
                PROXY_UID,
                UPSTREAM_NAME,
                tcp,
                Some(UPSTREAM_ANSWER),
            );
            expect("proxy", PROXY_UID, PROXY_NAME, tcp, None);
        }
    }
    assert!(
        wrong.is_empty(),
        "{}\nstand-in log:\n{}\nresolver log:\n{}",
        wrong.join("\n"),
        stand_in.stderr_text(),
        upstream.stderr_text()
    );
    // The resolver saw the proxy's queries (two names, UDP and TCP, per family), none
    // of the app's.
    let seen = upstream.stderr_text();
    for source in [IpAddr::V4(app.ipv4()), IpAddr::V6(app.ipv6())] {
        for name in [PROXY_NAME, UPSTREAM_NAME] {
            let asked = format!("query[A] {name} from {source}\n");
            assert_eq!(seen.matches(&asked).count(), 2, "{asked:?} in:\n{seen}");
        }
    }

    capture.cleanup(&app);
    assert!(
        !saved_rules(&app).contains("ISTIO_"),
        "{}",
        saved_rules(&app)
    );
    for resolver in resolvers {
        assert_eq!(
            dig(&app, APP_UID, resolver, UPSTREAM_NAME, false),
            UPSTREAM_ANSWER,
            "after cleanup the app reaches its resolver"
        );
    }
}

fn capture_run(pod: &Pod, flags: &[&str]) -> std::process::Output {
    pod.command(shunt_bin())
        .args(["capture", "--backend", "iptables"])
        .args(flags)
        .output()
        .expect("run shunt capture")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn run_validation_proves_the_redirect_and_fails_clearly_without_it() {
    let mut node = Node::new().expect("node");
    let pod = node.add_pod("vld").expect("pod");

    let out = capture_run(&pod, &["--run-validation"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("validation passed"), "{}", text(&out));

    // Rules broken after the fact: nothing redirects to the proxy's ports any more.
    for chain in ["ISTIO_REDIRECT", "ISTIO_IN_REDIRECT"] {
        run_ok(
            pod.command("iptables")
                .args(["-w", "-t", "nat", "-F", chain]),
        );
    }
    let out = capture_run(
        &pod,
        &[
            "--skip-rule-apply",
            "--run-validation",
            "--probe-timeout",
            "2s",
        ],
    );
    assert!(
        !out.status.success(),
        "validation passed without a redirect: {}",
        text(&out)
    );
    assert!(
        text(&out).contains("iptables validation failed")
            && text(&out).contains("127.0.0.6:15002")
            && text(&out).contains("uid 1337"),
        "{}",
        text(&out)
    );
    let out = capture_run(&pod, &["--cleanup"]);
    assert!(out.status.success(), "{}", text(&out));

    // No rules at all: validation fails the same way, and nothing was written.
    let out = capture_run(
        &pod,
        &[
            "--skip-rule-apply",
            "--run-validation",
            "--probe-timeout=1s",
        ],
    );
    assert!(
        !out.status.success() && text(&out).contains("iptables validation failed"),
        "{}",
        text(&out)
    );
    assert!(capture_lines(&pod).is_empty(), "{:?}", capture_lines(&pod));
}

#[test]
fn skip_rule_apply_writes_nothing() {
    let mut node = Node::new().expect("node");
    let pod = node.add_pod("skip").expect("pod");
    let before = saved_rules(&pod);
    let out = capture_run(
        &pod,
        &[
            "--skip-rule-apply",
            "-m",
            "TPROXY",
            "--redirect-dns",
            "--dns-servers-v4",
            "10.0.0.10",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(capture_lines(&pod).is_empty(), "{:?}", capture_lines(&pod));
    assert_eq!(
        before
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        saved_rules(&pod)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
    );
    let routes = run_ok(pod.command("ip").args(["rule", "show"]));
    assert!(!routes.contains("fwmark"), "{routes}");
}

/// Every table and flag of the goldens goes through the kernel's iptables-restore for
/// real, and `--cleanup` with the same flags leaves nothing behind.
#[test]
fn every_golden_table_installs_for_real_and_cleans_up() {
    let mut node = Node::new().expect("node");
    let pod = node.add_pod("all").expect("pod");
    let flags = [
        "-m",
        "TPROXY",
        "-b",
        "*",
        "-c",
        "not-istio-nic",
        "-k",
        "eth1",
        "-q",
        "32000",
        "-u",
        "1337,3",
        "-g",
        "1337,4",
        "--drop-invalid",
        "--redirect-dns",
        "--dns-servers-v4",
        "10.0.0.10",
        "--dns-servers-v6",
        "fd00::10",
    ];
    let out = capture_run(&pod, &flags);
    assert!(out.status.success(), "{}", text(&out));
    let rules = saved_rules(&pod);
    for want in [
        "-j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x539/0xffffffff",
        "-A ISTIO_DROP -j DROP",
        "-A PREROUTING -i eth1 -j RETURN",
        "-A OUTPUT -o not-istio-nic -j RETURN",
        "--uid-owner 3 -j CT --zone 1",
        "-d fd00::10/128 -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053",
    ] {
        assert!(rules.contains(want), "missing {want:?} in:\n{rules}");
    }
    let ip_rules = run_ok(pod.command("ip").args(["-4", "rule", "show"]));
    assert!(ip_rules.contains("fwmark 0x539 lookup 133"), "{ip_rules}");
    let local = run_ok(
        pod.command("ip")
            .args(["-6", "route", "show", "table", "133"]),
    );
    assert!(local.contains("local default dev lo"), "{local}");

    // A second install is refused and changes nothing.
    let again = capture_run(&pod, &flags);
    assert!(
        !again.status.success() && text(&again).contains("already installed"),
        "{}",
        text(&again)
    );

    let mut cleanup = vec!["--cleanup"];
    cleanup.extend(flags);
    let out = capture_run(&pod, &cleanup);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        capture_lines(&pod).is_empty(),
        "left behind: {:?}",
        capture_lines(&pod)
    );
    let ip_rules = run_ok(pod.command("ip").args(["rule", "show"]));
    assert!(!ip_rules.contains("fwmark"), "{ip_rules}");
}
