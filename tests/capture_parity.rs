//! The parity matrix: every case of istio-iptables' rules (SEEDS.md section 2), run
//! under `--backend ebpf` and under `--backend iptables`, must come out the same:
//! captured or not, to which listener (outbound 15001 / inbound 15006), the original
//! destination and the caller's address the proxy saw, and the source the app saw.
//!
//! The node: pod `a` is captured and runs `shunt proxy`; pods `b` and `c` are plain
//! peers. Every pod runs `testapp serve`, which reports the peer it sees.

mod support;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use harness::{Node, Pod, PodProcess};
use support::*;

const APP_PORT: u16 = 8080;
const OTHER_PORT: u16 = 9090;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Through the proxy's outbound listener, original destination = the target.
    Outbound,
    /// Through the proxy's inbound listener; the app sees 127.0.0.6 / ::6.
    Inbound,
    /// Straight to the target; the app sees this source address.
    Direct(IpAddr),
}

struct Case<'a> {
    name: &'static str,
    caller: Caller<'a>,
    target: SocketAddr,
    expect: Outcome,
    /// The eBPF decision counter of pod `a` this connection must add to (docs/capture.md's
    /// "How the eBPF capture decides").
    counter: &'static str,
}

/// The counters that mean "captured": none may move for a case that is not.
const CAPTURING: [&str; 3] = [
    "outbound_redirected",
    "inbound_redirected_local",
    "inbound_steered",
];

type Counters = std::collections::HashMap<String, u64>;

struct World {
    _node: Node,
    a: Pod,
    b: Pod,
    c: Pod,
    _apps: Vec<PodProcess>,
}

fn world() -> World {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let c = node.add_pod("c").expect("pod c");
    // 15020 is among the inbound exclusions of the seed's flags, 15008 is the tunnel
    // port; 22 was excluded by Istio 1.6-1.14's istio-iptables, no longer.
    let apps = vec![
        start_app(&a, &[APP_PORT, OTHER_PORT, 22, 15008, 15020]),
        start_app(&b, &[APP_PORT, OTHER_PORT]),
        start_app(&c, &[APP_PORT]),
    ];
    World {
        _node: node,
        a,
        b,
        c,
        _apps: apps,
    }
}

fn v4(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(pod.ipv4()), port)
}
fn v6(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(pod.ipv6()), port)
}
fn passthrough_source(target: &SocketAddr) -> IpAddr {
    match target {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6)),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6)),
    }
}

/// Runs one case and checks every observable; returns a description on mismatch.
/// `counters` reads pod `a`'s eBPF decision counters (eBPF backend only).
fn check(
    case: &Case,
    proxy: &PodProcess,
    counters: Option<&dyn Fn() -> Counters>,
) -> Result<(), String> {
    let before = counters.map(|read| read());
    let call = case
        .caller
        .call(case.target)
        .map_err(|e| format!("call failed: {e:#}"))?;
    if let (Some(read), Some(before)) = (counters, before) {
        let after = read();
        let added = |name: &str| {
            after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
        };
        let moved = || {
            let mut moved: Vec<_> = after
                .iter()
                .filter(|(n, _)| added(n) > 0)
                .map(|(n, _)| format!("{n} +{}", added(n)))
                .collect();
            moved.sort();
            moved.join(", ")
        };
        if added(case.counter) == 0 {
            return Err(format!(
                "eBPF counter {} did not move (moved: {})",
                case.counter,
                moved()
            ));
        }
        if let Outcome::Direct(_) = case.expect
            && let Some(c) = CAPTURING.iter().find(|c| added(c) > 0)
        {
            return Err(format!(
                "not to be captured, but eBPF counted {c} (moved: {})",
                moved()
            ));
        }
    }
    if call.bytes != case.caller.bytes as u64 {
        return Err(format!(
            "{} of {} bytes echoed",
            call.bytes, case.caller.bytes
        ));
    }
    let peer = call.server_peer.ip();
    match case.expect {
        Outcome::Outbound | Outcome::Inbound => {
            let want_dir = if case.expect == Outcome::Outbound {
                "outbound"
            } else {
                "inbound"
            };
            let entry = log_entry_for(proxy, call.client_local).ok_or_else(|| {
                format!(
                    "not captured: no access-log entry for {}",
                    call.client_local
                )
            })?;
            if entry["direction"] != want_dir {
                return Err(format!(
                    "captured {} instead of {want_dir}: {entry}",
                    entry["direction"]
                ));
            }
            if entry["original_dst"] != case.target.to_string().as_str() {
                return Err(format!(
                    "proxy saw original destination {} not {}",
                    entry["original_dst"], case.target
                ));
            }
            if case.expect == Outcome::Inbound && peer != passthrough_source(&case.target) {
                return Err(format!(
                    "app saw source {peer}, not the inbound passthrough address"
                ));
            }
        }
        Outcome::Direct(source) => {
            if !no_log_entry_for(proxy, call.client_local) {
                return Err(format!(
                    "captured, but should not be: {:?}",
                    access_log(proxy).last()
                ));
            }
            if peer != source {
                return Err(format!("app saw source {peer}, expected {source}"));
            }
        }
    }
    Ok(())
}

fn run_cases(capture: &Capture, w: &World, cases: &[Case], proxy: &PodProcess) -> Vec<String> {
    let backend = capture.backend;
    let read = || capture.pod_counters(&w.a);
    let counters: Option<&dyn Fn() -> Counters> = (backend == "ebpf").then_some(&read);
    cases
        .iter()
        .filter_map(|case| {
            check(case, proxy, counters).err().map(|e| {
                format!(
                    "[{backend}] {} ({} → {}): {e}",
                    case.name,
                    case.caller.pod.name(),
                    case.target
                )
            })
        })
        .collect()
}

/// The seed's flags: every case of the rule table.
fn seed_cases(w: &World) -> Vec<Case<'_>> {
    let (a, b) = (&w.a, &w.b);
    let app = |p| Caller::app(p);
    let proxy_uid = Caller {
        uid: PROXY_UID,
        gid: PROXY_UID,
        ..Caller::app(a)
    };
    let proxy_gid_only = Caller {
        gid: PROXY_UID,
        ..Caller::app(a)
    };
    let bound_passthrough = Caller {
        bind: Some("127.0.0.6".parse().unwrap()),
        ..Caller {
            uid: PROXY_UID,
            gid: PROXY_UID,
            ..Caller::app(a)
        }
    };
    let a4 = IpAddr::V4(a.ipv4());
    let a6 = IpAddr::V6(a.ipv6());
    let b4 = IpAddr::V4(b.ipv4());
    vec![
        Case {
            name: "outbound TCP (rule 23)",
            caller: app(a),
            target: v4(b, APP_PORT),
            expect: Outcome::Outbound,
            counter: "outbound_redirected",
        },
        Case {
            name: "outbound TCP over IPv6 (rule 23)",
            caller: app(a),
            target: v6(b, APP_PORT),
            expect: Outcome::Outbound,
            counter: "outbound_redirected",
        },
        Case {
            name: "inbound TCP (rule 13)",
            caller: app(b),
            target: v4(a, APP_PORT),
            expect: Outcome::Inbound,
            counter: "inbound_steered",
        },
        Case {
            name: "inbound TCP over IPv6 (rule 13)",
            caller: app(b),
            target: v6(a, APP_PORT),
            expect: Outcome::Inbound,
            counter: "inbound_steered",
        },
        Case {
            name: "inbound to excluded 15020 (rule 12)",
            caller: app(b),
            target: v4(a, 15020),
            expect: Outcome::Direct(b4),
            counter: "inbound_skip_port",
        },
        Case {
            name: "inbound to the HBONE tunnel port 15008 (today's first ISTIO_INBOUND rule)",
            caller: app(b),
            target: v4(a, 15008),
            expect: Outcome::Direct(b4),
            counter: "inbound_skip_port",
        },
        Case {
            name: "inbound to ssh 22 (rule 9 of the seed; today's istio-iptables captures it)",
            caller: app(b),
            target: v4(a, 22),
            expect: Outcome::Inbound,
            counter: "inbound_steered",
        },
        Case {
            name: "proxy uid's own outbound (rule 18)",
            caller: proxy_uid,
            target: v4(b, APP_PORT),
            expect: Outcome::Direct(a4),
            counter: "skip_proxy_uid",
        },
        Case {
            name: "proxy gid's own outbound (rule 21)",
            caller: proxy_gid_only,
            target: v4(b, APP_PORT),
            expect: Outcome::Direct(a4),
            counter: "skip_proxy_gid",
        },
        Case {
            name: "app to 127.0.0.1 (rules 17, 22)",
            caller: app(a),
            target: "127.0.0.1:8080".parse().unwrap(),
            expect: Outcome::Direct("127.0.0.1".parse().unwrap()),
            counter: "skip_app_local",
        },
        Case {
            name: "app to ::1 (rules 17, 22)",
            caller: app(a),
            target: "[::1]:8080".parse().unwrap(),
            expect: Outcome::Direct("::1".parse().unwrap()),
            counter: "skip_app_local",
        },
        Case {
            name: "app to its own pod IP (rule 17)",
            caller: app(a),
            target: v4(a, APP_PORT),
            expect: Outcome::Direct(a4),
            counter: "skip_app_local",
        },
        Case {
            name: "app to its own pod IPv6 (rule 17)",
            caller: app(a),
            target: v6(a, APP_PORT),
            expect: Outcome::Direct(a6),
            counter: "skip_app_local",
        },
        Case {
            name: "proxy to its own pod IP goes inbound (rule 16)",
            caller: Caller {
                uid: PROXY_UID,
                gid: PROXY_UID,
                ..Caller::app(a)
            },
            target: v4(a, APP_PORT),
            expect: Outcome::Inbound,
            counter: "inbound_redirected_local",
        },
        Case {
            name: "proxy to its own pod IPv6 goes inbound (rule 16)",
            caller: Caller {
                uid: PROXY_UID,
                gid: PROXY_UID,
                ..Caller::app(a)
            },
            target: v6(a, APP_PORT),
            expect: Outcome::Inbound,
            counter: "inbound_redirected_local",
        },
        Case {
            name: "source 127.0.0.6 over lo (rule 15)",
            caller: bound_passthrough,
            target: v4(a, APP_PORT),
            expect: Outcome::Direct("127.0.0.6".parse().unwrap()),
            counter: "skip_inbound_passthrough_source",
        },
    ]
}

/// Flags that move the lines: -o, -x, -i, -b.
fn flag_cases<'w>(w: &'w World, flags: &str) -> Vec<Case<'w>> {
    let (a, b, c) = (&w.a, &w.b, &w.c);
    let a4 = IpAddr::V4(a.ipv4());
    let b4 = IpAddr::V4(b.ipv4());
    match flags {
        "-o" => vec![
            Case {
                name: "excluded outbound port (-o)",
                caller: Caller::app(a),
                target: v4(b, OTHER_PORT),
                expect: Outcome::Direct(a4),
                counter: "skip_excluded_port",
            },
            Case {
                name: "other outbound port still captured",
                caller: Caller::app(a),
                target: v4(b, APP_PORT),
                expect: Outcome::Outbound,
                counter: "outbound_redirected",
            },
        ],
        "-x" => vec![
            Case {
                name: "excluded CIDR (-x)",
                caller: Caller::app(a),
                target: v4(b, APP_PORT),
                expect: Outcome::Direct(a4),
                counter: "skip_excluded_cidr",
            },
            Case {
                name: "excluded IPv6 CIDR (-x)",
                caller: Caller::app(a),
                target: v6(b, APP_PORT),
                expect: Outcome::Direct(IpAddr::V6(a.ipv6())),
                counter: "skip_excluded_cidr",
            },
            Case {
                name: "address outside -x still captured",
                caller: Caller::app(a),
                target: v4(c, APP_PORT),
                expect: Outcome::Outbound,
                counter: "outbound_redirected",
            },
        ],
        "-i" => vec![
            Case {
                name: "included CIDR (-i) captured",
                caller: Caller::app(a),
                target: v4(c, APP_PORT),
                expect: Outcome::Outbound,
                counter: "outbound_redirected",
            },
            Case {
                name: "outside -i not captured",
                caller: Caller::app(a),
                target: v4(b, APP_PORT),
                expect: Outcome::Direct(a4),
                counter: "skip_not_included_cidr",
            },
        ],
        "-b" => vec![
            Case {
                name: "listed inbound port (-b) captured",
                caller: Caller::app(b),
                target: v4(a, APP_PORT),
                expect: Outcome::Inbound,
                counter: "inbound_steered",
            },
            Case {
                name: "unlisted inbound port not captured",
                caller: Caller::app(b),
                target: v4(a, OTHER_PORT),
                expect: Outcome::Direct(b4),
                counter: "inbound_skip_port",
            },
            Case {
                name: "ssh not special without -b '*'",
                caller: Caller::app(b),
                target: v4(a, 22),
                expect: Outcome::Direct(b4),
                counter: "inbound_skip_port",
            },
        ],
        _ => unreachable!(),
    }
}

fn parity(backend: &'static str) {
    let w = world();
    let capture = Capture::new(backend, backend);
    let mut failures = Vec::new();

    capture.install(&w.a, &[]);
    let proxy = start_proxy(&w.a);
    failures.extend(run_cases(&capture, &w, &seed_cases(&w), &proxy));
    drop(proxy);
    capture.cleanup(&w.a);

    let b_cidrs = format!("{}/32,{}/128", w.b.ipv4(), w.b.ipv6());
    let c_cidr = format!("{}/32", w.c.ipv4());
    let variants = [
        ("-o", vec!["-o", "9090"]),
        ("-x", vec!["-x", b_cidrs.as_str()]),
        ("-i", vec!["-i", c_cidr.as_str()]),
        ("-b", vec!["-b", "8080"]),
    ];
    for (which, flags) in &variants {
        capture.install(&w.a, flags);
        let proxy = start_proxy(&w.a);
        failures.extend(run_cases(&capture, &w, &flag_cases(&w, which), &proxy));
        drop(proxy);
        capture.cleanup(&w.a);
    }
    assert!(
        failures.is_empty(),
        "{} case(s) differ from istio-iptables:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn ebpf_capture_matches_istio_iptables_rules() {
    parity("ebpf");
}

#[test]
fn iptables_capture_matches_istio_iptables_rules() {
    parity("iptables");
}

/// With capture installed but the proxy not running, inbound connections are refused
/// (iptables: REDIRECT to a closed port; eBPF: sk_lookup's SK_DROP refuses the SYN),
/// without reaching the app around its proxy.
fn inbound_without_proxy_is_refused(backend: &'static str) {
    let w = world();
    let capture = Capture::new(backend, &format!("down-{backend}"));
    capture.install(&w.a, &[]);
    let err = Caller::app(&w.b)
        .call(v4(&w.a, APP_PORT))
        .expect_err("must not reach the app");
    // "refused", not a connect timeout: the SYN was answered with a reset.
    assert!(
        format!("{err:#}").to_lowercase().contains("refused"),
        "[{backend}] {err:#}"
    );
    capture.cleanup(&w.a);
}

#[test]
fn ebpf_refuses_inbound_while_the_proxy_is_down() {
    inbound_without_proxy_is_refused("ebpf");
}

#[test]
fn iptables_refuses_inbound_while_the_proxy_is_down() {
    inbound_without_proxy_is_refused("iptables");
}
